"""Out of memory on the device (docs/planning.md, Out of memory).

* A forward without gradient (sampling, the experience forwards, evaluation) that runs out of memory is run again
  on the two halves of its batch (each split again if it must) and the results are put together: the same rows
  in the same order. Only where the forward is this rank's alone: under ZeRO-3 with more than one rank every
  forward is a collective, and one rank running two where the others run one would hang them all.
* A training micro-batch that runs out of memory stops the run (``OutOfMemoryStop``, exit code 4: stopped with a
  state) in one line naming the stage, the phase, the micro-batch, the plan's peak and the flags the plan says
  would fit.

Detection is ``is_oom`` (``torch.OutOfMemoryError``, CUDA's and the other accelerators'); ``INJECT`` raises one on
purpose, so both paths are tested on a CPU.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from dschat.errors import ExitCode, UserError
from dschat.training import memory

T = TypeVar("T")

# Tests: ``INJECT(site, n) -> True`` raises an out-of-memory error at that call. ``site`` is a forward's name
# (``generate``, ``experience``, ``score``, ``eval``) with ``n`` its rows, or ``train <phase>`` with ``n`` the
# micro-batch's number (from 1) in its step.
INJECT: Callable[[str, int], bool] | None = None


class OutOfMemoryStop(UserError):
    """A training micro-batch ran out of device memory: the run stopped, keeping its last state."""

    exit_code = ExitCode.STOPPED


def is_oom(error: BaseException) -> bool:
    import torch

    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "out of memory" in str(error) and "CUDA" in str(error))


def check(site: str, n: int) -> None:
    """Raise the injected out-of-memory error of ``INJECT`` at ``site``, if it asks for one."""
    if INJECT is not None and INJECT(site, n):
        import torch

        raise torch.OutOfMemoryError(f"CUDA out of memory (injected at {site}, {n})")


def _release() -> None:
    """Give the failed attempt's cached blocks back before trying again."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def rank_local(model: Any) -> bool:
    """Whether a forward of ``model`` involves no other rank: one rank, or weights that ZeRO-3 does not partition."""
    from dschat import engine as E

    if E.world_size() == 1:
        return True
    module = getattr(model, "module", model)
    params = getattr(module, "parameters", None)
    return params is None or not any(hasattr(p, "ds_id") for p in params())


def split_on_oom(site: str, rows: int, run: Callable[[int, int], T], combine: Callable[[list[T]], T], *,
                 local: bool = True) -> T:
    """``run(0, rows)``; on out of memory, ``combine([run(0, m), run(m, rows)])`` with ``m = rows // 2``, halving
    further as needed (``run(a, b)``: the rows ``a:b``). Not ``local`` (a collective forward), or one row: the error
    goes on. Each split is counted (``memory/oom_splits``) and told in one line."""

    def attempt(a: int, b: int) -> T:
        try:
            check(site, b - a)
            return run(a, b)
        except Exception as e:  # noqa: BLE001 - only an out-of-memory error is handled; the rest go on
            if not (is_oom(e) and local and b - a > 1):
                raise
        # out of the except block: its traceback holds the failed attempt's tensors
        _release()
        mid = (a + b) // 2
        memory.METER.oom_splits += 1
        _say(f"out of memory in {site} over {b - a} rows: running halves of {mid - a} and {b - mid} rows "
             f"(memory/oom_splits {memory.METER.oom_splits})")
        return combine([attempt(a, mid), attempt(mid, b)])

    return attempt(0, rows)


