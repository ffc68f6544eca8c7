"""A Llama-architecture model re-implemented over its own weights for decoding (``LeanLlama``): prefill, the
one-token step and its constant-shape form for capture, with a KV cache allocated once.

The same operations as transformers' Llama/Mistral/Qwen2 modules in eval mode, without their per-call machinery
(mask building, cache objects, module hooks). Any other model, or one whose layers are wrapped (LoRA), decodes
through its own ``forward`` (``dschat.generation.decode.HFForward``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dschat.models import heads

# torch's own linear. ZeRO-3's zero.Init replaces torch.nn.functional.linear, process-wide and for good, with a
# memory-saving autograd function (DeepSpeed's "memory_efficient_linear"); under no_grad it is only overhead:
# Python signature binding per call and a broadcast matmul in place of addmm, which slows decoding down markedly.
_linear = torch._C._nn.linear
LEAN_MODEL_TYPES = ("llama", "mistral", "qwen2")


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
    product over the same K as before (MKL may round a narrower product differently: the tests bound the
    log-prob difference), and the weights are copied once per decoder into that layout (at most
    ``SPLIT_COPY_BYTES``). The default S is the largest divisor of the head counts and widths up to torch's thread
    count, on CPUs only, where it makes decoding faster (with and without ZeRO-3; docs/generation.md).

    Two one-token steps:

    * ``forward`` appends at the cache's end and attends over the filled columns only: the least arithmetic, and
      the CPU's default;
    * ``step`` has constant shapes: it writes a given column and attends over the cache's whole width, unfilled
      columns masked. The same kernels at every token, so nothing is planned per key length (cuDNN attention
      builds a plan for each new shape), and it can be compiled or captured as a CUDA graph
      (``dschat.generation.graphs``). On CUDA it is the eager default too.

    One layer loop (``layers``) serves the prefill and both steps; they differ in their linear maps
    (``_Products``, ``_BlockProducts``) and in how they write and read the cache."""

    def __init__(self, model: torch.nn.Module, batch: int, total: int, split: int | None = None,
                 grouped: bool | None = None):
        self.model = model
        self.inner = model.model
        cfg = model.config
        self.H = cfg.num_attention_heads
        self.Hkv = cfg.num_key_value_heads or self.H
        self.D = int(heads.head_dim(cfg))
        self.eps = cfg.rms_norm_eps
        # on CUDA the constant-shape step attends by grouped products (``attend_all``)
        self.grouped = model.model.embed_tokens.weight.device.type == "cuda" if grouped is None else grouped
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

    def reset(self) -> None:
        """Empty the cache for a new batch of prompts, in place (a captured step keeps reading the same tensors):
        no column is real any more; what the old columns hold is never read unmasked."""
        self.keys.zero_()
        self.length = 0

    def adopt(self, other: LeanLlama, rows: torch.Tensor) -> None:
        """Take ``other``'s cache as this one's: row ``r`` gets ``other``'s row ``rows[r]`` (the prompts prefilled
        once for every row that repeats them)."""
        n = other.length
        for mine, theirs in ((self.k, other.k), (self.v, other.v)):
            for a, b in zip(mine, theirs, strict=True):
                a[:, :, :n] = b[rows, :, :n]
        self.keys[:, :n] = other.keys[rows, :n]
        self.length = n

    def step(self, ids: torch.Tensor, positions: torch.Tensor, column: torch.Tensor, keys: torch.Tensor,
             products: _Products | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row with constant shapes: ``ids`` (B, 1) at rotary ``positions`` (B,), written to cache
        column ``column`` (1,), attending over the cache's whole width where ``keys`` (B, total) is True (this
        column included). Returns the logits (B, V) in float32 and the updated ``keys``. Every tensor it makes has
        the same shape at every token, so it compiles to one graph and captures as one CUDA graph; ``products``
        defaults to one product per weight (the form that compiles)."""
        products = products or self.single
        keys = keys.index_fill(1, column, True)
        emb = self.inner.embed_tokens
        x = F.embedding(ids, emb.weight, emb.padding_idx)
        cos, sin = self.cos[positions][:, None, None], self.sin[positions][:, None, None]  # (B, 1, 1, D)
        mask = keys[:, None, None, :]

        def write(i: int, k: torch.Tensor, v: torch.Tensor) -> None:
            self.k[i].index_copy_(2, column, k)
            self.v[i].index_copy_(2, column, v)

        def attend(i: int, q: torch.Tensor) -> torch.Tensor:
            return self.attend_all(q, self.k[i], self.v[i], mask)

        return products.head(self.layers(x, cos, sin, products, write, attend)).float(), keys

    def attend_all(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Queries ``q`` (B, H, n, D) over the whole cache ``k``, ``v`` (B, Hkv, W, D) where ``mask`` (B, 1, n|1, W)
        is True: SDPA on a CPU; on CUDA (``grouped``) two batched products and a float32 softmax, each query head
        reading its group's key head in place (no per-step copy of the cache to H heads, and no choice of SDPA
        backend that depends on the key length)."""
        if not self.grouped:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.H != self.Hkv)
        return grouped_attention(q, k, v, mask)




def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scaled dot-product attention of ``q`` (B, H, n, D) over ``k``, ``v`` (B, Hkv, W, D) where ``mask``
    (B, 1, n|1, W) is True, with H = G x Hkv query heads: query head h reads key head h // G (the order of
    transformers' ``repeat_kv``). The scores are float32 for the softmax, the products in the cache's dtype."""
    B, H, n, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    qg = q.reshape(B, Hkv, G * n, D)  # (B, Hkv, G*n, D): heads of a group side by side
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * D ** -0.5  # (B, Hkv, G*n, W)
    m = mask if n == 1 else mask.unsqueeze(2).expand(B, 1, G, n, mask.shape[-1]).reshape(B, 1, G * n, -1)
    p = scores.masked_fill(~m, float("-inf")).softmax(-1).to(v.dtype)
    return torch.matmul(p, v).reshape(B, H, n, D)
