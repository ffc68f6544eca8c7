"""The one module that talks to DeepSpeed and ``torch.distributed``.

Everything distributed goes through here: process-group set-up (gloo on CPU; NCCL for CUDA tensors with gloo
beside it for CPU ones on CUDA; a single process needs no launcher), DeepSpeed configs, training and inference
engines, ZeRO-3 parameter gathering, collective helpers and rank queries. Other modules call these functions and
never import deepspeed or ``torch.distributed`` themselves.

Collectives and devices: NCCL serves CUDA tensors only, and the library reduces small CPU tensors (row counts,
metric sums) and exchanges Python objects. So on CUDA the world group is made with two backends, gloo for CPU
tensors and NCCL for CUDA ones (``cpu:gloo,cuda:nccl``). Where the group was made by someone else without a CPU
backend (a launcher or library that initialised NCCL alone), ``setup_distributed`` adds a gloo group over the same
ranks, and every helper here sends CPU tensors and objects through it (``_group_for``).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.constants import default_pg_timeout
from deepspeed.runtime.hybrid_engine import DeepSpeedHybridEngine

from dschat.config import EngineArgs, OptimArgs
from dschat.devices import prefer_attention_kernels
from dschat.errors import UserError
from dschat.utils import unwrap  # noqa: F401  (E.unwrap, the engine helpers' name for it)

deepspeed.utils.logger.setLevel(logging.WARNING)


# --------------------------------------------------------------------------------------------- process group
def setup_distributed() -> None:
    """Join (or create) the process group. Without a launcher this is a world of one on a free local port."""
    global _CPU_GROUP
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank())  # before any group: NCCL binds to the current device
    if not (dist.is_available() and dist.is_initialized()):
        backend = process_group_backend()
        # Under a launcher all four are set. A bare WORLD_SIZE alone (e.g. inherited from a parent process that
        # set up its own world of one) must not send DeepSpeed looking for MPI.
        if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
            # No launcher: a world of one. An in-memory store needs no port, so concurrent runs cannot collide.
            for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
                os.environ[key] = value
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group(backend=backend, init_method="env://", timeout=default_pg_timeout)
    if _CPU_GROUP is None and not serves_cpu():
        _CPU_GROUP = dist.new_group(backend="gloo")  # every rank calls this, in the same order
    with _without_shm_comm_op():
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo", verbose=False)
    prefer_attention_kernels()


def process_group_backend(cuda: bool | None = None) -> str:
    """The backend dschat creates its world group with: gloo on a CPU machine; on CUDA, NCCL for CUDA tensors and
    gloo for CPU ones, so the library's CPU counts and Python objects have a backend that serves them."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def serves_cpu(group: Any = None) -> bool:
    """Whether ``group`` (default: the world) has a backend for CPU tensors (gloo, or a ``cpu:...`` entry)."""
    return backend_serves_cpu(str(dist.get_backend_config(group)))


def backend_serves_cpu(config: str) -> bool:
    """Whether a backend configuration (``gloo``, ``nccl``, ``cpu:gloo,cuda:nccl``, ...) has a backend for CPU."""
    if ":" not in config:  # a bare name: gloo and mpi serve the CPU; nccl and other accelerator backends do not
        return config in ("gloo", "mpi")
    return any(part.split(":")[0].strip() == "cpu" for part in config.split(","))


# A gloo group over the world's ranks, made only where the world group has no CPU backend (``setup_distributed``).
_CPU_GROUP: Any = None


def _group_for(t: torch.Tensor | None, group: Any = None) -> Any:
    """The group a collective over ``t`` (``None``: Python objects, barriers) runs on: ``group``, except that CPU
    tensors, objects and barriers on the world group go to the CPU group where the world has no CPU backend."""
    if _CPU_GROUP is not None and (t is None or t.device.type == "cpu") and group in (None, dist.group.WORLD):
        return _CPU_GROUP
    return group