def _say(text: str) -> None:
    from dschat import engine as E

    rank = f" rank {E.rank()}" if E.world_size() > 1 else ""
    print(f"[memory{rank}] {text}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ training
@dataclass
class RunContext:
    """What the stop line names: the stage, its flags (for the plan), its output folder."""

    step: int
    values: dict[str, Any]
    output_dir: Path
    ranks: int


CONTEXT: RunContext | None = None
STAGE_STEPS = {"step1_sft": 1, "step2_reward": 2, "step3_rlhf": 3}


def begin_run(name: str, values: dict[str, Any], output_dir: Path, ranks: int) -> str | None:
    """Remember the run for a stop line; return the start line's memory part (the plan's peak per GPU)."""
    global CONTEXT
    step = STAGE_STEPS.get(name)
    CONTEXT = RunContext(step, values, Path(output_dir), ranks) if step is not None else None
    if CONTEXT is None:
        return None
    try:
        plan = _plan(CONTEXT, suggest=False)
    except Exception as e:  # noqa: BLE001 - a shape the planner cannot read must not stop a run that loads
        from dschat.errors import first_line

        return f"memory: no plan ({first_line(e, 120)})"
    from dschat.planning.gpus import fmt_bytes

    return (f"memory: the plan's peak {fmt_bytes(plan.peak_bytes)} per device ({plan.peak_phase.name}) of "
            f"{fmt_bytes(plan.memory)}; measured per phase as memory/* in metrics.jsonl")


def device_memory() -> tuple[str, int]:
    """``(the planner's device name, its memory in bytes)`` of this process's device."""
    import torch

    from dschat.planning.gpus import DEFAULT_GPU, host_memory

    if torch.cuda.is_available():
        from dschat.planning.gpus import GPUS

        name = torch.cuda.get_device_name()
        key = name.lower().replace("nvidia", "").replace(" ", "").replace("-", "")
        known = next((g.name for g in GPUS.values() if g.name.lower().replace("-", "").replace(" ", "") in key),
                     DEFAULT_GPU)
        return known, int(torch.cuda.mem_get_info()[1])
    return "CPU", host_memory()


def _plan(ctx: RunContext, *, suggest: bool, memory_bytes: int | None = None) -> Any:
    from dschat.planning import make_plan

    name, total = device_memory()
    ranks = max(1, ctx.ranks)
    return make_plan(ctx.step, dict(ctx.values), num_gpus=ranks, gpu=name, suggest=suggest,
                     gpu_memory=memory_bytes if memory_bytes is not None else
                     (total // ranks if name == "CPU" else total))


def _requested(error: BaseException) -> int:
    """The allocation an out-of-memory error says failed ("Tried to allocate 2.00 GiB"), in bytes; 0 if unsaid."""
    found = re.search(r"Tried to allocate ([\d.]+) (GiB|MiB|KiB|B)", str(error))
    if not found:
        return 0
    return int(float(found.group(1)) * {"GiB": 1024**3, "MiB": 1024**2, "KiB": 1024, "B": 1}[found.group(2)])


def stop_line(phase: str, micro_batch: int, error: BaseException, kept: str) -> str:
    """The one line of a training micro-batch out of memory: stage, phase, micro-batch, the plan's peak, the flags
    the plan says would fit, and the state kept."""
    where = f"out of memory in {'stage ' + str(CONTEXT.step) if CONTEXT else 'training'}, phase {phase}, " \
            f"micro-batch {micro_batch}"
    if CONTEXT is None:
        return f"{where}; {kept}"
    from dschat.planning.gpus import fmt_bytes

    try:
        plan = _plan(CONTEXT, suggest=True)
        if plan.fits:  # the plan under-counts this run: ask for the change that fits in memory scaled by as much
            top = memory.METER.peak()
            needed = max(plan.memory, top[2] if top else 0) + _requested(error)
            scaled = _plan(CONTEXT, suggest=True, memory_bytes=int(plan.memory * plan.peak_bytes / needed))
            flags = scaled.suggestion if not scaled.fits else None
        else:
            flags = plan.suggestion
        said = f"the plan's peak {fmt_bytes(plan.peak_bytes)} per device of {fmt_bytes(plan.memory)}" + \
               (f"; it says this fits: {flags}" if flags else "; the plan has no change to offer")
    except Exception as e:  # noqa: BLE001 - the line must come out whatever the planner says
        from dschat.errors import first_line

        said = f"no plan ({first_line(e, 120)})"
    return f"{where}: {said}; {kept}"


@contextlib.contextmanager
def training_micro_batch(phase: str, micro_batch: int, keep: Callable[[], str]) -> Iterator[None]:
    """Run one training micro-batch (forward, backward, step); out of memory stops the run with one line
    (``OutOfMemoryStop``). ``keep()`` keeps the last state and says what it kept."""
    error: BaseException | None = None
    try:
        check(f"train {phase}", micro_batch)
        yield
    except Exception as e:  # noqa: BLE001 - only an out-of-memory error is turned into the stop
        if not is_oom(e):
            raise
        error = e
    if error is not None:
        text = str(error)
        error = None  # its traceback holds the failed micro-batch's tensors
        _release()
        raise OutOfMemoryStop(stop_line(phase, micro_batch, RuntimeError(text), keep())) from None


def last_state_kept() -> str:
    """What a run that cannot save now keeps: its latest state on disk, if any."""
    from dschat.training.resume import latest_state

    latest = latest_state(CONTEXT.output_dir) if CONTEXT is not None else None
    return f"the last state is {latest}; continue with --resume" if latest else "no state was saved before it"
