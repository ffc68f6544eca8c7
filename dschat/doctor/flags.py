"""The doctor's flags check: the checks ``dschat train`` makes before anything loads."""

from __future__ import annotations

from typing import Any

from dschat.config import build_config, refuse_inert
from dschat.doctor.output import output_folder
from dschat.doctor.report import ERROR, OK, Report
from dschat.errors import UserError


def check_flags(step: int, values: dict[str, Any], report: Report) -> Any:
    """The checks ``dschat train`` makes before anything loads: types and ranges (``build_config``), flags with no
    effect in the chosen mode (``refuse_inert``), stage 3's combinations (``check_config``) and the trackers."""
    from dschat.planning.plan import config_class

    try:
        cfg = build_config(config_class(step), values)
        refuse_inert(cfg, set(values))
        if step == 3:
            from dschat.rlhf.config import check_config

            check_config(cfg)
        from dschat.training.sinks import tracker_problem

        problem = tracker_problem(cfg.run.report_to, output_folder(step, cfg))
        if problem:
            raise UserError(problem)
    except UserError as e:
        report.add("flags", ERROR, str(e))
        return None
    given = ", ".join("--" + k.replace("_", "-") for k in sorted(values)) or "none (all defaults)"
    report.add("flags", OK, f"stage {step} flags accepted; given: {given}")
    return cfg
