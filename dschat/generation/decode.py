"""Sampling answers: the one decode loop behind every caller that generates (stage 3's rollouts and evaluation,
``dschat generate``, ``dschat eval``).

A backend turns left-padded prompts ``(B, P)`` into ``Generated``: the sequences ``(B, P + A)`` (A <= the token
budget; the loop stops as soon as every row has ended) and, where the backend computes them, the log-prob of
every sampled token under the tempered full-vocabulary distribution (what ``rollout.answer_logprobs`` computes
with a forward pass, so PPO can take its old log-probs from here instead of a second actor forward).

Backends (``--generation-backend``):

* ``dschat``: our decode loop. Prefill once (rows repeating a prompt share one prompt forward), then one forward
  per token into a KV cache that is allocated once for the whole answer budget (no per-token concatenation),
  sampling in the loop (temperature, top-k, top-p in the order HF applies them; the draw inverts the running sum,
  ``sample``), stopping when every row has produced EOS. For Llama-architecture models (llama,
  mistral, qwen2 and other configs with the same layer layout) the per-token forward is a lean function over the
  model's own weights: the same operations as the HF modules without their per-call machinery (mask building,
  cache objects, hooks). Any other model, or one whose layers are wrapped (LoRA), runs the same loop through its
  HF ``forward`` with a ``DynamicCache``.
* ``compiled``: the same loop with the lean per-token step compiled by ``torch.compile`` (Llama-architecture models
  only): static shapes within a call (the cache is allocated in 64-column buckets and every step attends over all
  of it, unfilled columns masked), element-wise work fused, no per-op dispatch. The first call compiles, and a
  second (batch, bucket) shape once more, into a dynamic-shape graph (a one-off wait each); the fused kernels
  round differently from the eager ones, so samples may differ from ``hf``'s in rare near-ties.
* ``hf``: ``model.generate`` (HF's loop; no log-probs).

Greedy decoding gives the same tokens as HF ``generate`` (tested). A GPU serving engine (vLLM, DeepSpeed
inference) plugs in as another backend with the same ``generate`` signature (docs/generation.md).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from dschat.data.packing import prompt_ids

# torch's own linear. ZeRO-3's zero.Init replaces torch.nn.functional.linear, process-wide and for good, with a
# memory-saving autograd function (DeepSpeed's "memory_efficient_linear"); under no_grad it is only overhead:
# Python signature binding per call and a broadcast matmul in place of addmm, which slows decoding down markedly.
_linear = torch._C._nn.linear
LEAN_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass
class GenerationConfig:
    max_new_tokens: int = 256
    do_sample: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # Also return each sampled token's log-prob (the behaviour policy's: PPO's old log-probs). Off unless a caller
    # uses them: computing them costs a log-softmax over the vocabulary per token.
    logprobs: bool = False
    # Divide the logits of tokens already in the prompt or the answer by this (multiply, where negative), as HF's
    # repetition penalty does; 1 is off.
    repetition_penalty: float = 1.0
    # Called with each step's tokens (B,); returning True stops every row there. Streaming callers (``dschat chat``)
    # show the text as it comes and stop at a stop string.
    on_token: Callable[[torch.Tensor], bool] | None = None

    @classmethod
    def from_flags(cls, flags: SamplingFlags) -> GenerationConfig:
        """Sampling as stage 3's flags set it (``--max-answer-seq-len``, ``--temperature``, ``--top-p``,
        ``--top-k``): stage 3, ``dschat generate`` and ``dschat eval --step 3`` all sample through this."""
        return cls(max_new_tokens=flags.max_answer_seq_len, do_sample=True, temperature=flags.temperature,
                   top_p=flags.top_p, top_k=flags.top_k)


class SamplingFlags(Protocol):
    """The sampling flags of stage 3's ``RLArgs`` (and of every command that declares the same ones)."""

    max_answer_seq_len: int
    temperature: float
    top_p: float
    top_k: int


@dataclass
class Generated:
    sequences: torch.Tensor  # (B, P + A): prompts as given, then the answers (pad after each row's EOS)
    logprobs: torch.Tensor | None = None  # (B, A) float32 log-prob of each answer token (0 after EOS)
    # (B, A) float32: a serving engine's own log-probs of the answer tokens (vLLM: under the distribution it sampled
    # from), for the importance-sampling correction; never used as the trainer's log-probs
    engine_logprobs: torch.Tensor | None = None


