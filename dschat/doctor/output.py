"""The doctor's output check: the output folder writable, room on its disk for the checkpoints, no live run holding
its lock (``dschat.training.lock``), no earlier run without ``--resume`` or ``--force``."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from dschat.doctor.models import folder_params
from dschat.doctor.report import ERROR, OK, WARN, Report
from dschat.units import fmt_bytes, fmt_count

#: Bytes per trained parameter in one resumable state when no plan gives the size: fp32 master weights and two
#: Adam moments (12) plus the engine's own copy of the weights (up to 4).
STATE_BYTES_PER_PARAM = 16


def output_folder(step: int, cfg: Any) -> Path:
    """``--output-dir``, or the stage's default (``output/<stage>``)."""
    if cfg.run.output_dir:
        return Path(cfg.run.output_dir).expanduser()
    name = {1: "step1_sft", 2: "step2_reward"}.get(step) or cfg.algorithm.output_name
    return Path("output") / name


def check_output(step: int, cfg: Any, report: Report, plan: Any, paths: dict[str, str]) -> None:
    """Writable, room for the checkpoints, no live run holding it, no earlier run without --resume or --force."""
    out = output_folder(step, cfg)
    if out.exists() and not out.is_dir():
        report.add("output", ERROR, f"--output-dir {out}: is a file, not a folder")
        return
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        report.add("output", ERROR, f"--output-dir {out}: {existing} is not writable by this user")
        return
    need, how = checkpoint_need(step, cfg, plan, paths)
    free = shutil.disk_usage(existing).free
    has, wants = fmt_bytes(free), fmt_bytes(need)
    if need and free < need:
        report.add("output", ERROR, f"--output-dir {out}: {has} free on its disk, the run's checkpoints need about "
                                    f"{wants} ({how}); free space or choose another disk")
    elif need and free < 2 * need:
        report.add("output", WARN, f"--output-dir {out}: {has} free, less than twice the {wants} the checkpoints "
                                   f"need ({how})")
    else:
        report.add("output", OK, f"--output-dir {out}: writable, {has} free"
                                 + (f" for about {wants} of checkpoints ({how})" if need else ""))
    check_lock(out, report)
    if not out.is_dir():
        return
    from dschat.training.resume import latest_state

    latest, finished = latest_state(out), (out / "eval.json").exists()
    run = cfg.run
    if finished and not run.force and not (run.resume and latest is not None):
        report.add("output", ERROR, f"{out} already holds a finished run (eval.json); pass --force to overwrite "
                                    "it, --resume to train on from its final state, or choose another --output-dir")
    elif latest is not None and not (run.resume or run.force):
        report.add("output", ERROR, f"{out} holds a resumable training state ({latest.name}); pass --resume to "
                                    "continue it or --force to start over")
    elif latest is not None and run.resume:
        report.add("output", OK, f"--resume continues from {latest}")
    elif run.resume:
        report.add("output", WARN, f"--resume: {out} holds no training state; the run starts from the beginning")


def checkpoint_need(step: int, cfg: Any, plan: Any, paths: dict[str, str]) -> tuple[int, str]:
    """Bytes the run writes at its peak (``--keep-checkpoints`` states plus the one being written, and the saved
    model folders), from the plan, else estimated from the trained models' parameter counts."""
    states = cfg.run.keep_checkpoints + 1
    if plan is not None:
        saved, state = int(plan.checkpoint_bytes), int(getattr(plan, "state_bytes", 0) or 0)
        return saved + states * state, (f"the plan: {states} x {fmt_bytes(state)} states + {fmt_bytes(saved)} "
                                        "of saved models")
    trained = ["model"] if step in (1, 2) else ["actor"] + (["critic"] if "critic" in cfg.algorithm.needs(cfg) else [])
    params = 0
    for role in trained:
        path = paths.get(role) or (paths.get("reward") if role == "critic" else None)
        if path:
            params += folder_params(Path(path))
    if not params:
        return 0, ""
    return params * (STATE_BYTES_PER_PARAM * states + 4), (f"{fmt_count(params)} trained parameters x "
                                                          f"{STATE_BYTES_PER_PARAM} bytes x {states} states, "
                                                          "estimated")


def check_lock(out: Path, report: Report) -> None:
    """Whether another live run holds the folder's lock, judged by the lock module itself (``lock_state``: the
    lock taken and released at once, the note where the filesystem gives no answer); one finding at most."""
    from dschat.training.lock import LOCK_NAME, describe, lock_state

    state = lock_state(out)
    if state is None:
        return
    path, who = out / LOCK_NAME, describe(state.info)
    judged = f"; {state.refusal}, so judged by its note" if state.refusal else ""
    if not state.writable:
        report.add("output", ERROR, f"{path}: {state.refusal}; the run opens it for writing and would stop there: "
                                    "remove it if no run uses the folder, or choose another --output-dir")
    elif state.held:
        report.add("output", ERROR, f"{out} is in use by another run ({who}{judged}); wait for it to finish or choose "
                                    "another --output-dir")
    elif state.refusal:
        report.add("output", WARN, f"{path}: {state.refusal}; the run falls back to the note as the lock, which names "
                                   + (f"a run that is gone ({who})" if state.info.get("pid") else "no run"))
    elif state.info.get("pid"):
        report.add("output", OK, f"{out}: the lock was left by a run that is gone ({who})")