@contextlib.contextmanager
def _without_shm_comm_op() -> Iterator[None]:
    """DeepSpeed's communication wrapper JIT-compiles its CPU shared-memory all-reduce op
    (``deepspeed_shm_comm``: about a minute of two cores, once per ``TORCH_EXTENSIONS_DIR``) whenever it is
    created on a CPU machine, for any world size. That op serves only ``inference_all_reduce``, the all-reduce of
    DeepSpeed-Inference's tensor parallelism (AutoTP), which dschat never calls; training collectives (ZeRO
    gathers, gradient all-reduce) and ours go through ``torch.distributed`` (gloo) either way, and a world of one
    communicates nothing. So the wrapper is created without it: same results, no compiler at start-up. On CUDA
    DeepSpeed has no such op, and this changes nothing."""
    # By module name: the attribute ``deepspeed.comm.torch`` is PyTorch itself (deepspeed.comm imports torch).
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    build = getattr(ds_torch, "build_shm_op", None)
    if build is None:  # another DeepSpeed layout: leave it alone
        yield
        return
    ds_torch.build_shm_op = lambda: None
    try:
        yield
    finally:
        ds_torch.build_shm_op = build


def teardown_distributed() -> None:
    """End a launched run's process group together: every rank waits for the others, then the group is destroyed
    (its communication threads joined) before the interpreter exits. Left to interpreter exit, a rank whose peers
    had already gone could abort in the gloo threads' teardown ("terminate called without an active exception").
    A world of one keeps its group, so in-process callers can run several stages."""
    global _CPU_GROUP
    if is_distributed() and world_size() > 1:  # (a vLLM engine's shutdown may have destroyed it already)
        dist.barrier(group=_group_for(None))
        dist.destroy_process_group()
        _CPU_GROUP = None


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if is_distributed() and world_size() > 1:
        dist.barrier(group=_group_for(None))


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks (returns a new tensor on ``t``'s device; the input is untouched)."""
    return _all_reduce(t, dist.ReduceOp.SUM)


def _all_reduce(t: torch.Tensor, op: Any) -> torch.Tensor:
    out = t.detach().clone()
    if is_distributed() and world_size() > 1:
        dist.all_reduce(out, op=op, group=_group_for(out))
    return out


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    return all_reduce_sum(t) / world_size()


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """The element-wise largest over ranks (a new tensor on ``t``'s device)."""
    return _all_reduce(t, dist.ReduceOp.MAX)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Send a picklable object from ``src`` to every rank."""
    if not (is_distributed() and world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_group_for(None))
    return box[0]


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not (is_distributed() and world_size() > 1):
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj, group=_group_for(None))
    return out


class WeightGroup:
    """A process group of its own that carries weight updates between separate jobs: the trainer's first rank
    (rank 0, the only sender) and every sampler rank (``dschat.generation.weight_plane``). Each job's own world
    group is untouched, and only weights cross: the requests, answers and verdicts go over each sampler's control
    channel (``dschat.generation.channel``).

    Members find each other through a TCP store the trainer hosts (``WeightStore``), under a random ``prefix`` that
    only the control channel, which authenticates both ends, carries. NCCL where every member has a GPU of its own
    (``nccl``), else gloo on CPU tensors. Every wait ends within ``timeout_s``: gloo's own waits time out, a peer
    gone fails them at once; NCCL's are polled up to the deadline and its communicator aborted past it, built
    without the watchdog's error handling, so a dead or hung peer raises ``WeightGroupError`` in this process
    instead of the watchdog killing it."""

    def __init__(self, store: Any, prefix: str, rank: int, size: int, timeout_s: float, nccl: bool = False,
                 host: str | None = None):
        from datetime import timedelta

        self.rank, self.size, self.timeout_s, self.nccl = rank, size, timeout_s, nccl
        scoped = dist.PrefixStore(f"dschat-weights/{prefix}", store)
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        try:
            if nccl:
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timedelta(seconds=timeout_s)
                # no watchdog teardown, and a communicator set up without blocking: every wait is polled
                with _environ(TORCH_NCCL_ASYNC_ERROR_HANDLING="0", TORCH_NCCL_BLOCKING_WAIT="0",
                              TORCH_NCCL_USE_COMM_NONBLOCKING="1"):
                    self.group: Any = dist.ProcessGroupNCCL(scoped, rank, size, opts)
            else:
                opts = dist.ProcessGroupGloo._Options()
                opts._timeout = timedelta(seconds=timeout_s)
                # on the interface ``host`` names (the control channel's), not whatever the hostname resolves to
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host) if host else
                                 dist.ProcessGroupGloo.create_default_device()]
                self.group = dist.ProcessGroupGloo(scoped, rank, size, opts)
        except RuntimeError as e:
            raise WeightGroupError(f"the weight group did not form within {timeout_s:g} s: {_first(e)}") from None
        if nccl:  # NCCL sets its communicator up at the first collective: here, where the wait is polled
            self.broadcast(torch.zeros(1, device=self.device))

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (on ``device``; the same shape and dtype on every member) from rank 0 to every member, in place;
        landed when this returns. ``WeightGroupError`` when a member is gone or hung."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        try:
            work = self.group.broadcast([t], opts)
            if self.nccl:  # poll: a blocking wait would leave the timeout to the watchdog
                import time

                deadline = time.monotonic() + self.timeout_s
                while not work.is_completed():
                    if time.monotonic() > deadline:
                        self.abort()
                        raise WeightGroupError(f"a weight transfer did not finish within {self.timeout_s:g} s")
                    time.sleep(0.0005)
                work.wait()
                torch.cuda.current_stream().synchronize()
            else:
                work.wait()
        except RuntimeError as e:
            raise WeightGroupError(f"a weight transfer failed: {_first(e)}") from None
        return t

    def abort(self) -> None:
        """End the communicator now (NCCL: its kernels return; the group is unusable after)."""
        abort = getattr(self.group, "abort", None)
        if abort is not None:
            try:
                abort()
            except RuntimeError:
                pass


class WeightGroupError(RuntimeError):
    """A weight transfer failed: a member of the weight group is gone or hung."""


class WeightStore:
    """The TCP store weight groups meet at, hosted by the trainer's first rank at exactly ``host`` (a free port),
    never on every interface; its clients (samplers) connect with ``client``."""

    def __init__(self, host: str, timeout_s: float):
        from datetime import timedelta

        from dschat.utils import listen_at

        self.sock = listen_at(host, 0)
        self.host, self.port = host, int(self.sock.getsockname()[1])
        self.store = dist.TCPStore(host, self.port, None, True, timedelta(seconds=timeout_s), wait_for_workers=False,
                                   master_listen_fd=self.sock.fileno(), use_libuv=True)

    @staticmethod
    def client(host: str, port: int, timeout_s: float) -> Any:
        from datetime import timedelta

        try:
            return dist.TCPStore(host, port, None, False, timedelta(seconds=timeout_s))
        except (RuntimeError, OSError) as e:
            raise WeightGroupError(f"the trainer's weight store at {host}:{port} did not answer: {_first(e)}") \
                from None


def _first(e: BaseException) -> str:
    """An error of torch.distributed's in one line, without the C++ source location gloo puts first."""
    import re

    from dschat.errors import first_line

    return first_line(re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", str(e).strip()) or type(e).__name__)


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    """Environment variables set for the block (read by a constructor), restored after."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank (every rank gets the same answer): a decision that chooses a collective
    path is taken once for all ranks, so one rank that sees otherwise cannot leave the others waiting."""
    if not (is_distributed() and world_size() > 1):
        return flag
    return bool(all_reduce_max(torch.tensor(int(flag))).item())


def gpu_identity() -> str:
    """This process's current GPU, the same string in every process that uses it (its UUID where torch reads one)."""
    import socket

    index = torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return str(uuid) if uuid is not None else f"{socket.gethostname()}:{index}"


@contextlib.contextmanager
def main_process_first() -> Iterator[None]:
    """The first rank of each node runs the block first (e.g. to build a cache, node-local or shared); the
    others run it after, reading what it wrote. Every rank passes exactly one barrier."""
    first = local_rank() == 0
    if not first:
        barrier()
    yield
    if first:
        barrier()


# ------------------------------------------------------------------------------------------------ configs
def ds_config(*, micro_batch: int, grad_accum: int, zero_stage: int, offload: bool, dtype: torch.dtype,
              max_grad_norm: float = 0.0, optim: OptimArgs | None = None, lr: float | None = None,
              inference: bool = False) -> dict[str, Any]:
    """A DeepSpeed config for one model. ``inference`` builds a frozen (eval-only) engine: no optimizer."""
    if zero_stage not in (0, 1, 2, 3):
        raise UserError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero_stage}")
    zero: dict[str, Any] = {"stage": zero_stage}
    if zero_stage == 3:
        zero.update({
            "stage3_param_persistence_threshold": 1e4,
            "stage3_max_live_parameters": 3e7,
            "stage3_prefetch_bucket_size": 3e7,
            "stage3_gather_16bit_weights_on_model_save": True,
        })
        if offload:
            zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if offload and not inference and zero_stage > 0:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch * grad_accum * world_size(),
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if dtype == torch.bfloat16:
        cfg["bf16"] = {"enabled": True}
    elif dtype == torch.float16:
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 100}
    if not inference:
        if max_grad_norm > 0:
            cfg["gradient_clipping"] = max_grad_norm
        if optim is not None:
            params: dict[str, Any] = {
                "lr": lr if lr is not None else optim.learning_rate,
                "betas": [optim.adam_beta1, optim.adam_beta2],
                "eps": 1e-8,
                "weight_decay": optim.weight_decay,
            }
            # torch's AdamW needs no JIT-compiled op; ZeRO-Offload requires DeepSpeed's CPU Adam.
            if not (offload and zero_stage > 0):
                params["torch_adam"] = True
                params["adam_w_mode"] = True
                # torch's fused kernel: one pass over each parameter where the default on a CPU is a dozen
                # element-wise ops per tensor, so a markedly faster step (the same update to float rounding);
                # CPU and CUDA have it
                if device().type in ("cpu", "cuda"):
                    params["fused"] = True
            cfg["optimizer"] = {"type": "AdamW", "params": params}
    return cfg