class Backend(Protocol):
    name: str

    def generate(self, module: torch.nn.Module, prompt: torch.Tensor, prompt_mask: torch.Tensor,
                 config: GenerationConfig, eos_token_id: int | list[int], pad_token_id: int) -> Generated: ...


def decode_answers(tokenizer: Any, answers: torch.Tensor) -> tuple[list[str], list[int]]:
    """Answers ``(B, A)`` (the sampled columns, padding after an EOS) as text, each cut at its first EOS with
    special tokens dropped (what reward functions and judges read), and each answer's length in tokens, its EOS
    included (an answer that never ended counts all ``A``)."""
    answers = answers.cpu()
    is_eos = answers == tokenizer.eos_token_id
    ended = is_eos.any(-1)
    first_eos = torch.where(ended, is_eos.long().argmax(-1), torch.full_like(answers[:, 0], answers.shape[1]))
    texts = tokenizer.batch_decode([row[:n] for row, n in zip(answers, first_eos.tolist(), strict=True)],
                                   skip_special_tokens=True)
    return texts, torch.where(ended, first_eos + 1, first_eos).tolist()


# ------------------------------------------------------------------------------------------------ sampling
def warp_logits(logits: torch.Tensor, config: GenerationConfig) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) filtering, as HF's sampling warpers apply them."""
    logits = logits / config.temperature if config.temperature != 1.0 else logits
    if config.top_k and config.top_k < logits.shape[-1]:
        kth = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1)  # ascending
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum <= 1 - config.top_p
        drop[..., -1:] = False  # always keep the most likely token
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def sample(probs: torch.Tensor) -> torch.Tensor:
    """One draw per row of ``probs`` (B, V) by inverting its running sum: one uniform per row and a binary search,
    where ``torch.multinomial`` draws an exponential variate per vocabulary entry, so this is much faster. The
    running sum is float64, so a token's share of [0, total) is its probability to ~1e-15 however large the
    vocabulary; the draw lands in the first column whose running sum exceeds it, which never is a zero-probability
    (filtered) token."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    u = torch.rand(total.shape, dtype=torch.float64, device=probs.device) * total
    u = torch.minimum(u, total.nextafter(torch.zeros_like(total)))  # strictly below the total, even rounded up
    return torch.searchsorted(cdf, u, right=True).squeeze(1)


def penalize_repeats(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF's repetition penalty: the logits ``(B, V)`` of the ``seen`` tokens divided by ``penalty`` where positive,
    multiplied where negative (both make a seen token less likely for a penalty above 1)."""
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def next_token(logits: torch.Tensor, config: GenerationConfig) -> torch.Tensor:
    """(B, V) float32 logits -> (B,) next tokens: argmax, or a sample of the warped distribution."""
    if not config.do_sample:
        return logits.argmax(-1)
    return sample(warp_logits(logits, config).softmax(-1))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(token) under softmax(logits / temperature) over the whole vocabulary (no top-k/top-p), float32."""
    logits = logits / temperature if temperature != 1.0 else logits
    return logits.gather(-1, tokens[:, None]).squeeze(-1) - logits.logsumexp(-1)


# ------------------------------------------------------------------------------------------------ decoders
# The most a split decoder copies (its column-split weights, ``LeanLlama.split``): beyond this the copy is not made
# and the one-token products run as single matmuls.
SPLIT_COPY_BYTES = 2 << 30


def _split_bmm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` (B, K) times each of the ``S`` column blocks ``w`` (S, K, N) (+ ``bias`` (S, 1, N)): (S, B, N). One
    batched product, which torch spreads over its threads block by block."""
    xs = x.expand(w.shape[0], *x.shape)
    return torch.bmm(xs, w) if bias is None else torch.baddbmm(bias, xs, w)


def _split_rows(parts: int, *weights: torch.Tensor) -> torch.Tensor:
    """Each of ``weights`` (N_j, K) cut into ``parts`` blocks of rows, block c of all of them side by side,
    transposed: (parts, K, sum_j N_j / parts), contiguous (``_split_bmm``'s layout)."""
    return torch.cat([w.reshape(parts, -1, w.shape[-1]) for w in weights], dim=1).transpose(1, 2).contiguous()


