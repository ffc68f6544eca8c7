"""``make_plan``: per-GPU memory of a stage's models in each phase, a verdict, and a roofline time estimate.

The stage's flags are parsed by the stage's own config class (``dschat.config.build_config``), so the planner
reads exactly what ``dschat train --step N`` would; model shapes come from config files alone
(``dschat.planning.shapes``) and the arithmetic from ``dschat.planning.memory``. Nothing here loads weights or
imports torch (stage 3's algorithms answer from their specs, ``dschat.rlhf.specs``).

Phases: stages 1 and 2 have one (``train``: the trained model's micro-batch, and a distillation teacher's
forward). Stage 3 has ``generate`` (the actor's weights gathered whole under ZeRO-3, as the generation path and
DeepSpeed's hybrid engine do, plus the KV cache of the generation batch; with CUDA-graph sampling the capture's
bucket-sized KV cache and token step, which the hybrid engine releases when the call ends, so no other phase
counts them), ``experience`` (the largest of the forwards of actor, reference, critic and reward model over the
generated rows; they run one after another), ``train actor`` and ``train critic``. Every model's resident bytes
(weights, gradients, optimizer states) count in every phase; a phase adds its transient bytes. The peak is the
largest phase, plus a fixed reserve for the CUDA context, communication buffers and allocator slack. With
asynchronous rollouts (``--async-rollouts``, ``--sampler``) the sampler's time and memory, the step time overlapped
and in lockstep, and the split of the devices between sampling and training (``dschat.planning.rollouts``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from dschat.errors import UserError
from dschat.planning.gpus import DEFAULT_GPU, GPU, GPUS, find_gpu, fmt_bytes, fmt_rate
from dschat.planning.memory import (
    LORA_NAMES,
    LORA_TARGETS,
    ModelStates,
    Sharding,
    frozen_weights,
    gradient_bucket_bytes,
    inference_activations,
    kv_cache_bytes,
    lora_params,
    model_states,
    prefetch_bytes,
    training_activations,
)
from dschat.planning.rollouts import RolloutsPlan, WeightUpdate, pack_buckets
from dschat.planning.shapes import ModelShape, model_config, shape_from_config

# Efficiency assumptions of the time estimate (docs/planning.md): model FLOPs utilisation of training and of the
# frozen forwards, and the share of the memory bandwidth a decode step reaches.
TRAIN_MFU = 0.40
FORWARD_MFU = 0.40
DECODE_BANDWIDTH = 0.60
# The LoRA rank the suggestion tries (DeepSpeed-Chat's example scripts use 128).
SUGGESTED_LORA_DIM = 128
MAX_GPUS_PER_NODE = 8
MAX_NODES = 64
# The caching allocator's reserve over what tensors use, as a share of the largest phase's transient bytes (a
# GPU only; docs/planning.md, "On a GPU": a model, not yet measured).
ALLOCATOR_SLACK = 0.25
# Queries per generate call of a generative judge reward (``dschat.rewards.judge.load_judge_reward``).
JUDGE_BATCH = 32
# The CUDA-graph decode step (``dschat.generation.graphs``, which imports torch; tests hold these equal to its own):
# the model types it runs (``lean_llama.LEAN_MODEL_TYPES``) and the buckets a capture's KV cache is rounded up to.
GRAPH_MODEL_TYPES = ("llama", "mistral", "qwen2")
GRAPH_BATCH_BUCKET = 8
GRAPH_WIDTH_BUCKET = 128
# The largest copy the decoder's stacked q/k/v and gate/up weights may take on CUDA (``lean_llama.FUSE_COPY_BYTES``).
FUSE_COPY_BYTES = 4 << 30


@dataclass
class ModelPlan:
    """One model of the stage: its role, shape, parameter counts, how it is held, and its resident bytes."""

    role: str  # model, teacher, reward model, actor, critic, reference, reward
    name: str  # the --model value
    shape: ModelShape
    head: str  # "lm" or "value"
    params: int
    trainable: int  # 0 for a frozen model
    sharding: Sharding
    states: ModelStates
    source: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"role": self.role, "model": self.name, "source": self.source, "params": self.params,
                "trainable": self.trainable, "zero_stage": self.sharding.stage, "offload": self.sharding.offload,
                "dtype_bytes": self.sharding.dtype_bytes,
                "states": {"weights": self.states.weights, "gathered": self.states.gathered,
                           "gradients": self.states.gradients, "optimizer": self.states.optimizer,
                           "gradient_bucket": self.states.buckets,
                           "total": self.states.total, "cpu": self.states.cpu},
                "shape": self.shape.to_json()}


@dataclass
class Phase:
    """A phase's transient bytes per GPU on top of the resident model states: ``(role, what, bytes)`` items."""

    name: str
    items: list[tuple[str, str, int]] = field(default_factory=list)

    @property
    def transient(self) -> int:
        return sum(b for _, _, b in self.items)


@dataclass
class Throughput:
    """The roofline time estimate of one optimizer step (stage 3: one update) and of the run."""

    flops_per_step: float  # per GPU
    step_seconds: float
    steps: int | None  # None: neither --max-steps nor --rows given
    parts: dict[str, float]  # seconds per step by part
    tokens_per_step: int  # per GPU
    notes: list[str]
    rollouts: RolloutsPlan | None = None  # stage 3 with --async-rollouts or --sampler

    @property
    def total_seconds(self) -> float | None:
        return None if self.steps is None else self.steps * self.step_seconds

    def to_json(self) -> dict[str, Any]:
        return {"flops_per_step_per_gpu": self.flops_per_step, "step_seconds": self.step_seconds,
                "steps": self.steps, "total_seconds": self.total_seconds, "parts_seconds": self.parts,
                "tokens_per_step_per_gpu": self.tokens_per_step, "assumptions": self.notes}


