"""The constant-shape token step (the eager default on CUDA) and the CUDA-graph step's code path (run eagerly on a
CPU): greedy tokens equal HF generate's, sampled log-probs equal the growing decoder's to 1e-5 in fp32, the step's
shapes never change within a generation, captures are kept per bucket and made again only when the weights move,
and ``auto`` picks the graph step on CUDA without vLLM."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dschat.generation import graphs as GR
from dschat.generation.decode import DschatBackend, GenerationConfig, GraphBackend
from dschat.generation.lean_llama import LeanLlama, grouped_attention
from dschat.rlhf.rollout import answer_logprobs, make_rollout
from tests.dschat.test_generation import PAD, hf_greedy, model_of, prompts

LEAN_KINDS = ["llama", "llama_gqa_rope3", "mistral", "qwen2"]


def backends() -> dict[str, DschatBackend]:
    return {"growing": DschatBackend(constant_shapes=False),
            "constant": DschatBackend(constant_shapes=True),
            "constant_grouped": DschatBackend(constant_shapes=True),
            "graph": GraphBackend(capture=False)}


def run(backend: DschatBackend, model, ids, mask, cfg, eos=1, seed=0, grouped=False, monkeypatch=None):
    if grouped:  # the CUDA attention (grouped products, float32 softmax) on the CPU
        init = LeanLlama.__init__
        monkeypatch.setattr(LeanLlama, "__init__", lambda self, *a, **k: init(self, *a, **{**k, "grouped": True}))
    torch.manual_seed(seed)
    with torch.no_grad():
        out = backend.generate(model, ids, mask, cfg, eos, PAD)
    if grouped:
        monkeypatch.setattr(LeanLlama, "__init__", init)
    return out


@pytest.mark.parametrize("kind", LEAN_KINDS)
def test_constant_and_graph_steps_equal_hf_and_the_growing_decoder(kind, monkeypatch):
    """Every lean family, left padding of three widths: greedy equals HF generate for each step form; sampled
    tokens are the growing decoder's and their log-probs within 1e-5 (fp32), and equal a forward pass's."""
    model = model_of(kind)
    ids, mask = prompts()
    with torch.no_grad():
        want = hf_greedy(model, ids, mask, 14, eos=1)
    greedy = GenerationConfig(max_new_tokens=14, do_sample=False)
    sampled = GenerationConfig(max_new_tokens=14, temperature=0.8, logprobs=True)
    base = run(DschatBackend(constant_shapes=False), model, ids, mask, sampled, seed=3)
    for name, backend in backends().items():
        grouped = name == "constant_grouped"
        got = run(backend, model, ids, mask, greedy, grouped=grouped, monkeypatch=monkeypatch)
        assert torch.equal(got.sequences, want), name
        out = run(backend, model, ids, mask, sampled, seed=3, grouped=grouped, monkeypatch=monkeypatch)
        assert torch.equal(out.sequences, base.sequences), name
        torch.testing.assert_close(out.logprobs, base.logprobs, atol=1e-5, rtol=0, msg=name)
    rollout, _ = make_rollout(ids, mask, base.sequences, 1, PAD, min_answer_len=0, logprobs=base.logprobs)
    with torch.no_grad():
        assert torch.allclose(rollout.logprobs, answer_logprobs(model, rollout, temperature=0.8), atol=1e-5)


def test_grouped_attention_equals_sdpa():
    """Grouped products (query head h reads key head h // G) against SDPA with enable_gqa, masked columns
    included, for one query and for several."""
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, W, D = 3, 8, 2, 11, 16
    k, v = torch.randn(B, Hkv, W, D, generator=g), torch.randn(B, Hkv, W, D, generator=g)
    for n in (1, 4):
        q = torch.randn(B, H, n, D, generator=g)
        mask = torch.rand(B, 1, n, W, generator=g) > 0.4
        mask[..., 0] = True  # every query sees at least one key
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        torch.testing.assert_close(grouped_attention(q, k, v, mask), want, atol=1e-6, rtol=1e-5)
    # a masked column must not count: changing its keys and values changes nothing
    q = torch.randn(B, H, 1, D, generator=g)
    mask = torch.ones(B, 1, 1, W, dtype=torch.bool)
    mask[..., 5] = False
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 5], v2[:, :, 5] = 1e4, -1e4
    assert torch.equal(grouped_attention(q, k, v, mask), grouped_attention(q, k2, v2, mask))


@pytest.mark.parametrize("name", ["constant", "graph"])
def test_step_shapes_stay_constant(name, monkeypatch):
    """Within one generation every token step sees tensors of one shape (inputs, cache, mask, output): nothing
    for a backend to plan per key length. The prefill is the only call of the growing forward."""
    model = model_of("llama_gqa_rope3")
    ids, mask = prompts()
    shapes, forwards = [], []
    step, forward = LeanLlama.step, LeanLlama.forward

    def spy_step(self, ids_, positions, column, keys, products=None):
        logits, keys_out = step(self, ids_, positions, column, keys, products)
        shapes.append((tuple(ids_.shape), tuple(positions.shape), tuple(column.shape), tuple(keys.shape),
                       tuple(self.k[0].shape), tuple(logits.shape), tuple(keys_out.shape)))
        return logits, keys_out

    monkeypatch.setattr(LeanLlama, "step", spy_step)
    monkeypatch.setattr(LeanLlama, "forward", lambda self, x, *a: forwards.append(x.shape[1]) or forward(self, x, *a))
    out = run(backends()[name], model, ids, mask, GenerationConfig(max_new_tokens=20, temperature=0.9))
    assert len(shapes) == out.sequences.shape[1] - ids.shape[1] - 1 >= 5
    assert len(set(shapes)) == 1, set(shapes)
    assert all(n == ids.shape[1] for n in forwards)  # prefill only (one forward of the distinct prompts)


def test_graph_buckets_pad_rows_and_keep_captures(monkeypatch):
    """The graph backend pads 3 rows to its batch bucket and the cache to its width bucket, answers the 3 rows
    alone; a second call of the same bucket reuses the capture, moved weights are captured again, and the cache
    counts each capture and its seconds (which the hybrid engine reports per step)."""
    made = []

    def fake_capture(self, pool):  # what a capture records, without CUDA: the step then runs eagerly
        made.append(tuple(self.dec.keys.shape))
        self.capture_seconds = 0.25

    monkeypatch.setattr(GR.CapturedStep, "_capture", fake_capture)
    model = model_of("llama")
    ids, mask = prompts()
    backend = GraphBackend(capture=True)
    greedy = GenerationConfig(max_new_tokens=10, do_sample=False)
    with torch.no_grad():
        want = hf_greedy(model, ids, mask, 10, eos=1)
        assert torch.equal(backend.generate(model, ids, mask, greedy, 1, PAD).sequences, want)
        assert made == [(GR.BATCH_BUCKET, GR.WIDTH_BUCKET)]
        assert backend.graphs.captures == 1 and backend.graphs.capture_seconds == 0.25
        assert torch.equal(backend.generate(model, ids[:2], mask[:2], greedy, 1, PAD).sequences, want[:2])
        assert len(made) == 1 and backend.graphs.captures == 1  # same bucket (2 rows pad to 8): reused
        for p in model.parameters():  # an optimizer step in place: the same capture reads the new weights
            p.add_(0.05 * torch.randn_like(p))
        after = hf_greedy(model, ids, mask, 10, eos=1)
        assert not torch.equal(after, want)
        assert torch.equal(backend.generate(model, ids, mask, greedy, 1, PAD).sequences, after)
        assert len(made) == 1
        model.lm_head.weight.data = model.lm_head.weight.data.clone()  # moved (a ZeRO-3 gather): captured again
        assert torch.equal(backend.generate(model, ids, mask, greedy, 1, PAD).sequences, after)
        assert len(made) == 2
    assert backend.graphs.captures == 2 and backend.graphs.capture_seconds == 0.5 and backend.last == {}


def test_stop_checks_every_few_tokens_give_the_same_output():
    """Looking at "has every row ended" only every 8 tokens (CUDA's default) cuts the overshoot: the sequences and
    log-probs equal those of a check at every token, whether rows end early or run to the budget."""
    model = model_of("llama")
    ids, mask = prompts()
    with torch.no_grad():
        free = DschatBackend().generate(model, ids, mask, GenerationConfig(max_new_tokens=30, do_sample=False), 1,
                                        PAD)
    eos = [int(t) for t in free.sequences[:, ids.shape[1] + 2]]  # every row ends at its third token
    for cfg, eos_ids in ((GenerationConfig(max_new_tokens=30, do_sample=False, logprobs=True), eos),
                         (GenerationConfig(max_new_tokens=13, temperature=0.9, logprobs=True), 1)):
        a = run(DschatBackend(stop_check_every=1), model, ids, mask, cfg, eos=eos_ids, seed=2)
        b = run(DschatBackend(stop_check_every=8), model, ids, mask, cfg, eos=eos_ids, seed=2)
        assert torch.equal(a.sequences, b.sequences) and torch.equal(a.logprobs, b.logprobs)
    assert a.sequences.shape[1] <= ids.shape[1] + 13


def test_auto_picks_the_graph_step_on_cuda_without_vllm(monkeypatch):
    import dschat.generation.backends as BK
    from dschat.errors import UserError

    monkeypatch.setattr(BK, "supports", lambda module: (False, "vLLM is not installed"))
    assert BK.resolve_backend("auto", model_of("llama")) == "dschat"  # a CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert BK.resolve_backend("auto", model_of("llama")) == "graph"
    assert BK.resolve_backend("auto", model_of("gpt2")) == "dschat"
    assert BK.resolve_backend("auto", model_of("gpt2"), fallback="hf") == "hf"
    monkeypatch.setattr(BK, "supports", lambda module: (True, ""))
    assert BK.resolve_backend("auto", model_of("llama")) == "vllm"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="--generation-backend graph captures the token step as a CUDA graph"):
        BK.make_backend("graph")


def test_graph_backend_refused_on_a_cpu_before_loading():
    from dschat.config import build_config
    from dschat.errors import UserError
    from dschat.rlhf.config import RLHFConfig, check_config

    cfg = build_config(RLHFConfig, {"algo": "grpo", "actor_model": "tiny", "generation_backend": "graph"})
    with pytest.raises(UserError, match="needs a CUDA device"):
        check_config(cfg)


@pytest.mark.parametrize("backend", ["dschat", "graph"])
def test_zero3_generation_gathers_once_per_call(backend, monkeypatch):
    """Under ZeRO-3 the hybrid engine gathers the actor's weights once per generation, never per token, and the
    answers are HF generate's on the gathered weights, before and after an optimizer step (the graph step's code
    path, run eagerly here, follows weights that a gather puts in new memory)."""
    import deepspeed
    from transformers import LlamaForCausalLM

    from dschat import engine as E
    from dschat.config import EngineArgs, OptimArgs
    from dschat.generation.hybrid_engine import HybridEngine
    from dschat.models.tiny import tiny_model_config

    E.setup_distributed()
    torch.manual_seed(0)
    # hidden 128: every matrix is over ZeRO-3's persistence threshold, so partitioned
    model = LlamaForCausalLM(tiny_model_config(num_hidden_layers=2, hidden_size=128, intermediate_size=256))
    eng = E.build_train_engine(model, engine=EngineArgs(zero_stage=3), optim=OptimArgs(
        learning_rate=1e-2, per_device_train_batch_size=2, num_warmup_steps=0), dtype=torch.float32, total_steps=2)
    gathers = []
    real = deepspeed.zero.GatheredParameters

    def counted(params, *a, **k):
        gathers.append(len(list(params)) if not isinstance(params, torch.nn.Parameter) else 1)
        return real(params, *a, **k)

    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", counted)
    chosen = GraphBackend(capture=False) if backend == "graph" else DschatBackend()
    hybrid = HybridEngine(eng, pad_token_id=0, eos_token_id=2, backend=chosen)
    ids = torch.randint(4, 100, (3, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    greedy = GenerationConfig(max_new_tokens=12, do_sample=False)
    for _ in range(2):
        gathers.clear()
        got = hybrid.generate(ids, mask, greedy)
        assert len(gathers) == 1 and got.shape[1] > ids.shape[1] + 1  # one gather for a dozen tokens
        module = E.unwrap(eng)
        with real(list(module.parameters())), torch.no_grad():
            want = module.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                                   eos_token_id=2)
        assert torch.equal(got, want)
        x = torch.randint(4, 100, (2, 8))
        eng.backward(eng(input_ids=x, labels=x).loss)
        eng.step()


def test_a_capture_is_thread_local_so_the_courier_s_transfers_cannot_break_it(monkeypatch):
    """A sampler's courier thread sends weight updates on a CUDA stream of its own while the trainer may capture a
    token step: the capture runs in thread-local mode, where another thread's CUDA work neither joins the graph nor
    fails it (global mode would fail a cudaMalloc made by the courier during the capture). Checked by running the
    capture against recording stand-ins of torch.cuda's calls."""
    import contextlib

    seen: dict = {}

    class Stream:
        def wait_stream(self, other):
            pass

    def graph(g, pool=None, **kwargs):
        seen.update(kwargs)
        return contextlib.nullcontext()

    for name, value in {"Stream": Stream, "current_stream": lambda: Stream(),
                        "stream": lambda s: contextlib.nullcontext(), "CUDAGraph": object, "graph": graph,
                        "synchronize": lambda: None}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    model = model_of("llama")
    dec = LeanLlama(model, GR.BATCH_BUCKET, GR.WIDTH_BUCKET)
    GR.CapturedStep(dec, capture=True)
    assert seen == {"capture_error_mode": "thread_local"}