class _Products:
    """A Llama-architecture model's linear maps, one product per weight matrix (torch's own linear)."""

    def __init__(self, model: torch.nn.Module, head_dim: int):
        self.model, self.layers, self.D = model, model.model.layers, head_dim

    def qkv(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer i's queries, keys and values of ``h`` (B, n, hidden): (B, heads, n, D) each, not rotated."""
        a, (B, n) = self.layers[i].self_attn, h.shape[:2]
        q = _linear(h, a.q_proj.weight, a.q_proj.bias).view(B, n, -1, self.D).transpose(1, 2)
        k = _linear(h, a.k_proj.weight, a.k_proj.bias).view(B, n, -1, self.D).transpose(1, 2)
        v = _linear(h, a.v_proj.weight, a.v_proj.bias).view(B, n, -1, self.D).transpose(1, 2)
        return q, k, v

    def out(self, i: int, o: torch.Tensor) -> torch.Tensor:
        a = self.layers[i].self_attn
        return _linear(o, a.o_proj.weight, a.o_proj.bias)

    def mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        f = self.layers[i].mlp
        return _linear(F.silu(_linear(h, f.gate_proj.weight)) * _linear(h, f.up_proj.weight), f.down_proj.weight)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """(B, hidden) -> logits (B, V)."""
        return _linear(x, self.model.lm_head.weight, self.model.lm_head.bias)


class _BlockProducts(_Products):
    """The same maps for one token per row, each as ``S`` column blocks of its weight in one batched product
    (``LeanLlama``'s docstring says why): q, k and v split by heads (block c holds heads c*H/S.. of all three), gate
    and up likewise, o, down and the LM head by output columns (the vocabulary padded with zero rows to a multiple
    of S, the padded logits dropped). The blocks are a copy of the weights, made once."""

    def __init__(self, model: torch.nn.Module, head_dim: int, heads: int, kv_heads: int, S: int):
        super().__init__(model, head_dim)
        self.S, self.widths = S, (heads // S * head_dim, kv_heads // S * head_dim, kv_heads // S * head_dim)
        self.blocks: list[tuple[torch.Tensor | None, ...]] = []
        for layer in self.layers:
            a, f = layer.self_attn, layer.mlp
            qkv = (a.q_proj, a.k_proj, a.v_proj)
            bias = None
            if any(p.bias is not None for p in qkv):
                bias = torch.cat([(p.bias if p.bias is not None else p.weight.new_zeros(p.out_features))
                                  .reshape(S, 1, -1) for p in qkv], dim=2)
            o_bias = None if a.o_proj.bias is None else a.o_proj.bias.reshape(S, 1, -1)
            self.blocks.append((_split_rows(S, *(p.weight for p in qkv)), bias,  # q, k, v by heads
                                _split_rows(S, a.o_proj.weight), o_bias,
                                _split_rows(S, f.gate_proj.weight, f.up_proj.weight),
                                _split_rows(S, f.down_proj.weight)))
        head = model.lm_head
        self.vocab = head.weight.shape[0]
        pad = -self.vocab % S
        self.head_blocks = (_split_rows(S, F.pad(head.weight, (0, 0, 0, pad))),
                            None if head.bias is None else F.pad(head.bias, (0, pad)).reshape(S, 1, -1))

    @staticmethod
    def _merge(y: torch.Tensor) -> torch.Tensor:
        """(S, B, N / S) blocks -> (B, 1, N)."""
        return y.transpose(0, 1).reshape(y.shape[1], 1, -1)

    def qkv(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, S, D = h.shape[0], self.S, self.D
        w, bias = self.blocks[i][:2]
        parts = _split_bmm(h.view(B, -1), w, bias).split(self.widths, dim=-1)  # (S, B, heads / S * D) each
        # block-major heads (S, B, heads / S, D) back to (B, heads, 1, D): heads in their own order
        q, k, v = (p.view(S, B, -1, D).permute(1, 0, 2, 3).reshape(B, -1, 1, D) for p in parts)
        return q, k, v

    def out(self, i: int, o: torch.Tensor) -> torch.Tensor:
        w, bias = self.blocks[i][2:4]
        return self._merge(_split_bmm(o.view(o.shape[0], -1), w, bias))

    def mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        B = h.shape[0]
        gate, up = _split_bmm(h.view(B, -1), self.blocks[i][4], None).chunk(2, -1)
        return self._merge(_split_bmm((F.silu(gate) * up).transpose(0, 1).reshape(B, -1), self.blocks[i][5], None))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        w, bias = self.head_blocks
        return _split_bmm(x, w, bias).transpose(0, 1).reshape(x.shape[0], -1)[:, :self.vocab]


class LeanLlama:
    """Prefill and per-token forward of a Llama-architecture model over its own weights, with a KV cache of
    fixed size. Numerically the same operations as transformers' Llama/Mistral/Qwen2 modules in eval mode.

    On a CPU the one-token step's products (a few rows times each weight matrix) are too small for MKL to
    parallelise: it runs every one on a single core, whatever the thread count. With ``split`` = S > 1 the step
    instead multiplies by S column blocks of each weight in one batched product (torch runs the blocks on S
    threads): the attention weights split by heads (block c holds heads c*H/S.. of q, k and v, one product), the
    MLP's gate and up blocks in one product, o/down/lm_head by output columns. Every output is the same dot
    product over the same K as before (bit-identical on the bench model; MKL may round a narrower product
    differently, within 2e-6 in log-prob on the tested ones), and the weights are copied once per
    decoder into that layout (at most ``SPLIT_COPY_BYTES``). The default S is the largest divisor of the head
    counts and widths up to torch's thread count, on CPUs only, where it makes decoding faster (with and without
    ZeRO-3; docs/generation.md).

    One layer loop (``layers``) serves the prefill, the eager one-token step and the compiled step; they differ in
    their linear maps (``_Products``, ``_BlockProducts``) and in how they write and read the cache."""

    def __init__(self, model: torch.nn.Module, batch: int, total: int, split: int | None = None):
        self.model = model
        self.inner = model.model
        cfg = model.config
        self.H = cfg.num_attention_heads
        self.Hkv = cfg.num_key_value_heads or self.H
        self.D = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.H
        self.eps = cfg.rms_norm_eps
        self.split = split  # None: default_split, decided at the first one-token step (a prefill never needs it)
        self.single = _Products(model, self.D)
        self.blocks: _BlockProducts | None = None  # made at the first one-token step when split > 1
        w = self.inner.embed_tokens.weight
        shape = (batch, self.Hkv, total, self.D)
        # zeros, not empty: the compiled step attends over every column, unfilled ones masked (garbage there could
        # be NaN, and a masked NaN still poisons the softmax)
        self.k = [torch.zeros(shape, dtype=w.dtype, device=w.device) for _ in self.inner.layers]
        self.v = [torch.zeros(shape, dtype=w.dtype, device=w.device) for _ in self.inner.layers]
        self.keys = torch.zeros(batch, total, dtype=torch.bool, device=w.device)  # which cache columns are real
        self.length = 0
        # rotary cos/sin of every position once (each entry is one product inv_freq * position, so looking it up
        # gives the same bits as computing it per step)
        cos, sin = self.inner.rotary_emb(w[:1], torch.arange(total, device=w.device)[None])
        half = self.D // 2
        self.cos, self.sin = cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)  # (total, D)

    @staticmethod
    def supported(model: torch.nn.Module, total: int) -> tuple[bool, str]:
        cfg = getattr(model, "config", None)
        kind = getattr(cfg, "model_type", "")
        if kind not in LEAN_MODEL_TYPES:
            return False, f"model_type {kind!r}"
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "rotary_emb") or not hasattr(inner, "layers"):
            return False, "unexpected module layout"
        rope = getattr(inner.rotary_emb, "rope_type", "default")
        if rope in ("dynamic", "longrope"):  # their frequencies depend on the sequence length seen so far
            return False, f"rope_type {rope}"
        if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "mlp_bias", False):
            return False, "MLP other than bias-free SiLU"
        if (getattr(cfg, "pretraining_tp", 1) or 1) != 1:
            return False, "pretraining_tp > 1"
        window = getattr(cfg, "sliding_window", None)
        if window is not None and getattr(cfg, "use_sliding_window", True) and total > window:
            return False, "sliding-window attention shorter than the sequence"
        for layer in inner.layers:
            a, f = layer.self_attn, layer.mlp
            for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, f.gate_proj, f.up_proj, f.down_proj):
                if type(lin) is not torch.nn.Linear:  # LoRA or another wrapper: its forward is not just F.linear
                    return False, f"wrapped linear layer ({type(lin).__name__})"
            for extra in ("q_norm", "k_norm"):
                if hasattr(a, extra):
                    return False, f"attention with {extra}"
        if type(model.lm_head) is not torch.nn.Linear:
            return False, "wrapped lm_head"
        emb = inner.embed_tokens
        if type(emb) is not torch.nn.Embedding or emb.max_norm is not None:
            return False, f"embedding other than a plain lookup ({type(emb).__name__})"
        return True, ""

    @staticmethod
    def default_split(model: torch.nn.Module) -> int:
        """How many column blocks the one-token step multiplies in one batched product: the largest S up to
        torch's intra-op threads that divides the head counts, the hidden and the MLP width; 1 off the CPU (GPU
        kernels parallelise small products themselves) or when the copy would pass ``SPLIT_COPY_BYTES``."""
        w = model.model.embed_tokens.weight
        threads = torch.get_num_threads()
        if w.device.type != "cpu" or threads < 2:
            return 1
        cfg = model.config
        heads = cfg.num_attention_heads
        widths = (heads, cfg.num_key_value_heads or heads, cfg.hidden_size, cfg.intermediate_size)
        copied = sum(p.numel() * p.element_size() for layer in model.model.layers
                     for p in (*layer.self_attn.parameters(), *layer.mlp.parameters()))
        copied += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
        if copied > SPLIT_COPY_BYTES:
            return 1
        return max(s for s in range(1, threads + 1) if all(n % s == 0 for n in widths))

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and weight.dtype == torch.float32:
            # one kernel, the same float32 arithmetic as HF's RMSNorm (x * rsqrt(mean(x^2) + eps) * weight)
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        h = x.float()  # half precision: HF normalises in float32, casts back, then scales
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        # x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1): cat(x2, x1) is a roll by half the head
        # and the minus sits in signed_sin = cat(-sin1, sin2); (-a) * b == -(a * b) exactly, so the bits match
        return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin

    def products(self, n: int) -> _Products:
        """The linear maps for ``n`` tokens per row: column blocks for one token when ``split`` > 1 (made at the
        first such step), else one product per weight."""
        if n > 1:
            return self.single
        if self.split is None:
            self.split = self.default_split(self.model)
        if self.split == 1:
            return self.single
        if self.blocks is None:
            self.blocks = _BlockProducts(self.model, self.D, self.H, self.Hkv, self.split)
        return self.blocks

    def layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, products: _Products,
               write: Callable[[int, torch.Tensor, torch.Tensor], None],
               attend: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The decoder layers over ``x`` (B, n, hidden): ``write(i, k, v)`` puts layer i's rotated keys and values
        in its cache, ``attend(i, q)`` attends over it. Returns the last position's final-norm hidden state."""
        B, n = x.shape[:2]
        for i, layer in enumerate(self.inner.layers):
            q, k, v = products.qkv(i, self._norm(x, layer.input_layernorm.weight))
            write(i, self._rotate(k, cos, sin), v)
            o = attend(i, self._rotate(q, cos, sin))
            x = x + products.out(i, o.transpose(1, 2).reshape(B, n, -1))
            x = x + products.mlp(i, self._norm(x, layer.post_attention_layernorm.weight))
        return self._norm(x[:, -1], self.inner.norm.weight)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """Run ``ids`` (B, n) at ``positions`` (B, n), appending their keys/values to the cache; ``real`` (B, n)
        marks non-pad tokens. Returns the last position's logits (B, V) in float32."""
        B, n = ids.shape
        start, end = self.length, self.length + n
        self.keys[:, start:end] = real.bool()
        # the weights directly, not the modules: under ZeRO-3 every module call runs DeepSpeed's fetch/release
        # hooks, even with the parameters already gathered (a few ms per call and token)
        emb = self.inner.embed_tokens
        x = F.embedding(ids, emb.weight, emb.padding_idx)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # (B, 1, n, D)
        mask = self.keys[:, None, None, :end]
        if n > 1:  # prefill: causal within the new tokens; each query also sees itself (pad rows stay finite)
            causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
            mask = mask.expand(B, 1, n, end).clone()
            mask[..., start:] &= causal
            mask[..., start:] |= torch.eye(n, dtype=torch.bool, device=ids.device)

        def write(i: int, k: torch.Tensor, v: torch.Tensor) -> None:
            self.k[i][:, :, start:end] = k
            self.v[i][:, :, start:end] = v

        def attend(i: int, q: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, self.k[i][:, :, :end], self.v[i][:, :, :end], attn_mask=mask,
                                                  enable_gqa=self.H != self.Hkv)

        products = self.products(n)
        last = self.layers(x, cos, sin, products, write, attend)
        self.length = end
        return products.head(last).float()

    def adopt(self, other: LeanLlama, rows: torch.Tensor) -> None:
        """Take ``other``'s cache as this one's: row ``r`` gets ``other``'s row ``rows[r]`` (the prompts prefilled
        once for every row that repeats them)."""
        n = other.length
        for mine, theirs in ((self.k, other.k), (self.v, other.v)):
            for a, b in zip(mine, theirs, strict=True):
                a[:, :, :n] = b[rows, :, :n]
        self.keys[:, :n] = other.keys[rows, :n]
        self.length = n

    def step(self, ids: torch.Tensor, positions: torch.Tensor, column: torch.Tensor,
             keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row, static shapes (``torch.compile``): ``ids`` (B, 1) at rotary ``positions`` (B,), written
        to cache column ``column`` (1,), attending over the whole cache where ``keys`` (B, total) is True (this
        column included). Returns the logits (B, V) in float32 and the updated ``keys``."""
        keys = keys.index_fill(1, column, True)
        emb = self.inner.embed_tokens
        x = F.embedding(ids, emb.weight, emb.padding_idx)
        cos, sin = self.cos[positions][:, None, None], self.sin[positions][:, None, None]  # (B, 1, 1, D)
        mask = keys[:, None, None, :]

        def write(i: int, k: torch.Tensor, v: torch.Tensor) -> None:
            self.k[i].index_copy_(2, column, k)
            self.v[i].index_copy_(2, column, v)

        def attend(i: int, q: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, self.k[i], self.v[i], attn_mask=mask,
                                                  enable_gqa=self.H != self.Hkv)

        return self.single.head(self.layers(x, cos, sin, self.single, write, attend)).float(), keys


_compiled_step: Any = None


def compiled_step() -> Any:
    """``LeanLlama.step`` through ``torch.compile``, made once per process (its compiled graphs are cached by the
    shapes they were made for)."""
    global _compiled_step
    if _compiled_step is None:
        _compiled_step = torch.compile(LeanLlama.step)
    return _compiled_step


class HFForward:
    """The same contract through the model's own ``forward`` and a ``DynamicCache`` (any causal LM)."""

    def __init__(self, model: torch.nn.Module, batch: int, total: int):
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.mask = torch.zeros(batch, 0, dtype=torch.long, device=next(model.parameters()).device)
        # only the last position's logits when the model can skip the rest (a prefill over a large vocabulary)
        self.keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, real.long()], dim=1)
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=positions, past_key_values=self.cache,
                         use_cache=True, **self.keep)
        return out.logits[:, -1].float()


