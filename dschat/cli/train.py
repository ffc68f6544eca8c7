"""``dschat train --step N``: run one stage, in-process or under the ``deepspeed`` launcher."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from typing import Any

import click

from dschat.errors import UserError
from dschat.utils import free_port

STAGE_MODULES = {1: "step1_sft.main", 2: "step2_reward.main", 3: "step3_rlhf.main"}


def stage_module(step: int) -> Any:
    return importlib.import_module(STAGE_MODULES[step])


def launcher_argv(script: str, args: list[str], num_gpus: int | None, hostfile: str | None,
                  master_port: int | None, launcher_args: tuple[str, ...] = ()) -> list[str]:
    """The ``deepspeed`` launcher command that runs ``script args`` on N local devices or a hostfile."""
    exe = shutil.which("deepspeed")
    cmd = [exe] if exe else [sys.executable, "-m", "deepspeed.launcher.runner"]
    if hostfile:
        if not os.path.isfile(hostfile):
            raise UserError(f"{hostfile}: hostfile not found")
        cmd += ["--hostfile", hostfile]
    if num_gpus:
        cmd += ["--num_gpus", str(num_gpus)]
    cmd += ["--master_port", str(master_port or free_port())]
    cmd += list(launcher_args)
    return cmd + [script] + args


@click.command("train", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                "help_option_names": []})
@click.option("--step", type=click.IntRange(1, 3), help="Stage to run: 1 SFT, 2 reward model, 3 RLHF.")
@click.option("--num-gpus", "--num_gpus", "num_gpus", type=int, default=None,
              help="Run under the deepspeed launcher with N local ranks (CPU ranks when there is no GPU).")
@click.option("--hostfile", default=None, help="Run under the deepspeed launcher on the hosts of this hostfile.")
@click.option("--master-port", "--master_port", "master_port", type=int, default=None,
              help="Rendezvous port for the launcher (default: a free port).")
@click.option("--plan", is_flag=True, help="Print the per-GPU memory and time plan of these flags (as dschat plan "
                                            "does) and stop before loading anything; exit code 3 if it does not fit.")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def train(step: int | None, num_gpus: int | None, hostfile: str | None, master_port: int | None, plan: bool,
          args: tuple[str, ...]) -> None:
    """Train one stage: dschat train --step N [stage flags...]; add --help after --step N for its flags."""
    if step is None:
        if any(a in ("-h", "--help") for a in args):
            click.echo(click.get_current_context().get_help())
            return
        raise UserError("missing --step (1 SFT, 2 reward model, 3 RLHF)")
    if plan:  # before the stage module is imported: nothing loads
        from dschat.cli.plan import print_plan

        code = print_plan(step, list(args), num_gpus=num_gpus or 1)
        if code:
            sys.exit(code)
        return
    module = stage_module(step)
    if num_gpus or hostfile:
        cmd = launcher_argv(module.__file__, list(args), num_gpus, hostfile, master_port)
        click.echo("launching: " + " ".join(cmd), err=True)
        rc = subprocess.call(cmd)
        if rc != 0:
            sys.exit(rc)
        return
    module.command.main(args=list(args), standalone_mode=False)


