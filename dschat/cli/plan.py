"""``dschat plan --step N [stage flags]``: per-GPU memory and time of a stage, from its flags and the models'
config files alone (``dschat.planning``); ``dschat train --step N ... --plan`` prints the same and stops.

Exit code 0 when the run fits, 3 when it does not (2 for a user error, as every command).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click
from click.core import ParameterSource

from dschat.config import canonical_names, flag_specs, load_config_file
from dschat.errors import ExitCode, UserError

NO_FIT_EXIT = ExitCode.DOES_NOT_FIT


def stage_values(step: int, args: list[str]) -> dict[str, Any]:
    """The flat ``{flag name: value}`` of the stage flags ``args`` (and ``--config FILE``) as ``dschat train
    --step N`` parses them: its generated options, file below command line; only the flags given."""
    import dataclasses

    from dschat.cli.options import declared_options
    from dschat.planning.plan import config_class

    cls = config_class(step)
    out: dict[str, Any] = {}

    def callback(config_file: str | None, **kwargs: Any) -> None:
        ctx = click.get_current_context()
        names = canonical_names(cls)
        if config_file:
            sections = {f.name for f in dataclasses.fields(cls)}
            out.update({names.get(k, k): v for k, v in load_config_file(config_file, sections).items()})
        for key, value in kwargs.items():
            if ctx.get_parameter_source(key) == ParameterSource.COMMANDLINE:
                out[key] = list(value) if isinstance(value, tuple) else value

    params: list[click.Parameter] = [click.Option(["--config", "config_file"], type=click.Path(dir_okay=False),
                                                  help="YAML or JSON file holding any of these flags.")]
    cmd = click.Command(f"plan --step {step}", params=params + declared_options(flag_specs(cls)), callback=callback,
                        context_settings={"max_content_width": 110})
    cmd.main(args=args, prog_name=f"dschat plan --step {step}", standalone_mode=False)
    return out


def print_plan(step: int, args: list[str], *, num_gpus: int = 1, nodes: int = 1, gpu_memory: str | None = None,
               gpu: str | None = None, rows: int | None = None, as_json: bool = False) -> int:
    """Parse the stage flags, plan, print (text or JSON); the exit code (0 fits, 3 does not)."""
    from dschat.planning import make_plan, parse_bytes

    values = stage_values(step, args)
    plan = make_plan(step, values, num_gpus=num_gpus, nodes=nodes,
                     gpu_memory=parse_bytes(gpu_memory) if gpu_memory else None, gpu=gpu, rows=rows)
    click.echo(json.dumps(plan.to_json(), indent=2) if as_json else plan.table())
    return 0 if plan.fits else NO_FIT_EXIT


@click.command("plan", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                         "help_option_names": []})
@click.option("--step", type=click.IntRange(1, 3), help="Stage to plan: 1 SFT, 2 reward model, 3 RLHF.")
@click.option("--num-gpus", "--num_gpus", "num_gpus", type=click.IntRange(min=1), default=1, show_default=True,
              help="GPUs per node.")
@click.option("--nodes", type=click.IntRange(min=1), default=1, show_default=True, help="Nodes.")
@click.option("--gpu", default=None, help="GPU model from the planner's table (A100-40GB, A100-80GB, H100-80GB, "
                                          "H200, L40S, L4, A10G, RTX 4090, V100-32GB), or CPU (ranks on this "
                                          "host's cores, sharing its memory); default A100-80GB.")
@click.option("--gpu-memory", "--gpu_memory", "gpu_memory", default=None,
              help="Memory per GPU, e.g. 80GiB or 40GB (overrides --gpu's).")
@click.option("--rows", type=click.IntRange(min=1), default=None,
              help="Rows in the dataset (before --data-split), for the run's time without --max-steps.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as one JSON object.")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def plan_command(step: int | None, num_gpus: int, nodes: int, gpu: str | None, gpu_memory: str | None,
                 rows: int | None, as_json: bool, args: tuple[str, ...]) -> None:
    """Per-GPU memory by model and phase, whether it fits (else the cheapest change that does) and a time
    estimate: dschat plan --step N [stage flags...], the flags of dschat train --step N; add --help after
    --step N for them. Loads no weights. Exit code 0 fits, 3 does not."""
    ctx = click.get_current_context()
    if any(a in ("-h", "--help") for a in args):
        if step is not None:
            stage_values(step, ["--help"])
        click.echo(ctx.get_help())
        return
    if step is None:
        raise UserError("missing --step (1 SFT, 2 reward model, 3 RLHF)")
    code = print_plan(step, list(args), num_gpus=num_gpus, nodes=nodes, gpu_memory=gpu_memory, gpu=gpu, rows=rows,
                      as_json=as_json)
    if code:
        sys.exit(code)  # not ctx.exit: a group run with standalone_mode=False returns that code instead of exiting
