"""``dschat doctor``: check a planned run without training (docs/doctor.md).

``run_doctor(step, values, ...)`` takes a stage's flags as ``dschat train --step N`` would receive them (flat
``{flag name: value}``, only the flags given) and returns one ``Finding`` per check, one module per kind of check:

- ``flags``: the flags as the stage validates them;
- ``models``: the model folders, read as JSON and safetensors headers (no weights loaded);
- ``tokenizer``: pad against EOS and BOS, and the chat template's round trip;
- ``data``: the data as the stage would tokenize it (formats, drops, malformed rows, over-long prompts, lengths);
- ``plan``: the memory plan, and on a GPU host each GPU's free memory against it;
- ``output``: the output folder (writable, free space, a live lock, an earlier run);
- ``sampler``: stage 3's asynchronous rollouts (a ``--sampler HOST:PORT`` that answers, ``--sampler-devices``);
- ``cluster``: the launcher (hostfile, hosts, master port, versions).

Severity is ``ok``, ``warn`` or ``error``; a run with an error would fail or train on something other than what
was meant. The checks reuse the functions the stages run (``build_config``, ``refuse_inert``, ``load_phase``,
``render_turns``, ``tokenize_examples``, ``ensure_distinct_pad``, the lock's own ``lock_state``), so they measure
what the stage would do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from dschat.doctor.cluster import check_launcher, local_versions, parse_hostfile
from dschat.doctor.data import check_data, histogram
from dschat.doctor.flags import check_flags
from dschat.doctor.models import check_models, inspect_model_folder, read_safetensors_header
from dschat.doctor.output import check_output, output_folder
from dschat.doctor.plan import GPUMemory, GPUReader, check_gpus, check_plan, visible_gpu_memory
from dschat.doctor.report import ERROR, OK, WARN, Finding, Report
from dschat.doctor.sampler import check_sampler
from dschat.doctor.tokenizer import check_template, check_tokenizer
from dschat.errors import UserError

__all__ = ["ERROR", "OK", "WARN", "Finding", "GPUMemory", "histogram", "inspect_model_folder", "local_versions",
           "output_folder", "parse_hostfile", "read_safetensors_header", "run_doctor", "visible_gpu_memory"]


def run_doctor(step: int, values: dict[str, Any], *, hostfile: str | None = None, master_port: int | None = None,
               num_gpus: int | None = None, nodes: int | None = None, gpu_memory: int | None = None,
               gpu: str | None = None, default_data: Callable[[str], Sequence[str]] | None = None,
               connect_timeout: float = 3.0, gpu_reader: GPUReader = visible_gpu_memory) -> list[Finding]:
    """Check a planned run of stage ``step`` with the flags ``values`` (flat, as given: defaults are not
    flags given) and the launcher's settings; nothing is trained and no weights are loaded.

    ``default_data(kind)`` gives ``--data`` when none is given (the stage mains pass the demo corpus; ``kind`` is
    ``pairwise`` for stages 1 and 2, the algorithm's demo file for stage 3). ``connect_timeout`` bounds each
    network probe (a hostfile's hosts, a ``--sampler HOST:PORT``). ``gpu_reader`` gives the visible GPUs' free
    memory (``visible_gpu_memory``; tests inject their own): on a GPU host without ``--gpu`` or ``--gpu-memory``
    the plan is made for the smallest visible GPU's memory, and each GPU the run would use is checked against the
    plan's peak. Returns the findings in report order.
    """
    report = Report()
    cfg = check_flags(step, values, report)
    if cfg is not None:
        paths = check_models(step, cfg, report)
        main = paths.get("actor" if step == 3 else "model")
        tokenizer = check_tokenizer(main, cfg.model.trust_remote_code, report) if main else None
        if step == 3 and paths.get("reward") and paths.get("reward") != main:
            check_tokenizer(paths["reward"], cfg.model.trust_remote_code, report, who="reward model ")
        formats: list[str] = []
        if tokenizer is not None:
            formats = check_data(step, cfg, tokenizer, default_data, report)
            check_template(tokenizer, formats, report)
        if hostfile and nodes is None:
            with contextlib.suppress(UserError, OSError):
                nodes = len(parse_hostfile(hostfile))
        gpus = list(gpu_reader())
        if gpus and gpu is None and gpu_memory is None:
            gpu_memory = min(g.total for g in gpus)  # plan for this host's GPUs, not the table's default
        plan = check_plan(step, values, report, num_gpus=num_gpus, nodes=nodes, gpu_memory=gpu_memory, gpu=gpu)
        check_gpus(plan, gpus, num_gpus, report)
        check_output(step, cfg, report, plan, paths)
        check_sampler(cfg, report, connect_timeout, gpus, num_gpus)
    check_launcher(report, hostfile, master_port, connect_timeout)
    return report.findings