def _eos_ids(eos_token_id: int | list[int], device: torch.device) -> torch.Tensor:
    ids = eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
    return torch.tensor(list(ids), device=device)


class DschatBackend:
    name = "dschat"

    def __init__(self, lean: bool = True, compiled: bool = False):
        self.lean, self.compiled = lean, compiled
        if compiled:
            self.name = "compiled"

    def decoder(self, module: torch.nn.Module, batch: int, total: int) -> LeanLlama | HFForward:
        if self.compiled:
            ok, why = LeanLlama.supported(module, total)
            if not ok:
                from dschat.errors import UserError

                raise UserError(f"--generation-backend compiled needs a Llama-architecture model (llama, mistral, "
                                f"qwen2 layouts) without wrapped layers; this one has {why}: use dschat")
            return LeanLlama(module, batch, -(-total // 64) * 64)  # 64-column buckets: few shapes to compile
        if self.lean and LeanLlama.supported(module, total)[0]:
            return LeanLlama(module, batch, total)
        return HFForward(module, batch, total)

    def prefill(self, dec: LeanLlama | HFForward, module: torch.nn.Module, prompt: torch.Tensor,
                positions: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
        """The prompts' forward into ``dec``'s cache; the last position's logits. Rows that repeat a prompt (a
        GRPO group's completions, ``--num-generations`` per prompt) share one forward: the distinct prompts run
        through a decoder of their own, whose cache rows are then copied to every row that repeats them (the
        prompt's prefix cached once, as serving engines do), so the prefill costs about as much as the distinct
        prompts alone. Lean decoders only."""
        if not isinstance(dec, LeanLlama):
            return dec.forward(prompt, positions, prompt_mask)
        rows = prompt_ids(prompt, prompt_mask)
        distinct = int(rows.max()) + 1
        if distinct == len(prompt):
            return dec.forward(prompt, positions, prompt_mask)
        first = torch.empty(distinct, dtype=torch.long, device=prompt.device)
        first[rows] = torch.arange(len(prompt), device=prompt.device)  # one row of each distinct prompt
        own = LeanLlama(module, distinct, prompt.shape[1])  # a cache just wide enough for the prompts
        logits = own.forward(prompt[first], positions[first], prompt_mask[first])
        dec.adopt(own, rows)
        return logits[rows]

    @torch.no_grad()
    def generate(self, module: torch.nn.Module, prompt: torch.Tensor, prompt_mask: torch.Tensor,
                 config: GenerationConfig, eos_token_id: int | list[int], pad_token_id: int) -> Generated:
        B, P = prompt.shape
        N = config.max_new_tokens
        dec = self.decoder(module, B, P + N)
        eos = _eos_ids(eos_token_id, prompt.device)
        positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
        logits = self.prefill(dec, module, prompt, positions, prompt_mask)
        keys = dec.keys.clone() if self.compiled else None  # the compiled step's cache mask, passed along
        position = positions[:, -1:] + 1
        done = torch.zeros(B, dtype=torch.bool, device=prompt.device)
        tokens, logps = [], []
        ones = torch.ones(B, 1, dtype=torch.bool, device=prompt.device)
        seen = None
        if config.repetition_penalty != 1.0:  # (B, V): the tokens of each row so far
            seen = torch.zeros(B, logits.shape[-1], dtype=torch.bool, device=prompt.device)
            real = prompt_mask.bool()
            seen[torch.arange(B, device=prompt.device)[:, None].expand_as(prompt)[real], prompt[real]] = True
        for t in range(N):
            if seen is not None:
                logits = penalize_repeats(logits, seen, config.repetition_penalty)
            tok = next_token(logits, config)
            if config.logprobs:  # 0 after a row has ended
                logps.append(token_logprobs(logits, tok, config.temperature).masked_fill(done, 0.0))
            if t:  # before the first token no row has ended
                tok = tok.masked_fill(done, pad_token_id)
            tokens.append(tok)
            done = done | (tok == eos[0] if eos.numel() == 1 else torch.isin(tok, eos))
            if seen is not None:
                seen.scatter_(1, tok[:, None], True)
            stop = config.on_token is not None and config.on_token(tok)  # every token, the last one too
            if t == N - 1 or bool(done.all()) or stop:
                break
            if self.compiled:
                assert isinstance(dec, LeanLlama)
                column = torch.tensor([P + t], device=prompt.device)
                logits, keys = compiled_step()(dec, tok[:, None], position[:, 0], column, keys)
            else:
                logits = dec.forward(tok[:, None], position, ones)
            position = position + 1
        answer = torch.stack(tokens, dim=1)
        return Generated(torch.cat([prompt, answer], dim=1), torch.stack(logps, dim=1) if logps else None)


class HFBackend:
    name = "hf"

    @torch.no_grad()
    def generate(self, module: torch.nn.Module, prompt: torch.Tensor, prompt_mask: torch.Tensor,
                 config: GenerationConfig, eos_token_id: int | list[int], pad_token_id: int) -> Generated:
        kwargs: dict[str, Any] = {"attention_mask": prompt_mask, "max_new_tokens": config.max_new_tokens,
                                  "do_sample": config.do_sample, "pad_token_id": pad_token_id,
                                  "eos_token_id": eos_token_id, "use_cache": True}
        if config.do_sample:
            kwargs.update(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k)
        else:  # neutral sampling knobs: greedy ignores them, and transformers warns when a model's config sets them
            kwargs.update(temperature=1.0, top_p=1.0, top_k=0)
        if config.repetition_penalty != 1.0:
            kwargs["repetition_penalty"] = config.repetition_penalty
        if config.on_token is not None:
            kwargs["stopping_criteria"] = _stop_when(config.on_token)
        return Generated(module.generate(prompt, **kwargs))


def _stop_when(on_token: Callable[[torch.Tensor], bool]) -> Any:
    """``on_token`` as HF ``generate``'s stopping criterion: called after each step with the newest tokens."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class OnToken(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            stop = bool(on_token(input_ids[:, -1]))
            return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([OnToken()])
