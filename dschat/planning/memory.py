"""Per-GPU memory of one model, by phase: pure arithmetic on a ``ModelShape`` and the run's settings.

Notation: ``P`` parameters, ``T`` trainable parameters (``P`` without LoRA), ``N`` data-parallel ranks (GPUs per
node x nodes), ``d`` bytes of the parameter dtype (2 for bf16/fp16, 4 for fp32), ``b`` micro-batch rows, ``s``
tokens per row, ``h`` hidden size, ``L`` layers, ``I`` MLP width, ``q = heads x head_dim``, ``k = kv_heads x
head_dim``, ``V`` vocabulary.

Model states (what DeepSpeed holds between steps; the same accounting as DeepSpeed's own estimators
``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_model_states_mem_needs``):

* weights ``d P``; ZeRO-3 partitions them (``d P / N``), and with ``--offload`` keeps them in CPU memory. ZeRO-3
  also gathers one module at a time for its forward and backward: ``2 d x`` the largest module's parameters
  (its gathered weights and their gradient).
* gradients ``d T``; ZeRO-2/3 partition them (``d T / N``); with ``--offload`` (ZeRO >= 1) they go to the CPU with
  the optimizer.
* ZeRO-1/2/3 also hold DeepSpeed's contiguous gradient bucket (``gradient_bucket_bytes``; outside the estimators):
  ZeRO-3 from the start, ZeRO-1/2 from each backward to its step.
* optimizer states ``16 T``: Adam's fp32 master weights, first and second moments and the fp32 gradient the
  step reads (4 + 4 + 4 + 4 bytes); ZeRO-1/2 partition them (``16 T / N``); ZeRO-3 ``14 T / N``: its step
  upcasts the gradient of one optimizer sub-group at a time, and DeepSpeed's stage-3 estimator counts 18 bytes
  per parameter in all (2 + 2 + 14); ``--offload`` moves them to the CPU. In fp32 without ZeRO torch's AdamW
  updates the weights in place: ``8 T`` (the moments only).

Activations of one training micro-batch (16-bit or fp32 elements of ``d`` bytes; Korthikanti et al. 2022,
arXiv:2205.05198, Sec. 4.1, counted for a gated or plain MLP and grouped-query attention, without dropout masks,
with fused (SDPA) attention that keeps no ``s x s`` matrix):

* per layer and token: ``4h`` (two norms' inputs and outputs) ``+ 2q`` (queries, attention output) ``+ 2k``
  (keys, values) ``+ 4I`` (gated MLP: gate, up, activation, product; ``2I`` for a plain MLP) elements;
* outside the layers: the embedding output and the final norm (``2h`` per token), and the logits of the
  positions that get a loss: ``V (d + 4)`` bytes per token, plus ``4 V`` more for the fp32 upcast under 16-bit
  (cross-entropy keeps its log-softmax);
* the backward pass's working set: one more layer's activations (its gradients).
* with gradient checkpointing each layer keeps only its input (``h`` per token) and one layer is recomputed at
  a time: ``L h + 2 x one layer``.

Frozen forwards (reference, reward model, a teacher, the experience pass) keep nothing for a backward pass: one
layer's activations at a time, plus their output (the logits of the answer tokens, or one value per token).

KV cache of generation: ``L x 2 x kv_heads x head_dim x d`` bytes per token, for ``rows x (prompt + answer)``
tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dschat.planning.shapes import ModelShape

# Adam under DeepSpeed: fp32 master weights, m, v and the fp32 gradient partition, bytes per trainable parameter.
OPTIMIZER_BYTES = 16
# ZeRO-3: the fp32 gradient is upcast one optimizer sub-group at a time (DeepSpeed's stage-3 estimator's figure).
ZERO3_OPTIMIZER_BYTES = 14
# DeepSpeed's default reduce_bucket_size (elements), which dschat's DeepSpeed config keeps.
REDUCE_BUCKET = 500_000_000
# torch AdamW on fp32 weights without ZeRO: m and v only (it steps the weights in place).
FP32_ADAM_BYTES = 8
# ZeRO-3's stage3_prefetch_bucket_size in dschat's DeepSpeed config (elements): parameters gathered ahead of the
# module that needs them (``dschat.engine.ds_config``).
PREFETCH_BUCKET = 30_000_000


@dataclass(frozen=True)
class Sharding:
    """How one model is held: ZeRO ``stage`` over ``ranks`` GPUs, ``offload`` (optimizer state, and ZeRO-3
    parameters, in CPU memory), ``dtype_bytes`` of its weights."""

    stage: int = 0
    ranks: int = 1
    offload: bool = False
    dtype_bytes: int = 2
    offload_params: bool = True  # ZeRO-3 with offload: the parameters too (as --offload does)


@dataclass(frozen=True)
class ModelStates:
    """Model-state bytes per GPU (and the CPU bytes offload moves out of it)."""

    weights: int
    gathered: int  # ZeRO-3's live gathered module (weights + gradient)
    gradients: int
    optimizer: int
    cpu: int
    buckets: int = 0  # ZeRO-3's gradient bucket (``gradient_bucket_bytes``; ZeRO-1/2's is a train-phase item)

    @property
    def total(self) -> int:
        return self.weights + self.gathered + self.gradients + self.optimizer + self.buckets


def model_states(params: int, trainable: int, largest: int, z: Sharding) -> ModelStates:
    """Per-GPU weights, gradients and optimizer states of a model being trained (see the module docstring).

    ``params``: all parameters; ``trainable``: those with a gradient (LoRA adapters and a value head, or all);
    ``largest``: the largest module's own parameters (ZeRO-3's gather unit).
    """
    d, n = z.dtype_bytes, max(1, z.ranks)
    cpu = 0
    if z.stage == 3:
        on_cpu = z.offload and z.offload_params
        weights = 0 if on_cpu else _div(d * params, n)
        cpu += _div(d * params, n) if on_cpu else 0
        gathered = 2 * d * largest
    else:
        weights, gathered = d * params, 0
    grads = d * trainable if z.stage < 2 else _div(d * trainable, n)
    per_param = ZERO3_OPTIMIZER_BYTES if z.stage == 3 else OPTIMIZER_BYTES
    if z.offload and z.stage > 0:
        cpu += grads + _div(per_param * trainable, n)
        return ModelStates(weights, gathered, 0, 0, cpu)
    if z.stage == 0:
        optim = OPTIMIZER_BYTES * trainable if d < 4 else FP32_ADAM_BYTES * trainable
    else:
        optim = _div(per_param * trainable, n)
    return ModelStates(weights, gathered, grads, optim, cpu)


def gradient_bucket_bytes(trainable: int, z: Sharding, *, whole: bool = True) -> int:
    """ZeRO's contiguous gradient bucket (DeepSpeed's ``reduce_bucket_size``, 5e8 elements by default, which
    dschat keeps) beyond the gradients ``model_states`` counts; DeepSpeed's estimators leave it out.

    Each backward copies the gradients into the bucket before they are reduced. ZeRO-2/3 then keep only their
    partition, so the bucket comes on top (``min(T, bucket)`` elements hold gradients); under ZeRO-1 the bucket
    holds the gradients counted already. A GPU allocates the ``whole`` bucket (also past ``T``); CPU memory (RSS)
    sees only the part written (``whole=False``).
    """
    if z.stage == 0:
        return 0
    used = min(trainable, REDUCE_BUCKET)
    if z.stage >= 2:
        return (REDUCE_BUCKET if whole else used) * z.dtype_bytes
    return (REDUCE_BUCKET - used) * z.dtype_bytes if whole else 0


def prefetch_bytes(params: int, largest: int, z: Sharding) -> int:
    """ZeRO-3's prefetch during a forward or backward: the next modules' parameters gathered ahead, up to
    DeepSpeed's ``stage3_prefetch_bucket_size`` (``PREFETCH_BUCKET`` elements), beyond the live module that
    ``model_states`` counts; never more than the rest of the model."""
    if z.stage != 3:
        return 0
    return min(PREFETCH_BUCKET, max(0, params - largest)) * z.dtype_bytes


def frozen_weights(params: int, largest: int, z: Sharding) -> tuple[int, int]:
    """``(GPU bytes, CPU bytes)`` of a frozen model's weights: whole, ZeRO-3 partitioned (plus the gathered
    module), or offloaded to the CPU (ZeRO-3 parameter offload: only the gathered module on the GPU)."""
    d, n = z.dtype_bytes, max(1, z.ranks)
    if z.offload:
        return d * largest, d * params
    if z.stage == 3:
        return _div(d * params, n) + d * largest, 0
    return d * params, 0


def layer_elements(shape: ModelShape) -> int:
    """Activation elements one layer keeps per token for its backward pass (module docstring)."""
    mlp = (4 if shape.gated else 2) * shape.intermediate
    return 4 * shape.hidden + 2 * shape.q_dim + 2 * shape.kv_dim + mlp


def logits_bytes(shape: ModelShape, tokens: int, dtype_bytes: int) -> int:
    """Logits of ``tokens`` positions and what the cross-entropy / log-softmax keeps (an fp32 copy under 16-bit
    and its log-softmax)."""
    per = dtype_bytes + 4 + (4 if dtype_bytes < 4 else 0)
    return tokens * shape.vocab * per


def training_activations(shape: ModelShape, rows: int, seq: int, dtype_bytes: int, *, checkpointing: bool,
                         loss_tokens: int | None = None, head: str = "lm") -> int:
    """Activation bytes of one training micro-batch of ``rows x seq`` tokens (module docstring).

    ``loss_tokens``: positions whose logits are computed (default every token; ``head="value"`` has one value per
    token instead of logits).
    """
    tokens = rows * seq
    layer = tokens * layer_elements(shape) * dtype_bytes
    if checkpointing:
        body = shape.layers * tokens * shape.hidden * dtype_bytes + 2 * layer
    else:
        body = shape.layers * layer + layer
    outside = 2 * tokens * shape.hidden * dtype_bytes
    if head == "lm":
        outside += logits_bytes(shape, tokens if loss_tokens is None else loss_tokens, dtype_bytes)
    else:
        outside += tokens * 4
    return body + outside


def inference_activations(shape: ModelShape, rows: int, seq: int, dtype_bytes: int, *,
                          out_tokens: int | None = None, head: str = "lm") -> int:
    """Activation bytes of a forward without gradient: one layer's working set, the hidden states entering and
    leaving it, and the output (log-probs of ``out_tokens`` positions, or one value per token)."""
    tokens = rows * seq
    working = tokens * (layer_elements(shape) + 2 * shape.hidden) * dtype_bytes
    if head == "lm":
        working += logits_bytes(shape, tokens if out_tokens is None else out_tokens, dtype_bytes)
    else:
        working += tokens * 4
    return working


def kv_cache_bytes(shape: ModelShape, rows: int, tokens: int, dtype_bytes: int) -> int:
    """``L x 2 x kv_heads x head_dim x d`` bytes per token, for ``rows`` sequences of ``tokens`` tokens."""
    return shape.layers * 2 * shape.kv_heads * shape.head_dim * dtype_bytes * rows * tokens


LORA_TARGETS = {  # module name -> (in features, out features) as functions of the shape, per family layout
    "q_proj": lambda s: (s.hidden, s.q_dim), "k_proj": lambda s: (s.hidden, s.kv_dim),
    "v_proj": lambda s: (s.hidden, s.kv_dim), "o_proj": lambda s: (s.q_dim, s.hidden),
    "gate_proj": lambda s: (s.hidden, s.intermediate), "up_proj": lambda s: (s.hidden, s.intermediate),
    "down_proj": lambda s: (s.intermediate, s.hidden),
}
# OPT and GPT-2 spell the same projections differently.
LORA_NAMES = {
    "opt": {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "o_proj": "out_proj", "up_proj": "fc1",
            "down_proj": "fc2"},
    "gpt2": {"q_proj": "c_attn", "k_proj": "c_attn", "v_proj": "c_attn", "o_proj": "attn.c_proj",
             "up_proj": "c_fc", "down_proj": "mlp.c_proj"},
}


def lora_params(shape: ModelShape, rank: int, modules: str = "all-linear") -> int:
    """Adapter parameters of LoRA rank ``rank`` on the blocks' linear layers: ``r x (in + out)`` per adapted
    matrix. ``modules`` is ``all-linear`` or comma-separated name substrings (a substring that names no
    projection, e.g. ``decoder.layers.``, selects them all)."""
    if rank <= 0:
        return 0
    names = LORA_NAMES.get(shape.model_type, {k: k for k in LORA_TARGETS})
    targets = [t for t in LORA_TARGETS if t in names and (shape.gated or t != "gate_proj")]
    wanted = [w.strip() for w in modules.split(",") if w.strip()]
    if modules != "all-linear" and any(any(w in names[t] for t in targets) for w in wanted):
        targets = [t for t in targets if any(w in names[t] for w in wanted)]
    return shape.layers * sum(rank * sum(LORA_TARGETS[t](shape)) for t in targets)


def _div(x: int, n: int) -> int:
    return math.ceil(x / n)