@dataclass
class Plan:
    """What ``dschat plan`` prints: the per-GPU memory table, the verdict, a suggestion, the time estimate."""

    step: int
    gpu: GPU
    num_gpus: int
    nodes: int
    memory: int  # bytes per GPU
    reserve: int
    models: list[ModelPlan]
    phases: list[Phase]
    throughput: Throughput
    checkpoint_bytes: int  # the model folder(s) the stage saves
    state_bytes: int  # one resumable training state (weights + fp32 master and Adam moments)
    settings: dict[str, Any]
    suggestion: str | None = None
    suggested_flags: dict[str, Any] = field(default_factory=dict)
    allocator: int = 0  # the caching allocator's reserve over allocation, in every phase (a GPU only)
    reserve_items: list[tuple[str, int]] = field(default_factory=list)  # ``reserve`` term by term

    @property
    def resident(self) -> int:
        return sum(m.states.total for m in self.models)

    def phase_total(self, phase: Phase) -> int:
        return self.resident + phase.transient + self.reserve + self.allocator

    @property
    def peak_phase(self) -> Phase:
        return max(self.phases, key=self.phase_total)

    @property
    def peak_bytes(self) -> int:
        return self.phase_total(self.peak_phase)

    @property
    def fits(self) -> bool:
        r = self.throughput.rollouts
        return self.peak_bytes <= self.memory and (r is None or r.fits)

    @property
    def cpu_bytes(self) -> int:
        """CPU memory per GPU that offload takes (optimizer states, ZeRO-3 parameters, offloaded frozen models)."""
        return sum(m.states.cpu for m in self.models)

    def table(self) -> str:
        """The plan as text: model states, phases, verdict, time."""
        n = self.num_gpus * self.nodes
        s = self.settings
        lines = [f"dschat plan: step {self.step}{' (' + s['algo'] + ')' if self.step == 3 else ''} on {n} x "
                 f"{self.gpu.name} ({self.num_gpus} per node x {self.nodes} node{'s' if self.nodes > 1 else ''}), "
                 f"{fmt_bytes(self.memory)} per GPU; {s['dtype']}, micro-batch {s['micro_batch']}, sequence "
                 f"{s['seq_len']} tokens", ""]
        head = ["role", "model", "params", "trainable", "ZeRO", "weights", "ZeRO-3 gather", "gradients", "optimizer",
                "ZeRO-3 bucket", "resident", "CPU (offload)"]
        rows = [[m.role, m.name, _count(m.params), _count(m.trainable) if m.trainable else "frozen",
                 f"{m.sharding.stage}{'+offload' if m.sharding.offload else ''}", fmt_bytes(m.states.weights),
                 fmt_bytes(m.states.gathered), fmt_bytes(m.states.gradients), fmt_bytes(m.states.optimizer),
                 fmt_bytes(m.states.buckets), fmt_bytes(m.states.total), fmt_bytes(m.states.cpu)]
                for m in self.models]
        lines += _grid(head, rows)
        lines.append("")
        peak = self.peak_phase
        head = ["phase", "resident", "transient (what)", "reserve", "allocator", "total per GPU"]
        rows = []
        for p in self.phases:
            what = "; ".join(f"{role} {w} {fmt_bytes(b)}" for role, w, b in p.items) or "-"
            rows.append([p.name + (" (peak)" if p is peak else ""), fmt_bytes(self.resident), what,
                         fmt_bytes(self.reserve), fmt_bytes(self.allocator), fmt_bytes(self.phase_total(p))])
        lines += _grid(head, rows)
        lines.append("reserve: " + "; ".join(f"{w} {fmt_bytes(b)}" for w, b in self.reserve_items) +
                     (f"; allocator: {ALLOCATOR_SLACK:.0%} of the largest phase's transient bytes" if self.allocator
                      else ""))
        lines.append("")
        verdict = "fits" if self.fits else "does NOT fit"
        r = self.throughput.rollouts
        shared = (f"; {r.shares.partition(' ')[0]} also holds the sampler ({fmt_bytes(r.sampler_bytes)}): "
                  f"{fmt_bytes(r.shared_peak)}" if r is not None and r.shared_peak else "")
        if r is not None and not r.trainer_fits:
            shared += (f"; the first rank also stages the weight update ({fmt_bytes(r.update.trainer_bytes)}): "
                       f"{fmt_bytes(r.trainer_peak + r.update.trainer_bytes)}")
        lines.append(f"verdict: {verdict}: peak {fmt_bytes(self.peak_bytes)} ({peak.name}) of "
                     f"{fmt_bytes(self.memory)} per GPU{shared}")
        if self.cpu_bytes:
            lines.append(f"CPU memory for offload: {fmt_bytes(self.cpu_bytes)} per GPU, "
                         f"{fmt_bytes(self.cpu_bytes * self.num_gpus)} per node")
        if self.suggestion:
            lines.append(f"suggestion: {self.suggestion}")
        t = self.throughput
        parts = ", ".join(f"{k} {_secs(v)}" for k, v in t.parts.items())
        unit = "update" if self.step == 3 else "step"
        lines.append(f"time: {_secs(t.step_seconds)} per {unit} ({parts})" +
                     (f"; {t.steps} {unit}s: {_secs(t.total_seconds or 0)}" if t.steps is not None else
                      "; give --max-steps or --rows for the run's total"))
        lines.append("assuming " + "; ".join(t.notes))
        if r is not None:
            lines += r.lines(_secs, self.gpu.name)
        lines.append(f"saves: {fmt_bytes(self.checkpoint_bytes)} of model folders, "
                     f"{fmt_bytes(self.state_bytes)} per resumable training state")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "fits": self.fits, "peak_bytes": self.peak_bytes, "peak_phase": self.peak_phase.name,
            "memory_bytes": self.memory, "reserve_bytes": self.reserve, "step": self.step,
            "reserve_items": [{"what": w, "bytes": b} for w, b in self.reserve_items],
            "allocator_bytes": self.allocator,
            "gpu": dataclasses.asdict(self.gpu), "num_gpus": self.num_gpus, "nodes": self.nodes,
            "settings": self.settings, "models": [m.to_json() for m in self.models],
            "phases": [{"phase": p.name, "resident_bytes": self.resident, "transient_bytes": p.transient,
                        "total_bytes": self.phase_total(p),
                        "items": [{"role": r, "what": w, "bytes": b} for r, w, b in p.items]} for p in self.phases],
            "cpu_bytes": self.cpu_bytes, "checkpoint_bytes": self.checkpoint_bytes, "state_bytes": self.state_bytes,
            "suggestion": self.suggestion, "suggested_flags": self.suggested_flags,
            "throughput": self.throughput.to_json(),
            "async_rollouts": self.throughput.rollouts.to_json() if self.throughput.rollouts else None,
        }