def optimizer_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: no decay on biases and normalisation weights (1-D parameters)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def lr_lambda(total_steps: int, warmup_steps: int, kind: str) -> Any:
    """Multiplier of the peak learning rate at each optimizer step: linear warmup, then cosine/linear/constant."""

    def f(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if kind == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def warmup_steps_for(optim: OptimArgs, total_steps: int) -> int:
    if optim.num_warmup_steps is not None:
        return optim.num_warmup_steps
    return int(round(optim.warmup_ratio * total_steps))


# ------------------------------------------------------------------------------------------------ engines
Engine = Any  # deepspeed.DeepSpeedEngine; kept opaque so callers need not import deepspeed


def build_train_engine(model: torch.nn.Module, *, engine: EngineArgs, optim: OptimArgs, dtype: torch.dtype,
                       total_steps: int, lr: float | None = None, micro_batch: int | None = None,
                       grad_accum: int | None = None, hybrid_engine: dict[str, Any] | None = None,
                       param_groups: list[dict[str, Any]] | None = None) -> Engine:
    """A trainable DeepSpeed engine: AdamW (weight decay split), warmup + schedule, clipping, accumulation.

    ``param_groups`` replaces the default ``optimizer_groups(model, weight_decay)``, e.g.
    ``dschat.models.lora.lora_param_groups`` for a separate LoRA learning rate (a group's ``lr`` overrides ``lr``).
    """
    config = ds_config(micro_batch=micro_batch or optim.per_device_train_batch_size,
                       grad_accum=grad_accum or optim.gradient_accumulation_steps,
                       zero_stage=engine.zero_stage, offload=engine.offload, dtype=dtype,
                       max_grad_norm=optim.max_grad_norm, optim=optim, lr=lr)
    if hybrid_engine:  # DeepSpeed's hybrid engine (CUDA only): inference kernels for the actor's generate
        config["hybrid_engine"] = {"enabled": True, "inference_tp_size": 1, "release_inference_cache": False,
                                   "pin_parameters": True, "tp_gather_partition_size": 8, **hybrid_engine}
    warmup = warmup_steps_for(optim, total_steps)
    schedule = lr_lambda(total_steps, warmup, optim.lr_scheduler_type)
    eng, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=param_groups if param_groups is not None else optimizer_groups(model, optim.weight_decay),
        config=config,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule),
    )
    return eng


