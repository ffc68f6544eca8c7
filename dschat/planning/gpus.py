"""The planner's device table: memory, dense 16-bit tensor throughput and memory bandwidth (vendor datasheets),
and the fixed memory a run holds beside its model memory.

Memory is what ``nvidia-smi`` reports as the total (MiB); FLOPs are dense (no structured sparsity) bf16 with fp32
accumulation, fp16 for the V100, which has no bf16.

``CPU`` is the gloo backend on a host's cores (tests, CI, a first try): its ranks share the host's memory, it
computes in fp32, and its throughput and fixed cost are the measured ones of docs/planning.md ("Checks", with the
machine they were taken on).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dschat.errors import UserError
from dschat.units import fmt_bytes as fmt_bytes  # the planner's tables format with the one byte formatter

GiB = 1024**3
MiB = 1024**2


# A GPU's fixed cost per process, term by term (docs/planning.md, "On a GPU": typical and configured sizes; not yet
# measured against a GPU):
# the CUDA context with torch's kernels loaded lazily (CUDA_MODULE_LOADING=LAZY, torch's default);
CUDA_CONTEXT = 500 * MiB
# cuBLAS's and cuBLASLt's workspaces on the compute stream (torch's default CUBLAS_WORKSPACE_CONFIG on Hopper,
# :4096:8, is 32 MiB; cuBLASLt takes as much);
CUBLAS_WORKSPACES = 2 * 32 * MiB
# cuDNN's handle and attention workspace (torch's cuDNN SDPA backend): no configured size, a nominal figure;
CUDNN_WORKSPACE = 32 * MiB
# with more than one rank, NCCL's buffers of the one data-parallel communicator: NCCL_BUFFSIZE (4 MiB) for sending
# and for receiving, to each of a ring's two neighbours, on each of up to 32 channels.
NCCL_BUFFSIZE = 4 * MiB
NCCL_CHANNELS = 32
NCCL_BUFFERS = NCCL_BUFFSIZE * 2 * 2 * NCCL_CHANNELS
GPU_RESERVE = CUDA_CONTEXT + CUBLAS_WORKSPACES + CUDNN_WORKSPACE
# A CPU rank's, beyond its imports: the data and tokenizer, DeepSpeed's setup and per-thread allocator arenas, plus
# gloo's process group and buffers with more than one rank (figures and how they were taken: docs/planning.md, Checks).
CPU_RESERVE = 240 * MiB
CPU_COLLECTIVE_RESERVE = 55 * MiB


@dataclass(frozen=True)
class GPU:
    name: str
    memory: int  # bytes
    flops: float  # peak dense FLOP/s in ``auto_dtype``
    bandwidth: float  # bytes/s
    auto_dtype: str = "bf16"  # what ``--dtype auto`` means on it
    reserve: int = GPU_RESERVE  # fixed bytes per process beside the model's
    collective_reserve: int = NCCL_BUFFERS  # more of them when the run has more than one rank
    host: bool = False  # the host's cores and RAM: its ranks share ``memory``, and pages count once written

    def reserve_for(self, ranks: int) -> int:
        return sum(b for _, b in self.reserve_items(ranks))

    def reserve_items(self, ranks: int) -> list[tuple[str, int]]:
        """The fixed cost per process, ``(what, bytes)`` term by term."""
        if self.host:
            items = [("process (data, tokenizer, DeepSpeed set-up, allocator arenas)", self.reserve)]
            return items + ([("gloo process group", self.collective_reserve)] if ranks > 1 else [])
        items = [("CUDA context", CUDA_CONTEXT), ("cuBLAS/cuBLASLt workspaces", CUBLAS_WORKSPACES),
                 ("cuDNN workspace", CUDNN_WORKSPACE)]
        if self.reserve != GPU_RESERVE:  # a device whose fixed cost was given whole
            items = [("fixed cost", self.reserve)]
        return items + ([("NCCL buffers", self.collective_reserve)] if ranks > 1 else [])

    def memory_per_rank(self, ranks_per_node: int) -> int:
        return self.memory // ranks_per_node if self.host else self.memory


def host_memory() -> int:
    """This machine's physical memory in bytes (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


GPUS: dict[str, GPU] = {g.name.lower(): g for g in (
    GPU("A100-40GB", 40960 * MiB, 312e12, 1.555e12),
    GPU("A100-80GB", 81920 * MiB, 312e12, 2.039e12),
    GPU("H100-80GB", 81559 * MiB, 989e12, 3.35e12),
    GPU("H200", 143771 * MiB, 989e12, 4.8e12),
    GPU("L40S", 46068 * MiB, 362e12, 0.864e12),
    GPU("L4", 23034 * MiB, 121e12, 0.3e12),
    GPU("A10G", 23028 * MiB, 70e12, 0.6e12),
    GPU("RTX 4090", 24564 * MiB, 165e12, 1.008e12),
    GPU("V100-32GB", 32768 * MiB, 125e12, 0.9e12, auto_dtype="fp16"),
    # fp32 matmul and copy throughput of a small CPU host (docs/planning.md, Checks); the memory is this host's
    GPU("CPU", host_memory(), 55e9, 13e9, auto_dtype="fp32", reserve=CPU_RESERVE,
        collective_reserve=CPU_COLLECTIVE_RESERVE, host=True),
)}
DEFAULT_GPU = "A100-80GB"
# Names without the memory size, for the GPUs whose common form has one size.
SHORT_NAMES = {"h100": "h10080gb", "v100": "v10032gb", "rtx4090": "rtx4090", "4090": "rtx4090"}


def _gpu_key(name: str) -> str:
    """A GPU's name as the table compares names: lower case, without spaces, dashes and underscores."""
    return name.lower().replace(" ", "").replace("-", "").replace("_", "")


def find_gpu(name: str) -> GPU:
    """A GPU of the table by name, ignoring case, spaces and dashes (``h100``, ``a100-80gb``, ``rtx4090``)."""
    wanted = SHORT_NAMES.get(_gpu_key(name), _gpu_key(name))
    for g in GPUS.values():
        if _gpu_key(g.name) == wanted:
            return g
    raise UserError(f"--gpu {name!r} is not in the GPU table ({', '.join(g.name for g in GPUS.values())}); give "
                    f"--gpu-memory instead")


def gpu_of_device(device_name: str) -> str:
    """The table's name of a GPU as its driver names it (``torch.cuda.get_device_name``: ``NVIDIA H100 80GB HBM3``
    is ``H100-80GB``): the first entry whose name is part of it, else ``DEFAULT_GPU``."""
    key = _gpu_key(device_name)
    return next((g.name for g in GPUS.values() if _gpu_key(g.name) in key), DEFAULT_GPU)


def parse_bytes(text: str) -> int:
    """``80GiB``, ``80GB`` (decimal), ``40960MiB``, ``24G`` (binary) or a plain number of bytes."""
    units = {"tib": 1024**4, "gib": GiB, "mib": MiB, "kib": 1024, "tb": 10**12, "gb": 10**9, "mb": 10**6,
             "kb": 10**3, "t": 1024**4, "g": GiB, "m": MiB, "k": 1024, "b": 1, "": 1}
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise UserError(f"cannot read {text!r} as a memory size (e.g. 80GiB, 40GB, 24576MiB)")
    return int(value * units[unit])




def fmt_rate(x: float, unit: str) -> str:
    """A rate in T (or G below 1e12) of ``unit``: ``312 TFLOP/s``, ``2.04 TB/s``, ``55 GFLOP/s``."""
    return f"{x / 1e12:.3g} T{unit}" if x >= 1e12 else f"{x / 1e9:.3g} G{unit}"
