"""``dschat doctor --step N [stage flags]``: check a planned run without training (``dschat.doctor``).

The stage flags are parsed as ``dschat train --step N`` parses them (``stage_values``, shared with ``dschat
plan``): the same flags, spellings, types and ``--config FILE``. The checks run in the library; this module
prints one line per finding and exits 1 when any is an error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys

import click

from dschat.errors import ExitCode, UserError

SEVERITY_WIDTH, CHECK_WIDTH = 5, 9


@click.command("doctor", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                           "help_option_names": []})
@click.option("--step", type=click.IntRange(1, 3), help="Stage to check: 1 SFT, 2 reward model, 3 RLHF.")
@click.option("--hostfile", default=None, help="DeepSpeed hostfile of the run ('host slots=N' lines): every host "
                                               "must resolve and be this machine or answer on ssh.")
@click.option("--master-port", "--master_port", "master_port", type=int, default=None,
              help="Rendezvous port of the run: checked free on this machine.")
@click.option("--num-gpus", "--num_gpus", "num_gpus", type=int, default=None, help="GPUs per node, for the plan.")
@click.option("--nodes", type=int, default=None, help="Nodes, for the plan (default: the hostfile's hosts, else 1).")
@click.option("--gpu-memory", "--gpu_memory", "gpu_memory", default=None,
              help="Memory of each GPU for the plan (e.g. 80GiB).")
@click.option("--gpu", default=None, help="GPU model for the plan (e.g. A100-80GB, H100).")
@click.option("--json", "as_json", is_flag=True, help="Print the findings as a JSON list.")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def doctor_command(step: int | None, hostfile: str | None, master_port: int | None, num_gpus: int | None,
                   nodes: int | None, gpu_memory: str | None, gpu: str | None, as_json: bool,
                   args: tuple[str, ...]) -> None:
    """Check a planned run without training: dschat doctor --step N [the flags of dschat train --step N].

    Prints one line per finding (ok, warn, error): the flags, the model folders, the tokenizer and chat
    template, the data, the memory plan, the output folder and the launcher. Exits 1 when any finding is an
    error, else 0 (docs/doctor.md).
    """
    ctx = click.get_current_context()
    if any(a in ("-h", "--help") for a in args) or step is None:
        if step is None and not args:
            raise UserError("missing --step (1 SFT, 2 reward model, 3 RLHF)")
        click.echo(ctx.get_help())
        if step is not None:
            from dschat.cli.train import stage_module

            with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's import-time log line
                command = stage_module(step).command
            click.echo(f"\nStage {step} flags (as dschat train --step {step}):\n")
            click.echo(command.get_help(click.Context(command, info_name=f"dschat doctor --step {step}")))
        return
    from dschat.cli.plan import stage_values
    from dschat.doctor import ERROR, Finding, run_doctor

    memory = None
    if gpu_memory is not None:
        from dschat.planning import parse_bytes

        memory = parse_bytes(gpu_memory)
    # What the libraries print while loading (DeepSpeed logs to stdout) goes to stderr: stdout is the report.
    with contextlib.redirect_stdout(sys.stderr):
        try:
            values = stage_values(step, list(args))  # as dschat train --step N parses them
        except (click.UsageError, UserError) as e:
            findings = [Finding("flags", ERROR, e.format_message() if isinstance(e, click.UsageError) else str(e))]
        else:
            from dschat.demo import demo_data

            # Without --data the stage trains on its main's default (the demo corpus); the doctor reads the same.
            findings = run_doctor(step, values, hostfile=hostfile, master_port=master_port, num_gpus=num_gpus,
                                  nodes=nodes, gpu_memory=memory, gpu=gpu,
                                  default_data=demo_data)
    if as_json:
        click.echo(json.dumps([dataclasses.asdict(f) for f in findings], ensure_ascii=False, indent=1))
    else:
        for f in findings:
            click.echo(f"{f.severity:<{SEVERITY_WIDTH}} {f.check:<{CHECK_WIDTH}} {f.message}")
        tally = {s: sum(f.severity == s for f in findings) for s in ("ok", "warn", "error")}
        click.echo(f"doctor: {tally['ok']} ok, {tally['warn']} warning(s), {tally['error']} error(s)")
    if any(f.severity == ERROR for f in findings):
        sys.exit(ExitCode.FAILED)