# The gradient norm of each optimizer step of each engine, until read (``take_grad_norms``).
_GRAD_NORMS: dict[int, list[float]] = {}
# The norm ZeRO 0 in float32 computed while clipping this step (``_keep_clip_norm``), by engine.
_CLIP_NORMS: dict[int, float] = {}


def _keep_clip_norm(engine: Any) -> None:
    """ZeRO 0 in float32 clips in ``engine.clip_fp32_gradients``, which drops the norm it computed: clip the same
    way (DeepSpeed's ``clip_grad_norm_``, the same call and arguments) and keep that norm, so an optimizer step
    computes the gradients' norm once, for the clipping and the logs alike."""
    if getattr(engine, "_dschat_keeps_clip_norm", False):
        return
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip_fp32_gradients() -> None:
        norm = clip_grad_norm_(parameters=engine.module.parameters(), max_norm=engine.gradient_clipping(),
                               mpu=engine.mpu)
        _CLIP_NORMS[id(engine)] = float(norm)

    engine.clip_fp32_gradients = clip_fp32_gradients
    engine._dschat_keeps_clip_norm = True


def optimizer_step(engine: Any) -> None:
    """``engine.step()``, recording the gradient norm of each optimizer step (not the steps inside an accumulation
    window): DeepSpeed's own figure where its optimizer computes one (ZeRO 1-3, bf16/fp16); on ZeRO 0 in float32,
    where DeepSpeed keeps none, the norm its clipping computed (``--max-grad-norm``), else the norm of the averaged
    gradients just before the step."""
    own = None
    if engine.is_gradient_accumulation_boundary() and not hasattr(engine.optimizer, "_global_grad_norm"):
        if engine.gradient_clipping() > 0:
            _keep_clip_norm(engine)
        else:
            norms = [torch.linalg.vector_norm(p.grad.detach().float()) for p in engine.module.parameters()
                     if p.grad is not None]
            own = torch.linalg.vector_norm(torch.stack(norms)).item() if norms else None
    before = engine.global_steps
    engine.step()
    clipped = _CLIP_NORMS.pop(id(engine), None)
    if engine.global_steps != before:
        norm = engine.get_global_grad_norm()
        norm = (clipped if clipped is not None else own) if norm is None else float(norm)
        if norm is not None:
            _GRAD_NORMS.setdefault(id(engine), []).append(norm)