def config_class(step: int) -> type:
    """The stage's config class."""
    if step == 1:
        from dschat.config import SFTConfig

        return SFTConfig
    if step == 2:
        from dschat.config import RewardConfig

        return RewardConfig
    if step == 3:
        from dschat.rlhf.config import RLHFConfig

        return RLHFConfig
    raise UserError(f"--step must be 1, 2 or 3, got {step}")


def make_plan(step: int, values: dict[str, Any], *, num_gpus: int = 1, nodes: int = 1, gpu_memory: int | None = None,
              gpu: str | None = None, rows: int | None = None, reserve_bytes: int | None = None,
              suggest: bool = True, whole_buckets: bool | None = None) -> Plan:
    """Plan stage ``step`` for the flat stage flags ``values`` (the config's field names, as ``dschat train``
    takes them) on ``num_gpus`` GPUs per node x ``nodes``.

    ``gpu``: a name of ``dschat.planning.gpus.GPUS`` (its memory, FLOPs, bandwidth; default A100-80GB);
    ``gpu_memory``: bytes per GPU (overrides the GPU's); ``rows``: training rows of the whole dataset (split by
    ``--data-split``) for the run's time when ``--max-steps`` is not given; ``reserve_bytes``: fixed overhead
    per GPU (default: the device's, ``GPU.reserve_for``); ``suggest``: search for the smallest change that fits
    when it does not; ``whole_buckets=False`` counts only the written part of DeepSpeed's gradient bucket, as CPU
    memory sees it (``dschat.planning.memory.gradient_bucket_bytes``; the default on ``--gpu CPU``).
    """
    from dschat.config import build_config

    if num_gpus < 1 or nodes < 1:
        raise UserError("--num-gpus and --nodes must be at least 1")
    dev = find_gpu(gpu) if gpu else GPUS[DEFAULT_GPU.lower()]
    memory = gpu_memory if gpu_memory is not None else dev.memory_per_rank(num_gpus)
    reserve = dev.reserve_for(num_gpus * nodes) if reserve_bytes is None else reserve_bytes
    whole = not dev.host if whole_buckets is None else whole_buckets
    cfg = build_config(config_class(step), dict(values))
    ranks = num_gpus * nodes
    build = {1: _stage1, 2: _stage2, 3: _stage3}[step]
    models, phases, throughput, settings = build(cfg, ranks, dev, rows, whole)
    saved = [m for m in models if m.trainable or m.role == "actor EMA"]
    checkpoint = sum(m.params * models[0].sharding.dtype_bytes for m in saved)
    state = sum(m.params * m.sharding.dtype_bytes + 12 * m.trainable for m in models if m.trainable)
    items = dev.reserve_items(ranks) if reserve_bytes is None else [("fixed cost", reserve_bytes)]
    allocator = 0 if dev.host else math.ceil(ALLOCATOR_SLACK * max(p.transient for p in phases))
    plan = Plan(step, dev, num_gpus, nodes, memory, reserve, models, phases, throughput, checkpoint, state, settings,
                allocator=allocator, reserve_items=items)
    r = throughput.rollouts
    if r is not None:
        # --sampler-devices cuda:N of a training rank's GPU (on the first node): both processes hold it
        shared = r.device_index is not None and r.device_index < num_gpus and not dev.host
        r.settle(plan.peak_bytes, memory, f"cuda:{r.device_index} with a training rank" if shared else "")
        if shared and suggest and not r.shared_fits:  # first a device of its own for the sampler
            plan.suggestion, plan.suggested_flags = _move_sampler(values, num_gpus, nodes, memory, dev, reserve)
            return plan
    if suggest and not plan.fits:
        plan.suggestion, plan.suggested_flags = _suggest(step, dict(values), num_gpus, nodes, memory, dev, reserve)
    return plan


# ------------------------------------------------------------------------------------------------ stages
def _dtype_bytes(dtype: str, dev: GPU) -> tuple[int, str]:
    if dtype == "fp32":
        return 4, "fp32"
    if dtype == "auto":
        return (4, "fp32") if dev.auto_dtype == "fp32" else (2, dev.auto_dtype)
    return 2, dtype


def _model(role: str, name: str, head: str, sharding: Sharding, *, lora_dim: int = 0, lora_modules: str = "all-linear",
           only_lora: bool = True, frozen: bool = False, whole_buckets: bool = True) -> ModelPlan:
    config, source = model_config(name)
    shape = shape_from_config(config, name)
    params = shape.params(head)
    adapters = lora_params(shape, lora_dim, lora_modules)
    largest = shape.largest_module_params(head)
    if frozen:
        gpu, cpu = frozen_weights(params, largest, sharding)
        states = ModelStates(gpu, 0, 0, 0, cpu)
        return ModelPlan(role, name, shape, head, params, 0, sharding, states, source)
    value_head = shape.hidden if head == "value" else 0
    trainable = adapters + value_head if adapters and only_lora else params + adapters
    states = model_states(params + adapters, trainable, largest, sharding)
    if sharding.stage == 3:  # allocated once with the optimizer; ZeRO-1/2 allocate it per backward (``_bucket``)
        states = dataclasses.replace(states, buckets=gradient_bucket_bytes(trainable, sharding, whole=whole_buckets))
    return ModelPlan(role, name, shape, head, params + adapters, trainable, sharding, states, source)


def _bucket(m: ModelPlan, whole: bool) -> list[tuple[str, str, int]]:
    """The gradient bucket ZeRO-1/2 allocate at each backward and free after the step (a train-phase item; the
    models of stage 3 train one after another, so their buckets never coexist)."""
    if m.sharding.stage not in (1, 2) or not m.trainable:
        return []
    return [(m.role, "gradient bucket", gradient_bucket_bytes(m.trainable, m.sharding, whole=whole))]


def _prefetch(m: ModelPlan) -> list[tuple[str, str, int]]:
    """ZeRO-3's prefetched parameters while ``m`` runs a forward or backward (a phase item)."""
    b = prefetch_bytes(m.params, m.shape.largest_module_params(m.head), m.sharding)
    return [(m.role, "ZeRO-3 prefetch", b)] if b else []


