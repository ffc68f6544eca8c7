"""The doctor's plan check: the memory planner's verdict for the run (``dschat.planning.make_plan``), and on a
GPU host the plan's peak against the memory each GPU the run would use has free now (``check_gpus``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dschat.doctor.report import ERROR, OK, WARN, Report
from dschat.errors import UserError, first_line
from dschat.units import fmt_bytes


def check_plan(step: int, values: dict[str, Any], report: Report, **hardware: Any) -> Any:
    """The memory planner's verdict (``dschat.planning.make_plan``): does the run fit, and what to change."""
    try:
        from dschat.planning import make_plan
    except ImportError:
        report.add("plan", WARN, "plan unavailable (dschat.planning.make_plan is not installed)")
        return None
    try:
        plan = make_plan(step, values, **{k: v for k, v in hardware.items() if v is not None})
    except UserError as e:
        report.add("plan", ERROR, str(e))
        return None
    except Exception as e:  # noqa: BLE001 - a planner that cannot plan this run must not stop the other checks
        report.add("plan", WARN, f"plan unavailable ({type(e).__name__}: {first_line(e, 160)})")
        return None
    peak = fmt_bytes(plan.peak_bytes)
    if plan.fits:
        report.add("plan", OK, f"fits: peak {peak} per device, checkpoint {fmt_bytes(plan.checkpoint_bytes)}")
    else:
        hint = f"; {plan.suggestion}" if plan.suggestion else ""
        report.add("plan", ERROR, f"does not fit: peak {peak} per device{hint}")
    return plan


@dataclass(frozen=True)
class GPUMemory:
    """One visible GPU's memory as the driver reports it now: bytes free and in total."""

    index: int
    name: str
    free: int
    total: int


GPUReader = Callable[[], Sequence[GPUMemory]]


def visible_gpu_memory() -> list[GPUMemory]:
    """Free and total memory of each GPU this process sees (``CUDA_VISIBLE_DEVICES`` applies), from
    ``torch.cuda.mem_get_info``; empty on a host without CUDA. Asking creates this process's CUDA context on each
    GPU, so the free figure is short by about one context, which the plan counts for the run as well: the check
    errs on the safe side."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        out.append(GPUMemory(i, torch.cuda.get_device_name(i), int(free), int(total)))
    return out


def check_gpus(plan: Any, gpus: Sequence[GPUMemory], num_gpus: int | None, report: Report) -> None:
    """The plan's peak per device against the free memory of each GPU the run would use (the first ``--num-gpus``
    visible ones, else the first): an error names each GPU that has less free than the plan needs, and who holds
    the rest (another process); nothing on a host without GPUs or without a plan."""
    if plan is None or not gpus:
        return
    wanted = num_gpus or 1
    if len(gpus) < wanted:
        report.add("gpu", ERROR, f"--num-gpus {wanted}: only {len(gpus)} GPU(s) visible here; lower --num-gpus or "
                                 "check CUDA_VISIBLE_DEVICES")
    peak = int(plan.peak_bytes)
    for g in gpus[:wanted]:
        held = g.total - g.free
        if g.free < peak:
            report.add("gpu", ERROR, f"GPU {g.index} ({g.name}): {fmt_bytes(g.free)} free of {fmt_bytes(g.total)} "
                                     f"({fmt_bytes(held)} held by other processes), less than the plan's peak of "
                                     f"{fmt_bytes(peak)} per device; free it or pick other GPUs (CUDA_VISIBLE_DEVICES)")
        else:
            report.add("gpu", OK, f"GPU {g.index} ({g.name}): {fmt_bytes(g.free)} free of {fmt_bytes(g.total)}, "
                                  f"room for the plan's peak of {fmt_bytes(peak)} per device")