def take_grad_norms(engine: Any) -> list[float]:
    """The gradient norms of ``engine``'s optimizer steps since the last call."""
    return _GRAD_NORMS.pop(id(engine), [])


def build_eval_engine(model: torch.nn.Module, *, zero_stage: int, offload: bool, dtype: torch.dtype,
                      micro_batch: int = 1) -> Engine:
    """A frozen engine (reference / reward model). ZeRO-3 shards it; lower stages simply place it.

    ``offload`` on an accelerator keeps the weights in CPU memory through ZeRO-3 parameter offload whatever
    ``zero_stage`` says (as DeepSpeed-Chat does): a module simply left on the CPU would be handed accelerator
    inputs. On a CPU-only machine the weights are in CPU memory already.
    """
    for p in model.parameters():
        p.requires_grad_(False)
    if zero_stage == 3 or (offload and device().type != "cpu"):
        config = ds_config(micro_batch=micro_batch, grad_accum=1, zero_stage=3, offload=offload, dtype=dtype,
                           inference=True)
        eng, *_ = deepspeed.initialize(model=model, config=config)
        eng.eval()
        return eng
    model.to(device=device(), dtype=dtype)
    model.eval()
    return model


def is_hybrid_engine(model: Any) -> bool:
    """Whether ``model`` is DeepSpeed's hybrid engine (``build_train_engine(hybrid_engine=...)`` on a setup that
    supports it); DeepSpeed builds a plain engine instead where it cannot."""
    return isinstance(model, DeepSpeedHybridEngine)