def _train_flops(m: ModelPlan, tokens: int, seq: int, checkpointing: bool) -> float:
    """FLOPs of a training pass over ``tokens`` tokens: 2P forward, 2P backward through the activations, 2P for
    the weight gradients (only the trainable ones), another 2P forward with checkpointing; attention adds
    ``2 L s q`` per token forward (causal: the average context is s/2)."""
    fwd = 2 * m.params + 2 * m.shape.layers * seq * m.shape.q_dim
    backward_weights = 2 * m.trainable
    backward_inputs = 2 * m.params + 4 * m.shape.layers * seq * m.shape.q_dim
    return tokens * (fwd * (2 if checkpointing else 1) + backward_inputs + backward_weights)


def _forward_flops(m: ModelPlan, tokens: int, seq: int) -> float:
    return tokens * (2 * m.params + 2 * m.shape.layers * seq * m.shape.q_dim)


def _steps(cfg: Any, rows: int | None, phase: int, rows_per_step: int) -> int | None:
    """Optimizer steps (stage 3: updates) of the run: --max-steps, else epochs over this phase's share of
    ``rows``; None when neither is known."""
    if cfg.optim.max_steps > 0:
        return int(cfg.optim.max_steps)
    if rows is None:
        return None
    weights = [float(w) for w in cfg.data.data_split.split(",")]
    share = weights[phase - 1] / sum(weights) if sum(weights) > 0 else 0.0
    return max(1, math.ceil(rows * share / rows_per_step)) * cfg.optim.num_train_epochs


def _one_model(cfg: Any, ranks: int, dev: GPU, rows: int | None, whole: bool, *, role: str, head: str,
               pair: bool) -> tuple[
        list[ModelPlan], list[Phase], Throughput, dict[str, Any]]:
    d, dname = _dtype_bytes(cfg.model.dtype, dev)
    z = Sharding(cfg.engine.zero_stage, ranks, cfg.engine.offload, d)
    lo = cfg.lora
    m = _model(role, cfg.model.model, head, z, lora_dim=lo.lora_dim, lora_modules=lo.lora_module_name,
               only_lora=lo.only_optimize_lora, whole_buckets=whole)
    b, s, gc = cfg.optim.per_device_train_batch_size, cfg.data.max_seq_len, cfg.model.gradient_checkpointing
    batch_rows = 2 * b if pair else b  # stage 2: chosen and rejected in one batch
    act = training_activations(m.shape, batch_rows, s, d, checkpointing=gc, head=head)
    train = Phase("train", [(role, "activations" + (" (checkpointed)" if gc else ""), act), *_bucket(m, whole),
                            *_prefetch(m)])
    models = [m]
    teacher = getattr(getattr(cfg, "kd", None), "teacher_model", "")
    flops_teacher = 0.0
    if teacher:
        t = _model("teacher", teacher, "lm", Sharding(cfg.engine.zero_stage, ranks, False, d), frozen=True)
        models.append(t)
        # its forward's working set comes and goes before the student's; its fp32 logits stay for the KL
        train.items.append(("teacher", "logits", batch_rows * s * t.shape.vocab * 4))
        flops_teacher = _forward_flops(t, batch_rows * s, s)
    accum = cfg.optim.gradient_accumulation_steps
    tokens = batch_rows * s * accum
    flops = _train_flops(m, tokens, s, gc) + flops_teacher * accum
    seconds = flops / (dev.flops * TRAIN_MFU)
    steps = _steps(cfg, rows, 1 if role == "model" else 2, b * accum * ranks)
    notes = [f"{TRAIN_MFU:.0%} MFU", f"every row padded to --max-seq-len {s}", f"{fmt_rate(dev.flops, 'FLOP/s')} peak"]
    tp = Throughput(flops, seconds, steps, {"train": seconds}, tokens, notes)
    settings = {"dtype": dname, "micro_batch": b, "seq_len": s, "gradient_checkpointing": gc,
                "zero_stage": z.stage, "offload": z.offload, "lora_dim": lo.lora_dim, "ranks": ranks}
    return models, [train], tp, settings


def _stage1(cfg: Any, ranks: int, dev: GPU, rows: int | None, whole: bool) -> Any:
    return _one_model(cfg, ranks, dev, rows, whole, role="model", head="lm", pair=False)


def _stage2(cfg: Any, ranks: int, dev: GPU, rows: int | None, whole: bool) -> Any:
    return _one_model(cfg, ranks, dev, rows, whole, role="reward model", head="value", pair=True)


