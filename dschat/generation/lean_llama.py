"""A Llama-architecture model re-implemented over its own weights for decoding (``LeanLlama``): prefill, the
one-token step and its constant-shape form for capture, with a KV cache allocated once.

The same operations as transformers' Llama/Mistral/Qwen2 modules in eval mode, without their per-call machinery
(mask building, cache objects, module hooks). Any other model, or one whose layers are wrapped (LoRA), decodes
through its own ``forward`` (``dschat.generation.decode.HFForward``)."""

from __future__ import annotations

import weakref
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

# The most a fused decoder copies (each layer's q/k/v and gate/up weights stacked, ``LeanLlama.fused``): beyond this
# the layers run one product per weight matrix.
FUSE_COPY_BYTES = 4 << 30


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` (..., D): x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1). The
    halves are swapped by one ``cat`` (which reads a strided ``x`` in place, where a roll would copy it first on
    CUDA) and the minus sits in ``signed_sin`` = cat(-sin1, sin2); (-a) * b == -(a * b) exactly, so the bits are
    those of transformers' ``apply_rotary_pos_emb``."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin


def repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Keys or values (B, Hkv, L, D) repeated to (B, Hkv * groups, L, D) in transformers' ``repeat_kv`` order
    (query head h reads key head h // groups); ``x`` itself when ``groups`` is 1."""
    if groups == 1:
        return x
    B, Hkv, L, D = x.shape
    return x[:, :, None].expand(B, Hkv, groups, L, D).reshape(B, Hkv * groups, L, D)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask (..., W) as the additive one SDPA's fused kernels read: 0 where True, -inf where
    False, in ``dtype``. The last dimension's storage is padded to a multiple of 8 elements (the returned tensor is
    a view of the first W columns), so every stride but the last is a multiple of 8: the alignment that torch's
    memory-efficient kernel asks of a mask, which it otherwise meets by a padded copy at every call."""
    width = allowed.shape[-1]
    out = torch.full((*allowed.shape[:-1], -(-width // 8) * 8), float("-inf"), dtype=dtype, device=allowed.device)
    return out[..., :width].masked_fill_(allowed, 0.0)


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

    def qkv(self, i: int, h: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer i's queries, keys and values of ``h`` (B, n, hidden): (B, heads, n, D) each, queries and keys
        rotated by ``cos``, ``sin`` (B, 1, n, D)."""
        a, (B, n) = self.layers[i].self_attn, h.shape[:2]
        q = _linear(h, a.q_proj.weight, a.q_proj.bias).view(B, n, -1, self.D).transpose(1, 2)
        k = _linear(h, a.k_proj.weight, a.k_proj.bias).view(B, n, -1, self.D).transpose(1, 2)
        v = _linear(h, a.v_proj.weight, a.v_proj.bias).view(B, n, -1, self.D).transpose(1, 2)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def out(self, i: int, o: torch.Tensor) -> torch.Tensor:
        a = self.layers[i].self_attn
        return _linear(o, a.o_proj.weight, a.o_proj.bias)

    def mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        f = self.layers[i].mlp
        return _linear(F.silu(_linear(h, f.gate_proj.weight)) * _linear(h, f.up_proj.weight), f.down_proj.weight)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """(B, hidden) -> logits (B, V)."""
        return _linear(x, self.model.lm_head.weight, self.model.lm_head.bias)


class _Stacked:
    """Each layer's q, k and v weights stacked as one matrix (q rows, then k, then v; biases likewise, zeros for a
    projection without one) and its gate and up weights as another: copies of a module's weights, one per module
    shared by its decoders alive at once (``stacked``), copied again in place by ``refresh`` (an optimizer step
    changes the module's weights in place; a kept decoder, whose captured graph reads these tensors, is reused
    across steps)."""

    def __init__(self, model: torch.nn.Module):
        self.layers = model.model.layers
        self.qkv: list[torch.Tensor] = []
        self.qkv_bias: list[torch.Tensor | None] = []
        self.gate_up: list[torch.Tensor] = []
        with torch.no_grad():
            for layer in self.layers:
                weights, biases, gate_up = self._sources(layer)
                self.qkv.append(torch.cat(weights))
                self.qkv_bias.append(None if biases is None else torch.cat(biases))
                self.gate_up.append(torch.cat(gate_up))

    @staticmethod
    def _sources(layer: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, list[torch.Tensor]]:
        a, f = layer.self_attn, layer.mlp
        qkv = (a.q_proj, a.k_proj, a.v_proj)
        biases = None
        if any(p.bias is not None for p in qkv):
            biases = [p.bias if p.bias is not None else p.weight.new_zeros(p.out_features) for p in qkv]
        return [p.weight for p in qkv], biases, [f.gate_proj.weight, f.up_proj.weight]

    def fits(self, model: torch.nn.Module) -> bool:
        """Whether these copies have the layout, dtype and device of ``model``'s weights now."""
        layers = model.model.layers
        if layers is not self.layers or len(self.qkv) != len(layers):
            return False
        for layer, qkv, bias, gate_up in zip(layers, self.qkv, self.qkv_bias, self.gate_up, strict=True):
            weights, biases, mlp = self._sources(layer)
            w = weights[0]
            if (qkv.dtype, qkv.device) != (w.dtype, w.device) or qkv.shape[0] != sum(x.shape[0] for x in weights) \
                    or gate_up.shape[0] != sum(x.shape[0] for x in mlp) or (bias is None) != (biases is None):
                return False
        return True

    def refresh(self) -> None:
        """Copy the module's current weights into the stacked tensors, in place (their addresses stay)."""
        with torch.no_grad():
            for layer, qkv, bias, gate_up in zip(self.layers, self.qkv, self.qkv_bias, self.gate_up, strict=True):
                weights, biases, mlp = self._sources(layer)
                torch.cat(weights, out=qkv)
                if bias is not None and biases is not None:
                    torch.cat(biases, out=bias)
                torch.cat(mlp, out=gate_up)


# the live stacked copies, by module: weakly held on both sides, so a copy lives exactly as long as the decoders
# that read it (and a module's entry as long as the module)
_STACKED: weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref[_Stacked]] = weakref.WeakKeyDictionary()


def stacked(model: torch.nn.Module) -> _Stacked:
    """``model``'s stacked q/k/v and gate/up weights with its current values: the copy its live decoders already
    hold, refreshed in place, or a new one."""
    ref = _STACKED.get(model)
    held = ref() if ref is not None else None
    if held is not None and held.fits(model):
        held.refresh()
        return held
    held = _Stacked(model)
    _STACKED[model] = weakref.ref(held)
    return held


def stacked_bytes(model: torch.nn.Module) -> int:
    """The bytes of ``model``'s stacked copy (``_Stacked``): its q/k/v, gate and up weights, and q/k/v biases (a
    zero row for a projection without one) where any projection of a layer has one."""
    total = 0
    for layer in model.model.layers:
        weights, biases, mlp = _Stacked._sources(layer)
        w = weights[0]
        total += sum(x.numel() for x in (*weights, *mlp, *(biases or ()))) * w.element_size()
    return total


class _FusedProducts(_Products):
    """The same maps with each layer's q, k and v in one product and its gate and up in one (over ``_Stacked``
    copies of the weights), and the queries and keys rotated together: per layer two products and one rotation
    where ``_Products`` runs five products and two rotations. Each output is the same dot product over the same
    inputs; a wider product may round differently (the tests bound the log-prob difference)."""

    def __init__(self, model: torch.nn.Module, head_dim: int, heads: int, kv_heads: int):
        super().__init__(model, head_dim)
        self.H, self.Hkv = heads, kv_heads
        self.weights = stacked(model)

    def qkv(self, i: int, h: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, n = h.shape[:2]
        w = self.weights
        x = _linear(h, w.qkv[i], w.qkv_bias[i]).view(B, n, -1, self.D)  # (B, n, H + 2 Hkv, D): q, k, v heads
        rotated = rotate(x[:, :, :self.H + self.Hkv], cos.transpose(1, 2), sin.transpose(1, 2)).transpose(1, 2)
        return rotated[:, :self.H], rotated[:, self.H:], x[:, :, self.H + self.Hkv:].transpose(1, 2)

    def mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        gate, up = _linear(h, self.weights.gate_up[i]).chunk(2, dim=-1)
        return _linear(F.silu(gate) * up, self.layers[i].mlp.down_proj.weight)


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

    def qkv(self, i: int, h: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, S, D = h.shape[0], self.S, self.D
        w, bias = self.blocks[i][:2]
        parts = _split_bmm(h.view(B, -1), w, bias).split(self.widths, dim=-1)  # (S, B, heads / S * D) each
        # block-major heads (S, B, heads / S, D) back to (B, heads, 1, D): heads in their own order
        q, k, v = (p.view(S, B, -1, D).permute(1, 0, 2, 3).reshape(B, -1, 1, D) for p in parts)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

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

    On CUDA, where a small batch's step is bound by kernel launches, ``fused`` (the default there) runs each
    layer's q/k/v as one product and its gate/up as one, over stacked copies of those weights (``_Stacked``, at most
    ``FUSE_COPY_BYTES``; made with the decoder, shared by a module's live decoders, copied again by ``reset``).

    Two one-token steps:

    * ``forward`` appends at the cache's end and attends over the filled columns only: the least arithmetic, and
      the CPU's default;
    * ``step`` has constant shapes: it writes a given column and attends over the cache's whole width, unfilled
      columns masked. The same kernels at every token, so nothing is planned per key length (cuDNN attention
      builds a plan for each new shape), and it can be compiled or captured as a CUDA graph
      (``dschat.generation.graphs``). On CUDA it is the eager default too.

    The prefill (``forward`` over several tokens) calls SDPA in the form torch's memory-efficient kernel accepts
    with a mask: key and value heads repeated to the query heads (that kernel takes no grouped-query attention
    with a mask, and the flash kernel no mask at all) and an additive mask in the activations' dtype, built once
    per prefill with aligned strides (``additive_mask``). A boolean mask with ``enable_gqa`` leaves CUDA only the
    math kernel, which builds a float32 score tensor of rows x heads x prompt x width per layer.

    One layer loop (``layers``) serves the prefill and both steps; they differ in their linear maps
    (``_Products``, ``_FusedProducts``, ``_BlockProducts``) and in how they write and read the cache."""

    def __init__(self, model: torch.nn.Module, batch: int, total: int, split: int | None = None,
                 grouped: bool | None = None, fused: bool | None = None):
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
        self.fused = self.default_fused(model) if fused is None else fused
        # the maps of the prefill and of every one-token step that is not split in blocks
        self.stepping: _Products = _FusedProducts(model, self.D, self.H, self.Hkv) if self.fused else self.single
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

    @staticmethod
    def default_fused(model: torch.nn.Module) -> bool:
        """Whether a decoder of ``model`` stacks its q/k/v and gate/up weights by default: on CUDA (where each
        product saved is a kernel launch saved per layer and token) while the copy stays within
        ``FUSE_COPY_BYTES``; never on a CPU, whose one-token step is bound by reading the weights and splits them in
        column blocks instead (``default_split``)."""
        return model.model.embed_tokens.weight.is_cuda and stacked_bytes(model) <= FUSE_COPY_BYTES

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """HF's RMSNorm: ``x`` normalised in float32 (x * rsqrt(mean(x^2) + eps)), cast back to its dtype, times
        ``weight``. One fused kernel on CUDA in float32 (the weight's product is then float32 too, as in HF); in half
        precision the normalisation is that kernel and the weight's product a second one, after the cast, which
        keeps HF's rounding (the fused weighted kernel scales before it casts)."""
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        return weight * F.rms_norm(x, (x.shape[-1],), None, self.eps)

    def products(self, n: int) -> _Products:
        """The linear maps for ``n`` tokens per row: column blocks for one token when ``split`` > 1 (made at the
        first such step), else ``stepping`` (stacked q/k/v and gate/up products when ``fused``, else one product
        per weight)."""
        if n > 1:
            return self.stepping
        if self.split is None:
            self.split = self.default_split(self.model)
        if self.split == 1:
            return self.stepping
        if self.blocks is None:
            self.blocks = _BlockProducts(self.model, self.D, self.H, self.Hkv, self.split)
        return self.blocks

    def layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, products: _Products,
               write: Callable[[int, torch.Tensor, torch.Tensor], None],
               attend: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The decoder layers over ``x`` (B, n, hidden) at rotary ``cos``, ``sin`` (B, 1, n, D): ``write(i, k, v)``
        puts layer i's rotated keys and values in its cache, ``attend(i, q)`` attends over it. Returns the last
        position's final-norm hidden state."""
        B, n = x.shape[:2]
        for i, layer in enumerate(self.inner.layers):
            q, k, v = products.qkv(i, self._norm(x, layer.input_layernorm.weight), cos, sin)
            write(i, k, v)
            o = attend(i, q)
            x = x + products.out(i, o.transpose(1, 2).reshape(B, n, -1))
            x = x + products.mlp(i, self._norm(x, layer.post_attention_layernorm.weight))
        return self._norm(x[:, -1], self.inner.norm.weight)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """Run ``ids`` (B, n) at ``positions`` (B, n), appending their keys/values to the cache; ``real`` (B, n)
        marks non-pad tokens. Returns the last position's logits (B, V) in float32. Several tokens (a prefill)
        attend in the form SDPA's memory-efficient kernel takes (the class docstring says why); one token attends
        with a boolean mask and ``enable_gqa``, over the cache's heads in place."""
        B, n = ids.shape
        start, end = self.length, self.length + n
        self.keys[:, start:end] = real.bool()
        # the weights directly, not the modules: under ZeRO-3 every module call runs DeepSpeed's fetch/release
        # hooks, even with the parameters already gathered (a few ms per call and token)
        emb = self.inner.embed_tokens
        x = F.embedding(ids, emb.weight, emb.padding_idx)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # (B, 1, n, D)
        mask = self.keys[:, None, None, :end]
        groups = self.H // self.Hkv
        if n > 1:  # prefill: causal within the new tokens; each query also sees itself (pad rows stay finite)
            causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
            mask = mask.expand(B, 1, n, end).clone()
            mask[..., start:] &= causal
            mask[..., start:] |= torch.eye(n, dtype=torch.bool, device=ids.device)
            mask = additive_mask(mask, x.dtype)  # once for every layer

        def write(i: int, k: torch.Tensor, v: torch.Tensor) -> None:
            self.k[i][:, :, start:end] = k
            self.v[i][:, :, start:end] = v

        def attend(i: int, q: torch.Tensor) -> torch.Tensor:
            k, v = self.k[i][:, :, :end], self.v[i][:, :, :end]
            if n > 1:
                return F.scaled_dot_product_attention(q, repeat_heads(k, groups), repeat_heads(v, groups),
                                                      attn_mask=mask)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=groups > 1)

        products = self.products(n)
        last = self.layers(x, cos, sin, products, write, attend)
        self.length = end
        return products.head(last).float()

    def reset(self) -> None:
        """Make the decoder ready for a new batch of prompts, in place (a captured step keeps reading the same
        tensors): no cache column is real any more (what the old columns hold is never read unmasked), and the
        stacked weights of a ``fused`` decoder hold the module's current ones (an optimizer step since the last
        batch changed those in place)."""
        self.keys.zero_()
        self.length = 0
        if isinstance(self.stepping, _FusedProducts):
            self.stepping.weights.refresh()

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
        defaults to ``stepping`` (stacked or single products: the forms that compile)."""
        products = products or self.stepping
        keys = keys.index_fill(1, column, True)
        emb = self.inner.embed_tokens
        x = F.embedding(ids, emb.weight, emb.padding_idx)
        cos, sin = self.cos[positions][:, None, None], self.sin[positions][:, None, None]  # (B, 1, 1, D)
        mask = keys[:, None, None, :]
        if self.grouped:  # the additive float32 mask once for every layer
            mask = additive_mask(mask, torch.float32)

        def write(i: int, k: torch.Tensor, v: torch.Tensor) -> None:
            self.k[i].index_copy_(2, column, k)
            self.v[i].index_copy_(2, column, v)

        def attend(i: int, q: torch.Tensor) -> torch.Tensor:
            return self.attend_all(q, self.k[i], self.v[i], mask)

        return products.head(self.layers(x, cos, sin, products, write, attend)).float(), keys

    def attend_all(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Queries ``q`` (B, H, n, D) over the whole cache ``k``, ``v`` (B, Hkv, W, D) where ``mask`` (B, 1, n|1, W)
        allows (``grouped_attention``'s forms): SDPA on a CPU; on CUDA (``grouped``) two batched products and a
        float32 softmax, each query head reading its group's key head in place (no per-step copy of the cache to H
        heads, and no choice of SDPA backend that depends on the key length)."""
        if not self.grouped:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.H != self.Hkv)
        return grouped_attention(q, k, v, mask)


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scaled dot-product attention of ``q`` (B, H, n, D) over ``k``, ``v`` (B, Hkv, W, D) where ``mask``
    (B, 1, n|1, W) allows, with H = G x Hkv query heads: query head h reads key head h // G (the order of
    transformers' ``repeat_kv``). ``mask`` is boolean (True: attend) or its float32 additive form (0 or -inf; a step
    makes it once for all its layers). The scores are float32 for the softmax, the products in the cache's dtype;
    scaling and masking are one kernel (``add`` with ``alpha``: the bits of scaling, then filling)."""
    B, H, n, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    bias = mask if mask.is_floating_point() else additive_mask(mask, torch.float32)
    if n > 1:
        bias = bias.unsqueeze(2).expand(B, 1, G, n, bias.shape[-1]).reshape(B, 1, G * n, -1)
    qg = q.reshape(B, Hkv, G * n, D)  # (B, Hkv, G*n, D): heads of a group side by side
    scores = torch.add(bias, torch.matmul(qg, k.transpose(-1, -2)), alpha=D ** -0.5)  # (B, Hkv, G*n, W) float32
    return torch.matmul(scores.softmax(-1).to(v.dtype), v).reshape(B, H, n, D)