def is_zero3_partitioned(module: torch.nn.Module) -> bool:
    return any(hasattr(p, "ds_id") for p in module.parameters())


def settle_partitions(model: Any) -> None:
    """Wait for and release every ZeRO-3 parameter the engine ``model`` still has gathered or in flight.

    ZeRO-3 prefetches the parameters a forward is expected to need next, following the order it recorded; after
    a forward that ended off that order (a packed batch, an evaluation pass) some of those gathers are still in
    flight, and gathering such a parameter outside a forward (to save, or to generate) cannot partition it again
    ("Cannot partition a param in flight"). Call on every rank before such a gather; a no-op for a plain module
    or another ZeRO stage.
    """
    if hasattr(model, "empty_partition_cache") and is_zero3_partitioned(unwrap(model)):
        model.empty_partition_cache()


@contextlib.contextmanager
def gathered_parameters(model: Any, modifier_rank: int | None = None) -> Iterator[None]:
    """Materialise every ZeRO-3 partitioned parameter of ``model`` (an engine or its module) for the block; a
    no-op otherwise. Given the engine, its prefetches are settled first (``settle_partitions``).

    One gather for the whole block: wrap a whole ``generate`` call, never a per-token step.
    """
    settle_partitions(model)
    with gathered_params(list(unwrap(model).parameters()), modifier_rank):
        yield


@contextlib.contextmanager
def gathered_params(params: list[torch.nn.Parameter], modifier_rank: int | None = None) -> Iterator[None]:
    """Materialise the given parameters (those ZeRO-3 partitioned) for the block; a no-op otherwise. For walking
    a model one parameter (or one layer) at a time."""
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    if not partitioned:
        yield
        return
    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=modifier_rank):
        yield


def full_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """A complete CPU state dict of the module (gathering ZeRO-3 shards). Call on every rank; use on rank 0. Pass
    the engine, not its module, under ZeRO-3 (``settle_partitions``)."""
    module = unwrap(model)
    state: dict[str, torch.Tensor] = {}
    if is_zero3_partitioned(module):
        settle_partitions(model)
        for name, param in module.named_parameters():
            with gathered_params([param]):
                if is_main():
                    state[name] = param.data.detach().cpu().clone()
        # Only persistent buffers belong to a state dict (rotary inv_freq, for one, is recomputed at load).
        persistent = set(module.state_dict().keys())
        for name, buf in module.named_buffers():
            if is_main() and name in persistent:
                state[name] = buf.detach().cpu().clone()
        return state
    if is_main():
        state = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    return state


@dataclass
class Shard:
    """This rank's share of one tensor of a model's state: elements ``[start, start + live.numel())`` of the
    flattened tensor, ``live`` a view of them (no copy). Tensors are cut into ``world`` contiguous pieces of
    ``ceil(numel / world)`` elements, rank order, the last one short: ZeRO-3's own partitioning, used for
    every tensor, so a ZeRO-3 parameter's share is a view of its partition (``ds_tensor``)."""

    live: torch.Tensor  # (n,) this rank's elements
    start: int
    shape: torch.Size  # the whole tensor's
    dtype: torch.dtype
    world: int
    group: Any = None  # the process group the pieces are spread over (None: the world)