def _stage3(cfg: Any, ranks: int, dev: GPU, rows: int | None, whole: bool) -> Any:
    from dschat.rewards.names import JUDGE, RM

    d, dname = _dtype_bytes(cfg.model.dtype, dev)
    needs = cfg.algorithm.needs(cfg)
    eng = cfg.engines
    actor_z = cfg.actor_engine.zero_stage
    critic_z = cfg.critic_engine.zero_stage
    if not cfg.actor.model:
        raise UserError("stage 3 needs --actor-model (a step-1 output)")
    al, cl = cfg.lora_of("actor"), cfg.lora_of("critic")
    actor = _model("actor", cfg.actor.model, "lm", Sharding(actor_z, ranks, eng.offload, d), lora_dim=al.lora_dim,
                   lora_modules=al.lora_module_name, only_lora=al.only_optimize_lora, whole_buckets=whole)
    models = [actor]
    uses_rm = RM in cfg.reward_func_names()
    critic = None
    if "critic" in needs:
        name = cfg.critic.model or cfg.rewards.reward_model
        if not name:
            raise UserError("PPO's critic starts from --critic-model or --reward-model; give one")
        critic = _model("critic", name, "value", Sharding(critic_z, ranks, eng.offload, d), lora_dim=cl.lora_dim,
                        lora_modules=cl.lora_module_name, only_lora=cl.only_optimize_lora, whole_buckets=whole)
        models.append(critic)
    ref = None
    if "reference" in needs:
        rz = eng.reference_zero_stage if eng.reference_zero_stage is not None else actor_z
        ref = _model("reference", cfg.actor.model, "lm", Sharding(rz, ranks, eng.offload_reference_model, d),
                     frozen=True)
        models.append(ref)
    reward = None
    if uses_rm:
        if not cfg.rewards.reward_model:
            raise UserError("reward function 'rm' needs --reward-model (a step-2 output)")
        wz = eng.reward_zero_stage if eng.reward_zero_stage is not None else critic_z
        reward = _model("reward", cfg.rewards.reward_model, "value", Sharding(wz, ranks, eng.offload_reward_model, d),
                        frozen=True)
        models.append(reward)

    judge = None
    if JUDGE in cfg.reward_func_names():  # a plain frozen module, a whole copy on every rank (rewards.judge)
        if not cfg.rewards.judge_model:
            raise UserError("reward function 'judge' needs --judge-model (a trained generative judge)")
        judge = _model("judge", cfg.rewards.judge_model, "lm", Sharding(0, ranks, False, d), frozen=True)
        models.append(judge)

    if eng.enable_ema:  # an fp32 average of each rank's share of the actor's weights (dschat.rlhf.ema)
        share = math.ceil(4 * actor.params / ranks)
        models.append(ModelPlan("actor EMA", cfg.actor.model, actor.shape, "lm", actor.params, 0,
                                Sharding(actor_z, ranks, False, 4), ModelStates(share, 0, 0, 0, 0), actor.source))

    rl, o = cfg.rl, cfg.optim
    algo, spec = rl.algo, cfg.algorithm
    # what one step samples, runs without gradient and trains on: the algorithm's spec answers (dschat.rlhf.specs)
    gen_rows = spec.generation_rows(cfg)
    generates = gen_rows > 0
    prompt, answer = cfg.data.max_prompt_seq_len, rl.max_answer_seq_len
    seq = prompt + answer
    b = o.per_device_train_batch_size
    phases: list[Phase] = []
    if generates:  # evaluations sample on the trainer with asynchronous rollouts too: the phase stays
        gen = Phase("generate")
        if actor.sharding.stage == 3 or actor.sharding.offload:
            gen.items.append(("actor", "weights gathered whole", actor.params * d - actor.states.weights))
        gen.items += generation_items(cfg, actor, dev, gen_rows, prompt, seq, d)
        phases.append(gen)
    by_role = {m.role: m for m in models}
    forwards = []
    for role, n in spec.experience_forwards(cfg):
        m = by_role.get(role)
        if m is None:
            continue
        if role == "judge":  # it generates its verdicts: a KV cache over the question, both answers and the verdict
            rows_j = min(n, JUDGE_BATCH)
            width = prompt + 2 * answer + cfg.rewards.judge_max_new_tokens
            forwards.append([(role, f"verdicts of {rows_j} rows", kv_cache_bytes(m.shape, rows_j, width, d) +
                              inference_activations(m.shape, rows_j, width, d, out_tokens=rows_j))])
            continue
        out = n * answer if m.head == "lm" else None
        forwards.append([(role, f"forward of {n} rows",
                          inference_activations(m.shape, n, seq, d, out_tokens=out, head=m.head)), *_prefetch(m)])
    if forwards:  # one after another: the largest counts
        phases.append(Phase("experience", max(forwards, key=lambda items: sum(b for _, _, b in items))))
    train_rows = spec.train_rows(cfg)
    agc = cfg.actor.gradient_checkpointing
    phases.append(Phase("train actor", [("actor", "activations" + (" (checkpointed)" if agc else ""),
                                         training_activations(actor.shape, train_rows, seq, d, checkpointing=agc,
                                                              loss_tokens=train_rows * answer)),
                                        *_bucket(actor, whole), *_prefetch(actor)]))
    cgc = cfg.critic.gradient_checkpointing
    if critic is not None:
        phases.append(Phase("train critic", [("critic", "activations" + (" (checkpointed)" if cgc else ""),
                                              training_activations(critic.shape, train_rows, seq, d,
                                                                   checkpointing=cgc, head="value")),
                                             *_bucket(critic, whole), *_prefetch(critic)]))

    # time of one update per GPU
    _, micro = cfg.algorithm.plan(cfg, 1)
    rows_trained = micro * train_rows  # the update's micro-batches
    parts: dict[str, float] = {}
    notes = [f"{TRAIN_MFU:.0%} MFU in training", f"{FORWARD_MFU:.0%} in forwards and prefill",
             f"decoding at {DECODE_BANDWIDTH:.0%} of {fmt_rate(dev.bandwidth, 'B/s')} (weights + KV cache read per "
             f"token)", f"every answer {answer} tokens long"]
    batches = cfg.ppo.generation_batches if algo == "ppo" else 1
    if generates:
        parts["generate"] = batches * generation_seconds(actor, gen_rows, prompt, answer, d, dev)
    if generates:
        fwd = sum(_forward_flops(by_role[r], n * seq, seq) for r, n in spec.experience_forwards(cfg) if r in by_role)
    else:  # offline pairs: the reference's log-probs, computed once per pair (the evaluation's forwards aside)
        fwd = _forward_flops(ref, rows_trained * seq, seq) if ref is not None else 0.0
        batches = 1
    parts["experience"] = batches * fwd / (dev.flops * FORWARD_MFU)
    train = _train_flops(actor, int(rows_trained * seq), seq, agc)
    if critic is not None:
        train += _train_flops(critic, int(rows_trained * seq), seq, cgc)
    parts["train"] = train / (dev.flops * TRAIN_MFU)
    seconds = sum(parts.values())
    flops = train + fwd * batches
    prompts_per_update = spec.batch_size(cfg) * batches * ranks  # dataset rows: prompts, or DPO's pairs
    steps = _steps(cfg, rows, 3, prompts_per_update)
    tokens = batches * gen_rows * seq if generates else rows_trained * seq
    tp = Throughput(flops, seconds, steps, parts, int(tokens), notes)
    if cfg.rollouts.enabled and generates:
        tp.rollouts = _rollouts(cfg, actor, dev, ranks, gen_rows, batches, parts, seconds)
    settings = {"dtype": dname, "micro_batch": b, "seq_len": seq, "algo": algo, "generation_rows": gen_rows,
                "sampled_per_prompt": spec.sampled_per_prompt(cfg),
                "prompt_len": prompt, "answer_len": answer, "actor_zero_stage": actor_z, "critic_zero_stage": critic_z,
                "offload": eng.offload, "ranks": ranks}
    return models, phases, tp, settings


