"""The lean decoder's CUDA forms, checked on a CPU: the prefill calls SDPA in a form torch's memory-efficient
kernel accepts (no boolean mask with grouped-query attention, an aligned additive mask), the fused step (stacked
q/k/v and gate/up products, the q/k rotation in one pass, HF's RMSNorm in one or two kernels) decodes what HF
generate and a forward pass give, its stacked weights follow the module's and live as long as their decoders, and
one token step launches at most a fixed number of kernels per layer."""

from __future__ import annotations

import gc
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import dschat.generation.lean_llama as L
from dschat.generation.decode import DschatBackend, GenerationConfig, GraphBackend
from dschat.generation.lean_llama import LeanLlama
from dschat.rlhf.rollout import answer_logprobs, make_rollout
from tests.dschat.test_generation import PAD, SMALL, hf_greedy, model_of, prompts

LEAN_KINDS = ["llama", "llama_gqa_rope3", "mistral", "qwen2"]


def efficient_kernel_refuses(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                             enable_gqa=False) -> list[str]:
    """Why torch's memory-efficient SDPA kernel (the only fused CUDA kernel that takes a mask) would not run this
    call, or would copy the mask first, by the rules of torch 2.11-2.13 (``sdp_utils``, ``preprocess_mask``):
    no grouped-query attention with it (query, key and value need equal heads), every input's last dimension
    contiguous and its head size a multiple of 8 (bf16; 4 in fp32), the mask additive in the query's dtype (a
    boolean one is converted at every call) with every stride but the last a multiple of 8 (else padded at every
    call). An empty list: the call runs as is."""
    why = []
    if enable_gqa:
        why.append("enable_gqa")
    if not q.shape[1] == k.shape[1] == v.shape[1]:
        why.append(f"heads {q.shape[1]}/{k.shape[1]}/{v.shape[1]}")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        why.append("an input's last dimension is strided")
    if q.shape[-1] % 8:
        why.append(f"head size {q.shape[-1]}")
    if attn_mask is not None:
        if attn_mask.dtype != q.dtype:
            why.append(f"mask dtype {attn_mask.dtype}")
        if attn_mask.stride(-1) != 1 or any(s % 8 for s in attn_mask.stride()[:-1]):
            why.append(f"mask strides {attn_mask.stride()}")
    return why


def prefill_calls(model, fused: bool, monkeypatch) -> tuple[list[dict], torch.Tensor]:
    """Every SDPA call of one lean prefill over ``prompts()``, and the prefill's last-position logits."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        calls.append(dict(q=q, k=k, v=v, attn_mask=attn_mask, **kw))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    ids, mask = prompts()
    dec = LeanLlama(model, *ids.shape, fused=fused)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        logits = dec.forward(ids, (mask.cumsum(-1) - 1).clamp(min=0), mask)
    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    return calls, logits


@pytest.mark.parametrize("kind", ["llama", "llama_gqa_rope3", "qwen2"])
def test_prefill_attention_fits_the_efficient_kernel(kind, monkeypatch):
    """Each prefill layer calls SDPA once with equal query/key/value heads, an additive mask in the activations'
    dtype with aligned strides and no ``enable_gqa`` (fused products or not); the last position's log-probs equal
    HF's eager forward's to 1e-5 (fp32, left padding of three widths). The rule check refuses the old form (a
    boolean mask with ``enable_gqa``)."""
    model = model_of(kind)
    ids, mask = prompts()
    with torch.no_grad():
        model.set_attn_implementation("eager")
        want = model(input_ids=ids, attention_mask=mask).logits[:, -1].log_softmax(-1)
        model.set_attn_implementation("sdpa")
    for fused in (False, True):
        calls, logits = prefill_calls(model, fused, monkeypatch)
        assert len(calls) == model.config.num_hidden_layers
        for call in calls:
            assert call["attn_mask"] is not None and efficient_kernel_refuses(**call) == [], call.keys()
        torch.testing.assert_close(logits.log_softmax(-1), want, atol=1e-5, rtol=0)
    q = calls[0]["q"]
    kv = q[:, :2]
    old = efficient_kernel_refuses(q, kv, kv, attn_mask=torch.ones(3, 1, 9, 9, dtype=torch.bool), enable_gqa=True)
    assert old == ["enable_gqa", "heads 4/2/2", "mask dtype torch.bool", "mask strides (81, 81, 9, 1)"]


def test_additive_mask_is_aligned_and_exact():
    """0 where allowed and -inf elsewhere, in the asked dtype, strides multiples of 8 whatever the width."""
    allowed = torch.rand(2, 1, 5, 13, generator=torch.Generator().manual_seed(0)) > 0.5
    for dtype in (torch.float32, torch.bfloat16):
        bias = L.additive_mask(allowed, dtype)
        assert bias.dtype == dtype and bias.shape == allowed.shape and bias.stride() == (80, 80, 16, 1)
        assert torch.equal(bias == 0, allowed) and torch.isneginf(bias[~allowed]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_is_hf_rmsnorm(dtype):
    """The lean RMSNorm (one F.rms_norm in fp32; F.rms_norm, then the weight, in half precision) has the bits of
    transformers' LlamaRMSNorm."""
    g = torch.Generator().manual_seed(0)
    hf = LlamaRMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(64, generator=g))
    dec = LeanLlama(model_of("llama").to(dtype), 1, 4)
    dec.eps = 1e-6
    x = (torch.randn(5, 3, 64, generator=g) * 3).to(dtype)
    with torch.no_grad():
        assert torch.equal(dec._norm(x, hf.weight), hf(x))