def own_shards(model: Any) -> dict[str, Shard]:
    """This rank's share of every tensor of ``full_state_dict(model)`` (same names), without communication:
    per-rank work on a model's state (an average of its weights, say) then costs 1/world of the model, and
    ``gather_shards`` assembles the result only when it is needed."""
    module = unwrap(model)
    shards: dict[str, Shard] = {}
    if is_zero3_partitioned(module):
        for name, p in module.named_parameters():
            world = dist.get_world_size(group=p.ds_process_group)
            size = p.ds_tensor.ds_numel  # ceil(numel / world): the partition, padded on the last rank
            start = dist.get_rank(group=p.ds_process_group) * size
            n = max(0, min(size, p.ds_numel - start))
            shards[name] = Shard(p.ds_tensor.detach().view(-1)[:n], start, p.ds_shape, p.dtype, world,
                                 p.ds_process_group)
        persistent = set(module.state_dict().keys())
        tensors = {n: b for n, b in module.named_buffers() if n in persistent}  # buffers are not partitioned
    else:
        tensors = module.state_dict(keep_vars=True)
    for name, t in tensors.items():
        world, numel = world_size(), t.numel()
        size = -(-numel // world)
        start = min(rank() * size, numel)
        shards[name] = Shard(t.detach().reshape(-1)[start: min(start + size, numel)], start, t.shape, t.dtype,
                             world)
    return shards


def gather_shards(parts: dict[str, torch.Tensor], layout: dict[str, Shard],
                  as_model: bool = True) -> dict[str, torch.Tensor]:
    """Whole CPU tensors on rank 0 (``{}`` elsewhere) from every rank's ``parts`` laid out as ``layout``
    (``own_shards``), each in its model tensor's dtype (``as_model``) or in the parts' own. Collective: call on
    every rank."""
    out: dict[str, torch.Tensor] = {}
    for name, part in parts.items():
        s = layout[name]
        numel = s.shape.numel()
        whole = part
        if s.world > 1:
            padded = torch.zeros(-(-numel // s.world), dtype=part.dtype, device=device())
            padded[: part.numel()] = part
            pieces = [torch.empty_like(padded) for _ in range(s.world)]
            dist.all_gather(pieces, padded, group=_group_for(padded, s.group))
            whole = torch.cat(pieces)[:numel]
        if is_main():
            out[name] = whole.view(s.shape).to(device="cpu", dtype=s.dtype if as_model else part.dtype, copy=True)
    return out


def consolidated_checkpoint_state(engine_dir: str | os.PathLike[str], tag: str) -> dict[str, torch.Tensor]:
    """The full fp32 module state dict of a DeepSpeed checkpoint written by ``save_checkpoint``, offline.

    ZeRO 1-3 shards (one file per rank) are merged; a ZeRO-0 checkpoint holds the module whole. Needs no
    process group, so it runs on any machine (e.g. a CPU box exporting a GPU run). DeepSpeed's merger unpickles
    the optimizer files: check the state's manifest first (``dschat.integrity.verify_state``).
    """
    folder = Path(engine_dir) / tag
    if any(folder.glob("*optim_states.pt")) and any(folder.glob("zero_pp_rank_*")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(engine_dir), tag=tag)
        return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    files = sorted(folder.glob("mp_rank_*_model_states.pt"))
    if not files:
        raise UserError(f"{folder}: no DeepSpeed model states found")
    from dschat.integrity import load_tensors

    blob = load_tensors(files[0])  # a ZeRO-0 model file holds tensors and plain values only: no pickled code
    return {k: v.float() if v.is_floating_point() else v for k, v in blob["module"].items()}