def samples_through_graphs(cfg: Any, actor: ModelPlan, dev: GPU, *, sampler: bool = False) -> bool:
    """Whether stage 3's actor samples through captured CUDA graphs (docs/generation.md): ``--generation-backend
    graph``, or ``auto`` for a Llama-architecture actor without LoRA; never on a CPU or with DeepSpeed's hybrid
    engine. The plan does not model vLLM, which ``auto`` takes where it is installed. ``sampler``: a sampler's
    copy (``dschat sampler``: the plain model with LoRA merged, no hybrid engine)."""
    name = cfg.rl.generation_backend
    if dev.host or (cfg.rl.enable_hybrid_engine and not sampler):
        return False
    if name == "graph":
        return True
    return (name == "auto" and actor.shape.model_type in GRAPH_MODEL_TYPES
            and (sampler or not cfg.lora_of("actor").lora_dim))


def samples_through_lean(cfg: Any, actor: ModelPlan, dev: GPU, *, sampler: bool = False) -> bool:
    """Whether stage 3's actor samples through dschat's own decoder on a GPU (the graph step, or
    ``--generation-backend dschat`` or ``compiled`` for a Llama-architecture actor), which stacks each layer's
    q/k/v and gate/up weights for the call."""
    if dev.host or (cfg.rl.enable_hybrid_engine and not sampler) or actor.shape.model_type not in GRAPH_MODEL_TYPES:
        return False
    return samples_through_graphs(cfg, actor, dev, sampler=sampler) or \
        cfg.rl.generation_backend in ("dschat", "compiled")


def generation_items(cfg: Any, actor: ModelPlan, dev: GPU, rows: int, prompt: int, seq: int, d: int, *,
                     sampler: bool = False) -> list[tuple[str, str, int]]:
    """A generation call's transient bytes over ``rows`` rows beside the weights: the decoder's stacked weights,
    the KV cache (or the CUDA-graph capture), the prefill's working set."""
    items: list[tuple[str, str, int]] = []
    if samples_through_lean(cfg, actor, dev, sampler=sampler) and \
            (stacked := stacked_weight_bytes(actor.shape, d)) <= FUSE_COPY_BYTES:
        items.append(("actor", "q/k/v and gate/up weights stacked", stacked))
    if samples_through_graphs(cfg, actor, dev, sampler=sampler):
        items += graph_captures(actor.shape, rows, seq, d)
    else:
        items.append(("actor", f"KV cache {rows} x {seq} tokens", kv_cache_bytes(actor.shape, rows, seq, d)))
    items.append(("actor", "prefill", inference_activations(actor.shape, rows, prompt, d, out_tokens=rows)))
    return items


