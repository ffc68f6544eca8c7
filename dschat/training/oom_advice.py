"""The planner's advice when a training micro-batch runs out of device memory (docs/planning.md, Out of memory).

The run stops (``OutOfMemoryStop``, exit code 4: stopped with a state) in one line naming the stage, the phase, the
micro-batch, the plan's peak for the run's flags on its device, the flags the plan says would fit, and the state
kept. Where the plan says the run fits (it under-counted), the flags are those that fit in the device's memory
shrunk by the factor the run overshot it.

``Advisor`` holds what that line needs (the stage, its flags, its output folder, its ranks). A stage makes one when
it begins (``stage.begin_stage``, which also logs the plan's peak as the run starts), and the training loop runs
every training micro-batch of every stage and algorithm inside it (``stage.ResumableLoop.micro_batch``). Detecting
the error and the ``INJECT`` test hook are ``dschat.training.oom``'s.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dschat.errors import ExitCode, UserError, first_line
from dschat.training import memory, oom

STAGE_STEPS = {"step1_sft": 1, "step2_reward": 2, "step3_rlhf": 3}


class OutOfMemoryStop(UserError):
    """A training micro-batch ran out of device memory: the run stopped, keeping its last state."""

    exit_code = ExitCode.STOPPED


def device_memory() -> tuple[str, int]:
    """``(the planner's device name, its memory in bytes)`` of this process's device."""
    import torch

    from dschat.planning.gpus import gpu_of_device, host_memory

    if torch.cuda.is_available():
        return gpu_of_device(torch.cuda.get_device_name()), int(torch.cuda.mem_get_info()[1])
    return "CPU", host_memory()


def _requested(error: BaseException) -> int:
    """The allocation an out-of-memory error says failed ("Tried to allocate 2.00 GiB"), in bytes; 0 if unsaid."""
    found = re.search(r"Tried to allocate ([\d.]+) (GiB|MiB|KiB|B)", str(error))
    if not found:
        return 0
    return int(float(found.group(1)) * {"GiB": 1024**3, "MiB": 1024**2, "KiB": 1024, "B": 1}[found.group(2)])


@dataclass(frozen=True)
class Advisor:
    """One run's side of the advice: the stage's number (None for a run the planner does not know, whose stop
    line names no plan), its flags as ``dschat plan`` reads them, its output folder and its ranks."""

    step: int | None
    values: dict[str, Any]
    output_dir: Path
    ranks: int

    @classmethod
    def for_stage(cls, name: str, values: dict[str, Any], output_dir: Path, ranks: int) -> Advisor:
        """The advisor of stage ``name`` (``step1_sft``, ``step2_reward``, ``step3_rlhf``) run with ``values``."""
        return cls(STAGE_STEPS.get(name), dict(values), Path(output_dir), ranks)

    def _plan(self, *, suggest: bool, memory_bytes: int | None = None) -> Any:
        from dschat.planning import make_plan

        name, total = device_memory()
        ranks = max(1, self.ranks)
        return make_plan(self.step, dict(self.values), num_gpus=ranks, gpu=name, suggest=suggest,
                         gpu_memory=memory_bytes if memory_bytes is not None else
                         (total // ranks if name == "CPU" else total))

    def start_line(self) -> str | None:
        """The memory part of the stage's start line (the plan's peak per device); None for an unknown stage."""
        if self.step is None:
            return None
        try:
            plan = self._plan(suggest=False)
        except Exception as e:  # noqa: BLE001 - a shape the planner cannot read must not stop a run that loads
            return f"memory: no plan ({first_line(e, 120)})"
        from dschat.planning.gpus import fmt_bytes

        return (f"memory: the plan's peak {fmt_bytes(plan.peak_bytes)} per device ({plan.peak_phase.name}) of "
                f"{fmt_bytes(plan.memory)}; measured per phase as memory/* in metrics.jsonl")

    def stop_line(self, phase: str, micro_batch: int, error: BaseException, kept: str) -> str:
        """The one line of a training micro-batch out of memory: stage, phase, micro-batch, the plan's peak, the
        flags the plan says would fit, and ``kept`` (the state kept)."""
        where = f"out of memory in {'stage ' + str(self.step) if self.step is not None else 'training'}, " \
                f"phase {phase}, micro-batch {micro_batch}"
        if self.step is None:
            return f"{where}; {kept}"
        from dschat.planning.gpus import fmt_bytes

        try:
            plan = self._plan(suggest=True)
            if plan.fits:  # the plan under-counts this run: ask for the change that fits in memory scaled by as much
                top = memory.METER.peak()
                needed = max(plan.memory, top[2] if top else 0) + _requested(error)
                scaled = self._plan(suggest=True, memory_bytes=int(plan.memory * plan.peak_bytes / needed))
                flags = scaled.suggestion if not scaled.fits else None
            else:
                flags = plan.suggestion
            said = f"the plan's peak {fmt_bytes(plan.peak_bytes)} per device of {fmt_bytes(plan.memory)}" + \
                   (f"; it says this fits: {flags}" if flags else "; the plan has no change to offer")
        except Exception as e:  # noqa: BLE001 - the line must come out whatever the planner says
            said = f"no plan ({first_line(e, 120)})"
        return f"{where}: {said}; {kept}"

    def last_state_kept(self) -> str:
        """What a run that cannot save now keeps: its latest state on disk, if any."""
        from dschat.training.resume import latest_state

        latest = latest_state(self.output_dir)
        return f"the last state is {latest}; continue with --resume" if latest else "no state was saved before it"

    @contextlib.contextmanager
    def stop_on_oom(self, phase: str, micro_batch: int, keep: Callable[[], str]) -> Iterator[None]:
        """Run one training micro-batch (forward, backward, step); out of memory in it stops the run with the stop
        line (``OutOfMemoryStop``). ``keep()`` keeps what state it can and says what it kept."""
        error: BaseException | None = None
        try:
            oom.check(f"train {phase}", micro_batch)
            yield
        except Exception as e:  # noqa: BLE001 - only an out-of-memory error is turned into the stop
            if not oom.is_oom(e):
                raise
            error = e
        if error is not None:
            text = str(error)
            error = None  # its traceback holds the failed micro-batch's tensors
            oom.release()
            raise OutOfMemoryStop(self.stop_line(phase, micro_batch, RuntimeError(text), keep())) from None
