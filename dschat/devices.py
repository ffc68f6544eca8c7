"""Which device and which precision: the one rule every command and stage follows.

torch is imported inside the functions, so the CLI can declare ``--dtype`` choices without importing it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from dschat.errors import UserError

if TYPE_CHECKING:
    import torch

DTYPES = ("auto", "fp32", "bf16", "fp16")  # the choices of every --dtype flag


def pick_device(name: str) -> torch.device:
    """``auto``: the current CUDA device when there is one, else the CPU; anything else is checked."""
    import torch

    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise UserError(f"--device {name!r}: not a device (try cpu, cuda or cuda:1)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"--device {name}: CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UserError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) here")
    return dev


def resolve_dtype(name: str, device: torch.device | None = None) -> torch.dtype:
    """``--dtype`` as a torch dtype. ``auto`` is fp32 on a CPU (half-precision matmuls there are slow or missing)
    and bf16 on CUDA, fp16 before Ampere (no bf16). ``device`` None means the device this process computes on:
    CUDA when there is one."""
    import torch

    if name != "auto":
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
    cuda = torch.cuda.is_available() if device is None else device.type == "cuda"
    if cuda:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def prefer_attention_kernels() -> None:
    """Keep SDPA off its cuDNN backend (flash, memory-efficient and math remain). cuDNN attention builds an
    execution plan for every new shape, and RLHF's shapes keep changing: a decode step's key length grows by one
    each token (HF ``generate``'s and an eager decoder's), and training batches are padded to their longest row.
    Building those plans cost more CPU time than the kernels saved (docs/speed.md, GPU section). Applied by the
    process-group set-up and by every model loader (``dschat.models.loading``), so sampling commands that never
    train (``dschat generate``, ``chat``, ``eval``, the judge) get it too. The flag steers CUDA's SDPA dispatch
    only, so it is set whatever the device (a CPU process never reads it); ``DSCHAT_CUDNN_ATTENTION=1`` leaves
    torch's own choice."""
    import os

    import torch

    if os.environ.get("DSCHAT_CUDNN_ATTENTION", "0") != "1":
        torch.backends.cuda.enable_cudnn_sdp(False)


def seed_generators(seed: int) -> None:
    """Seed torch's CPU generator and the current CUDA device's (where there is one): the generators a sampler on
    this process draws from. Other CUDA devices are left alone (seeding or forking them would make a context on
    each)."""
    import torch

    torch.random.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)


@contextlib.contextmanager
def forked_rng(seed: int | None = None) -> Iterator[None]:
    """A side computation's random draws (a seeded evaluation, a judge's votes, an engine that seeds the global
    generators) without moving the run's streams: the CPU generator's state and the current CUDA device's are
    saved and restored around the block (``torch.random.fork_rng``); with ``seed`` both are seeded for it
    (``seed_generators``). Restoring the CPU state alone would leave CUDA's where the block left it, so every
    rollout after a seeded evaluation would replay the same stream on a GPU."""
    import torch

    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        if seed is not None:
            seed_generators(seed)
        yield
