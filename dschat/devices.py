"""Which device and which precision: the one rule every command and stage follows.

torch is imported inside the functions, so the CLI can declare ``--dtype`` choices without importing it.
"""

from __future__ import annotations

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
    """On CUDA, keep SDPA off its cuDNN backend (flash, memory-efficient and math remain). cuDNN attention builds
    an execution plan for every new shape, and RLHF's shapes keep changing: a decode step's key length grows by
    one each token (HF ``generate``'s and an eager decoder's), and training batches are padded to their longest
    row. Building those plans cost more CPU time than the kernels saved (docs/speed.md, GPU section). A no-op off
    CUDA; ``DSCHAT_CUDNN_ATTENTION=1`` leaves torch's own choice."""
    import os

    import torch

    if torch.cuda.is_available() and os.environ.get("DSCHAT_CUDNN_ATTENTION", "0") != "1":
        torch.backends.cuda.enable_cudnn_sdp(False)