def generation_seconds(actor: ModelPlan, rows: int, prompt: int, answer: int, d: int, dev: GPU) -> float:
    """One generation call of ``rows`` rows on ``dev``: the prefill at ``FORWARD_MFU``, then ``answer`` decode
    steps, each reading the weights and the KV cache (its mean over the answer) at ``DECODE_BANDWIDTH`` of the
    device's bandwidth, or compute-bound where that is slower."""
    prefill = _forward_flops(actor, rows * prompt, prompt) / (dev.flops * FORWARD_MFU)
    kv_mean = kv_cache_bytes(actor.shape, rows, prompt + answer // 2, d)
    step_bytes = actor.params * d + kv_mean
    step_flops = _forward_flops(actor, rows, prompt + answer // 2)
    decode = answer * max(step_bytes / (dev.bandwidth * DECODE_BANDWIDTH), step_flops / (dev.flops * FORWARD_MFU))
    return prefill + decode


def _rollouts(cfg: Any, actor: ModelPlan, dev: GPU, ranks: int, gen_rows: int, calls: int, parts: dict[str, float],
              without: float) -> RolloutsPlan:
    """Asynchronous rollouts (``dschat.planning.rollouts``): the sampler's device and memory, each side's seconds
    per update from this plan's model, the weight update, and the split of the ``ranks`` devices. ``make_plan``
    settles what needs the trainer's peak (``RolloutsPlan.settle``: a shared GPU, where the update is staged)."""
    from dschat.rlhf.config import check_async, sampler_devices

    check_async(cfg)
    a = cfg.rollouts
    notes: list[str] = []
    index = None
    if a.sampler:  # started apart: its device is not in the flags
        where, sdev = f"at {a.sampler}", dev
        notes.append(f"a sampler started apart on one {dev.name}")
    else:
        device, _ = sampler_devices(a.sampler_devices)
        where = f"on {a.sampler_devices}"
        if device == "cpu":
            sdev = GPUS["cpu"]
        else:
            index = int(device.partition(":")[2])
            sdev = GPUS[DEFAULT_GPU.lower()] if dev.host else dev
            if dev.host:
                notes.append(f"{device} planned as the default {sdev.name}")
    sd, sname = _dtype_bytes(cfg.model.dtype, sdev)
    merged = actor.shape.params("lm")  # the sampler's copy: LoRA merged
    copy = dataclasses.replace(actor, params=merged)
    prompt, answer = cfg.data.max_prompt_seq_len, cfg.rl.max_answer_seq_len
    rows = gen_rows * ranks  # one request holds every training rank's rows
    items = [("actor weights whole", merged * sd)]
    lo = cfg.lora_of("actor")
    if lo.lora_dim > 0:  # ModuleReceiver keeps each adapted layer's base beside its merge, and the adapters in fp32
        base = actor.shape.layers * sum(i * o for i, o in (LORA_TARGETS[t](actor.shape) for t in
                                                           lora_targets(actor.shape, lo.lora_module_name)))
        items += [("LoRA base weights kept", base * sd), ("LoRA adapters (fp32)", (actor.params - merged) * 4)]
    transient = [(w, b) for _, w, b in generation_items(cfg, copy, sdev, rows, prompt, prompt + answer, sd,
                                                        sampler=True)]
    items += transient + sdev.reserve_items(1)
    if not sdev.host:
        items.append(("allocator", math.ceil(ALLOCATOR_SLACK * sum(b for _, b in transient))))
    d = _dtype_bytes(cfg.model.dtype, dev)[0]  # the trainer's weights, as the update carries them
    update = weight_update(cfg, actor, d, dev, sdev)
    experience, train = parts["experience"], parts["train"]
    # s devices of the run's kind, each sampling its share of the rows (CPU ranks share the host's cores: none)
    split = [] if dev.host else \
        [calls * generation_seconds(copy, -(-rows // s), prompt, answer, d, dev) for s in range(1, ranks)]
    plan = RolloutsPlan(where, sdev.name, sname, a.max_staleness, rows, calls,
                        calls * generation_seconds(copy, rows, prompt, answer, sd, sdev), experience, train,
                        update, without, items, sdev.memory, ranks, device_index=index, split_generate=split,
                        notes=notes)
    if index is None and not a.sampler and dev.host:
        plan.shares = "the host's cores with the training ranks"
    plan.notes.append("ZeRO-3's gathers for the update and the probe's forward not counted")
    return plan


def weight_update(cfg: Any, actor: ModelPlan, d: int, dev: GPU, sdev: GPU) -> WeightUpdate:
    """The weight update on the weight plane (``dschat.planning.rollouts.WeightUpdate``): the first carries every
    weight (with LoRA the base weights and the adapters, ``actor.params``), each later one what trains
    (``actor.trainable``: the adapters alone under ``--actor-only-optimize-lora``); the buckets and their capacity
    from the first update's tensors (``update_tensors``), in the trainer's dtype (``d`` bytes). The weight group is
    NCCL where the trainer (on ``dev``) and the sampler (on ``sdev``) are on GPUs (``RolloutsPlan.settle`` makes a
    shared GPU gloo)."""
    lo = cfg.lora_of("actor")
    buckets, capacity = pack_buckets(update_tensors(actor.shape, d, lo.lora_dim, lo.lora_module_name))
    return WeightUpdate(actor.params * d, actor.trainable * d, capacity, buckets, dev.bandwidth, sdev.bandwidth,
                        trainer_gpu=not dev.host, sampler_gpu=not sdev.host, streaming=cfg.rollouts.max_staleness == 0,
                        choice=cfg.rollouts.weight_staging, nccl=not dev.host and not sdev.host)


def lora_targets(shape: ModelShape, modules: str = "all-linear") -> list[str]:
    """The block projections that get adapters, as ``memory.lora_params`` selects them (``all-linear``: every
    attention and MLP projection, never the LM head or the embeddings; else those whose family name holds one of the
    comma-separated substrings, all of them where none does): ``LORA_TARGETS`` keys, whose ``(in, out)`` give
    ``r (in + out)`` adapter parameters per layer each."""
    names = LORA_NAMES.get(shape.model_type, {k: k for k in LORA_TARGETS})
    targets = [t for t in LORA_TARGETS if t in names and (shape.gated or t != "gate_proj")]
    wanted = [w.strip() for w in modules.split(",") if w.strip()]
    if modules != "all-linear" and any(any(w in names[t] for t in targets) for w in wanted):
        targets = [t for t in targets if any(w in names[t] for w in wanted)]
    return targets


def update_tensors(shape: ModelShape, d: int, lora_dim: int = 0, lora_modules: str = "all-linear") -> list[int]:
    """The first weight update's tensors, bytes each, in the order the sender walks them
    (``weight_plane.sources``): with LoRA every adapted projection first (its base weight, its bias, ``lora_A``
    ``r x in``, ``lora_B`` ``out x r``), then every other parameter in the Llama layout's order (the embeddings, each
    block's projections, biases and norms, the final norm, an untied LM head). Other families order a block's
    tensors differently and GPT-2 holds q, k and v in one matrix: the bytes are the same, the grouping of the
    small tensors into buckets (so their count) approximate."""
    h, width = shape.hidden, shape.embed_proj or shape.hidden
    biased = {"q_proj", "k_proj", "v_proj"} if shape.attn_bias == "qkv" else \
        {"q_proj", "k_proj", "v_proj", "o_proj"} if shape.attn_bias == "all" else set()
    if shape.mlp_bias:
        biased |= {"gate_proj", "up_proj", "down_proj"}
    adapted = set(lora_targets(shape, lora_modules)) if lora_dim > 0 else set()
    norm = h * (2 if shape.layernorm_bias else 1)
    front: list[int] = []
    rest = [shape.vocab * width] + ([shape.positions * h] if shape.positions else []) + \
        ([shape.embed_proj * h] * 2 if shape.embed_proj else [])
    for _ in range(shape.layers):
        for t, dims in LORA_TARGETS.items():
            if t == "gate_proj" and not shape.gated:
                continue
            i, o = dims(shape)
            own = [i * o] + ([o] if t in biased else [])
            if t in adapted:
                front += own + [lora_dim * i, o * lora_dim]
            else:
                rest += own
        rest += [norm] * shape.norms_per_layer
    rest += ([norm] if shape.final_norm else []) + ([shape.vocab * width] if not shape.tied else [])
    return [n * d for n in front + rest]


def graph_captures(shape: ModelShape, gen_rows: int, seq: int, d: int) -> list[tuple[str, str, int]]:
    """The capture a generation call holds (the hybrid engine releases it when the call's generate phase ends,
    before scoring and training, so the largest call's is the phase's): its KV cache, rows and width rounded up to
    the buckets, and its token step's working set (one layer's tensors, the attention scores over the whole width
    in fp32, the logits), which the graph's memory pool keeps."""
    rows, width = _bucket_up(gen_rows, GRAPH_BATCH_BUCKET), _bucket_up(seq, GRAPH_WIDTH_BUCKET)
    step = inference_activations(shape, rows, 1, d, out_tokens=rows) + 2 * rows * shape.heads * width * 4
    return [("actor", f"KV cache {rows} x {width} tokens", kv_cache_bytes(shape, rows, width, d)),
            ("actor", "CUDA-graph token step", step)]


def stacked_weight_bytes(shape: ModelShape, d: int) -> int:
    """The decoder's stacked copy of every layer's q/k/v and gate/up weights (``lean_llama._Stacked``), which the
    CUDA decode path reads for the generation call and frees with its decoders."""
    per_layer = shape.hidden * (shape.q_dim + 2 * shape.kv_dim + 2 * shape.intermediate)
    return shape.layers * per_layer * d


def _bucket_up(n: int, size: int) -> int:
    return -(-n // size) * size


# ------------------------------------------------------------------------------------------------ suggestion
KNOBS = {  # what the suggestion may change, per stage: flag names
    1: {"gc": ("gradient_checkpointing",), "zero": ("zero_stage",), "lora": ("lora_dim",)},
    2: {"gc": ("gradient_checkpointing",), "zero": ("zero_stage",), "lora": ("lora_dim",)},
    3: {"gc": ("actor_gradient_checkpointing", "critic_gradient_checkpointing"),
        "zero": ("actor_zero_stage", "critic_zero_stage"), "lora": ("actor_lora_dim", "critic_lora_dim")},
}


def _suggest(step: int, values: dict[str, Any], num_gpus: int, nodes: int, memory: int, dev: GPU,
             reserve: int) -> tuple[str | None, dict[str, Any]]:
    """The cheapest change that fits, trying in order: gradient checkpointing, a smaller micro-batch, a higher
    ZeRO stage, optimizer offload, LoRA, more GPUs; each alone first, then accumulated in that order."""
    cls = config_class(step)
    from dschat.config import build_config, to_flat_dict

    base = {k: v for k, v in to_flat_dict(build_config(cls, values)).items()}
    knobs = KNOBS[step]

    def fits(change: dict[str, Any], gpus: int = num_gpus, n: int = nodes) -> bool:
        try:
            plan = make_plan(step, {**values, **change}, num_gpus=gpus, nodes=n, gpu_memory=memory, gpu=dev.name,
                             reserve_bytes=reserve, suggest=False)
        except UserError:
            return False
        return plan.fits

    def options(acc: dict[str, Any]) -> list[tuple[str, list[dict[str, Any]]]]:
        cur = {**base, **acc}
        out: list[tuple[str, list[dict[str, Any]]]] = []
        if not all(cur[k] for k in knobs["gc"]):
            out.append(("gc", [{k: True for k in knobs["gc"]}]))
        b = int(cur["per_device_train_batch_size"])
        sizes = []
        while b > 1:
            b //= 2
            sizes.append(b)
        if sizes:  # the largest micro-batch that fits; keep the global batch with gradient accumulation
            ratio = int(cur["per_device_train_batch_size"])
            out.append(("batch", [{"per_device_train_batch_size": s, "gradient_accumulation_steps":
                                   int(cur["gradient_accumulation_steps"]) * (ratio // s)} for s in sizes]))
        z = max(int(cur[k]) for k in knobs["zero"])
        if z < 3:
            out.append(("zero", [{k: s for k in knobs["zero"]} for s in range(z + 1, 4)]))
        if not cur["offload"]:
            out.append(("offload", [{"offload": True, **({k: max(1, int(cur[k])) for k in knobs["zero"]})}]))
        if not all(int(cur[k]) for k in knobs["lora"]):
            out.append(("lora", [{k: SUGGESTED_LORA_DIM for k in knobs["lora"]}]))
        return out

    # one change alone, in order of cost
    for _, candidates in options({}):
        for change in candidates:
            if fits(change):
                return _describe(change, base), change
    # accumulated
    acc: dict[str, Any] = {}
    for kind in ("gc", "batch", "zero", "offload", "lora"):
        step_options = dict(options(acc))
        if kind in step_options:
            acc.update(step_options[kind][-1])
            if fits(acc):
                return _describe(acc, base), acc
    # more GPUs: per node up to 8, then nodes
    for change in ({}, acc):
        for gpus, n in [(g, nodes) for g in (2, 4, 8) if g > num_gpus] + [(max(num_gpus, MAX_GPUS_PER_NODE), k)
                                                                           for k in (2, 4, 8, 16, 32, MAX_NODES)
                                                                           if k > nodes]:
            if fits(change, gpus, n):
                flags = {**change, "num_gpus": gpus, "nodes": n}
                return _describe(flags, base), flags
    return ("nothing tried fits (gradient checkpointing, micro-batch 1, ZeRO-3, offload, LoRA, up to "
            f"{MAX_NODES} nodes of {MAX_GPUS_PER_NODE} GPUs); use larger GPUs or a smaller model"), {}


def _move_sampler(values: dict[str, Any], num_gpus: int, nodes: int, memory: int, dev: GPU,
                  reserve: int) -> tuple[str, dict[str, Any]]:
    """A sampler on a training rank's GPU that does not fit beside it: the next GPU of the node, else one GPU
    taken from the training ranks, else the CPU (the first of them that fits)."""
    options: list[dict[str, Any]] = []
    if num_gpus < MAX_GPUS_PER_NODE:
        options.append({"sampler_devices": f"cuda:{num_gpus}"})
    if num_gpus > 1:
        options.append({"num_gpus": num_gpus - 1, "sampler_devices": f"cuda:{num_gpus - 1}"})
    options.append({"sampler_devices": "cpu"})
    for change in options:
        flags = {k: v for k, v in change.items() if k != "num_gpus"}
        try:
            plan = make_plan(3, {**values, **flags}, num_gpus=change.get("num_gpus", num_gpus), nodes=nodes,
                             gpu_memory=memory, gpu=dev.name, reserve_bytes=reserve, suggest=False)
        except UserError:
            continue
        if plan.fits:
            return _describe(change, {}) + " (a device of its own for the sampler)", change
    own = options[0] if "num_gpus" not in options[0] else {"sampler_devices": "cpu"}
    text, flags = _suggest(3, {**values, **own}, num_gpus, nodes, memory, dev, reserve)
    if not flags:
        return text, {}
    from dschat.config import build_config, to_flat_dict

    change = {**own, **flags}
    return _describe(change, to_flat_dict(build_config(config_class(3), values))), change


def _describe(change: dict[str, Any], base: dict[str, Any]) -> str:
    parts = []
    for k, v in change.items():
        if k in base and base[k] == v:
            continue
        flag = "--" + k.replace("_", "-")
        parts.append(flag if v is True else f"{flag} {v}")
    return "add " + " ".join(parts) if parts else "nothing to change"


# ------------------------------------------------------------------------------------------------ formatting
def _count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def _secs(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    if s >= 60:
        return f"{s / 60:.1f} min"
    return f"{s:.2f} s" if s >= 0.01 else f"{s * 1000:.2f} ms"


def _grid(head: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows]