def fused_backends() -> dict[str, DschatBackend]:
    return {"growing": DschatBackend(constant_shapes=False),
            "constant": DschatBackend(constant_shapes=True),
            "graph": GraphBackend(capture=False)}


@pytest.fixture
def fused_default(monkeypatch):
    """Decoders fused as on CUDA (stacked weights, one product per token step: no CPU column split), with the
    grouped attention of CUDA's constant-shape step when ``grouped`` is set; counts the fused q/k/v products."""
    monkeypatch.setattr(LeanLlama, "default_fused", staticmethod(lambda model: True))
    monkeypatch.setattr(LeanLlama, "default_split", staticmethod(lambda model: 1))
    used = Counter()
    qkv = L._FusedProducts.qkv
    monkeypatch.setattr(L._FusedProducts, "qkv", lambda self, i, h, *a: used.update([h.shape[1] > 1]) or
                        qkv(self, i, h, *a))
    return used


def sample(backend, model, ids, mask, cfg, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        return backend.generate(model, ids, mask, cfg, 1, PAD)


@pytest.mark.parametrize("kind", LEAN_KINDS)
def test_fused_decoding_equals_hf_and_a_forward_pass(kind, fused_default, monkeypatch):
    """Fused decoders (the growing step, the constant-shape step with SDPA and with grouped attention, the graph
    step's code path) give HF generate's greedy tokens, and sampled log-probs equal to a forward pass's to 1e-5
    (fp32): GQA with llama-3 rope, q/k/v biases and tied embeddings (qwen2), left padding of three widths."""
    model = model_of(kind)
    ids, mask = prompts()
    with torch.no_grad():
        want = hf_greedy(model, ids, mask, 10, eos=1)
    greedy = GenerationConfig(max_new_tokens=10, do_sample=False)
    sampled = GenerationConfig(max_new_tokens=10, temperature=0.8, logprobs=True)
    init = LeanLlama.__init__
    for grouped in (False, True):
        monkeypatch.setattr(LeanLlama, "__init__",
                            lambda self, *a, grouped=grouped, **k: init(self, *a, **{**k, "grouped": grouped}))
        for name, backend in fused_backends().items():
            fused_default.clear()
            assert torch.equal(sample(backend, model, ids, mask, greedy).sequences, want), (name, grouped)
            assert fused_default[True] and fused_default[False], (name, grouped)  # prefill and steps fused
            out = sample(backend, model, ids, mask, sampled, seed=3)
            rollout, _ = make_rollout(ids, mask, out.sequences, 1, PAD, min_answer_len=0, logprobs=out.logprobs)
            with torch.no_grad():
                full = answer_logprobs(model, rollout, temperature=0.8)
            torch.testing.assert_close(rollout.logprobs, full, atol=1e-5, rtol=0, msg=f"{name} grouped={grouped}")


def test_fused_bf16_logprobs_near_a_forward_pass(fused_default):
    """In bf16 the fused constant-shape step's sampled log-probs stay within 1e-2 of a bf16 forward pass's."""
    model = model_of("llama_gqa_rope3").to(torch.bfloat16)
    ids, mask = prompts()
    out = sample(DschatBackend(constant_shapes=True), model, ids, mask,
                 GenerationConfig(max_new_tokens=10, temperature=0.8, logprobs=True), seed=5)
    rollout, _ = make_rollout(ids, mask, out.sequences, 1, PAD, min_answer_len=0, logprobs=out.logprobs)
    with torch.no_grad():
        full = answer_logprobs(model, rollout, temperature=0.8)
    torch.testing.assert_close(rollout.logprobs, full.float(), atol=1e-2, rtol=0)


def test_stacked_weights_follow_the_module_and_live_with_their_decoders():
    """Decoders of one module alive at once share one stacked copy, refreshed in place (same addresses) when a
    decoder is made or reset after the weights changed; it is freed with the last decoder holding it, and a module
    whose dtype changed gets a new one."""
    model = model_of("qwen2")  # q/k/v biases
    a = LeanLlama(model, 2, 16, fused=True)
    w = a.stepping.weights
    ptr = w.qkv[0].data_ptr()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    assert not torch.equal(w.qkv[1], torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    b = LeanLlama(model, 3, 8, fused=True)
    assert b.stepping.weights is w and w.qkv[0].data_ptr() == ptr
    assert torch.equal(w.qkv[1], torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    assert torch.equal(w.qkv_bias[1], torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
    assert torch.equal(w.gate_up[1], torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    with torch.no_grad():
        mlp.up_proj.weight.mul_(2.0)
    a.reset()
    assert torch.equal(w.gate_up[1], torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    held = L._STACKED[model]
    del a, b, w
    gc.collect()
    assert held() is None  # the copy went with its decoders
    c = LeanLlama(model, 1, 8, fused=True)
    model.to(torch.bfloat16)
    d = LeanLlama(model, 1, 8, fused=True)
    assert d.stepping.weights is not c.stepping.weights and d.stepping.weights.qkv[0].dtype == torch.bfloat16
    copy = d.stepping.weights
    assert L.stacked_bytes(model) == sum(t.numel() * t.element_size() for t in (*copy.qkv, *copy.qkv_bias,
                                                                                 *copy.gate_up))
    assert not LeanLlama.default_fused(model)  # a CPU: column blocks instead (LeanLlama.default_split)


def test_kept_graph_step_reads_weights_changed_in_place(fused_default):
    """The graph step's decoder is kept between generations; an optimizer step in place between them reaches its
    stacked weights (``reset`` copies them again): greedy equals HF generate after the change too."""
    model = model_of("llama_gqa_rope3")
    ids = torch.randint(3, 97, (8, 9), generator=torch.Generator().manual_seed(2))  # a full bucket of distinct
    mask = torch.ones_like(ids)  # prompts: no prefill decoder of their own, which would refresh the copy too
    ids[1, :4], mask[1, :4] = PAD, 0
    backend = GraphBackend(capture=False)
    greedy = GenerationConfig(max_new_tokens=10, do_sample=False)
    with torch.no_grad():
        assert torch.equal(sample(backend, model, ids, mask, greedy).sequences, hf_greedy(model, ids, mask, 10, 1))
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        after = hf_greedy(model, ids, mask, 10, eos=1)
        assert torch.equal(sample(backend, model, ids, mask, greedy).sequences, after)
    assert len(backend.graphs.steps) == 1


class Kernels(TorchDispatchMode):
    """Counts the aten ops that launch a kernel: views and bare allocations are free; ``F.rms_norm`` counts once
    (CUDA runs it as one fused kernel; the CPU decomposes it, and ``NormAsOne`` hides the parts)."""

    FREE = {"aten._unsafe_view.default", "aten.empty.memory_format", "aten.empty_strided.default",
            "aten.lift_fresh.default", "aten.detach.default"}

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.hidden = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.hidden and not func.is_view and str(func) not in self.FREE:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


class NormAsOne(TorchFunctionMode):
    def __init__(self, kernels: Kernels):
        super().__init__()
        self.kernels = kernels

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func not in (F.rms_norm, torch.rms_norm) or self.kernels.hidden:
            return func(*args, **(kwargs or {}))
        self.kernels.ops["rms_norm"] += 1
        self.kernels.hidden += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.kernels.hidden -= 1


def step_kernels(layers: int, dtype: torch.dtype, fused: bool) -> Counter:
    """The kernels of one constant-shape token step in CUDA's form (grouped attention, no column split) of a GQA
    model with ``layers`` layers."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**SMALL, "num_key_value_heads": 2, "num_hidden_layers": layers}))
    model = model.eval().to(dtype)
    dec = LeanLlama(model, 4, 32, split=1, grouped=True, fused=fused)
    ids = torch.randint(3, 97, (4, 8))
    real = torch.ones_like(ids)
    tok, position, column = torch.randint(3, 97, (4, 1)), torch.full((4,), 8), torch.tensor([8])
    with torch.no_grad():
        dec.forward(ids, real.cumsum(-1) - 1, real)
        kernels = Kernels()
        with NormAsOne(kernels), kernels:
            dec.step(tok, position, column, dec.keys)
    return kernels.ops


@pytest.mark.parametrize("dtype,per_layer", [(torch.float32, 21), (torch.bfloat16, 24)])
def test_token_step_kernels_per_layer(dtype, per_layer):
    """One token step launches at most ``per_layer`` kernels per layer in CUDA's form (fp32: RMSNorm 2, products 4
    (q/k/v, o, gate/up, down), the q/k rotation 4, cache writes 2, attention 5, residuals 2, SiLU and its product 2;
    bf16 adds each norm's weight product and the softmax's cast), 6 fewer than unfused, and at most 10 outside
    the layers (embedding, rotary tables, cache mask, final norm, LM head)."""
    two, four = step_kernels(2, dtype, True), step_kernels(4, dtype, True)
    layer = (sum(four.values()) - sum(two.values())) // 2
    outside = sum(two.values()) - 2 * layer
    unfused = (sum(step_kernels(4, dtype, False).values()) - sum(step_kernels(2, dtype, False).values())) // 2
    assert layer <= per_layer and unfused - layer == 6 and outside <= 10, (layer, unfused, outside, four - two)
    assert (four - two)["rms_norm"] == 4 and (four - two)["aten.mm.default"] == 8
