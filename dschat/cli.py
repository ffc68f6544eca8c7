"""The ``dschat`` command line: ``train``, ``pipeline``, ``data inspect``, ``eval``, ...

Stage flags are generated from the stage's config dataclass (``dschat.config``); ``dschat train --step N``
forwards its arguments to the stage command, in-process or under the ``deepspeed`` launcher.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import click
from click.core import ParameterSource

from dschat.config import build_config, canonical_names, flag_specs, load_config_file, refuse_inert
from dschat.errors import UserError
from dschat.options import click_option

STAGE_MODULES = {1: "step1_sft.main", 2: "step2_reward.main", 3: "step3_rlhf.main"}


def stage_command(name: str, config_cls: type, run: Callable[[Any], Any], help: str) -> click.Command:
    """A click command whose options are the flags of ``config_cls``; ``--config FILE`` fills any of them.

    Precedence: dataclass default < config file < command line. A flag given (in either) that has no effect in
    the chosen mode stops the run before anything loads (``refuse_inert``); defaults never count as given.
    """
    params: list[click.Parameter] = [
        click.Option(["--config", "config_file"], type=click.Path(dir_okay=False),
                     help="YAML or JSON file holding any of these flags (command line wins).")
    ]
    params += [click_option(s) for s in flag_specs(config_cls)]

    def callback(config_file: str | None, **kwargs: Any) -> Any:
        ctx = click.get_current_context()
        names = canonical_names(config_cls)
        sections = {f.name for f in dataclasses.fields(config_cls)}
        from_file = load_config_file(config_file, sections) if config_file else {}
        values = {names.get(k, k): v for k, v in from_file.items()}
        for key, value in kwargs.items():
            if ctx.get_parameter_source(key) == ParameterSource.COMMANDLINE:
                values[key] = list(value) if isinstance(value, tuple) else value
        cfg = build_config(config_cls, values)
        refuse_inert(cfg, set(values))  # before any data or model loads
        result = run(cfg)
        from dschat.engine import teardown_distributed  # the stage has imported it already

        teardown_distributed()
        return result

    return click.Command(name, params=params, callback=callback, help=help,
                         context_settings={"max_content_width": 110})


def run_command(cmd: click.Command, argv: list[str] | None = None) -> None:
    """Run a click command; user errors become one line on stderr and exit code 2, never a traceback."""
    try:
        cmd.main(args=argv, standalone_mode=False)
    except UserError as e:
        click.echo(f"dschat: error: {e}", err=True)
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)


def stage_module(step: int) -> Any:
    return importlib.import_module(STAGE_MODULES[step])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    cmd += ["--master_port", str(master_port or _free_port())]
    cmd += list(launcher_args)
    return cmd + [script] + args


# The subcommands beyond `train`, each defined in its own module (which never imports this one): name ->
# "module:attribute". A module is imported when its command is used (or listed by --help), so `dschat train` and
# `import dschat.cli` do not pay for the others.
COMMANDS = {
    "chat": "dschat.chat:chat_command",
    "data": "dschat.commands:data",
    "eval": "dschat.eval_cmd:eval_command",
    "export": "dschat.export:export",
    "judge": "dschat.judge_cmd:judge_command",
    "pipeline": "dschat.pipeline:pipeline",
}


class LazyGroup(click.Group):
    """A click group that adds the commands of ``COMMANDS`` (``main.add_command``) when first asked for them."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(COMMANDS))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            module, attr = COMMANDS[cmd_name].split(":")
            self.add_command(getattr(importlib.import_module(module), attr), cmd_name)
        return super().get_command(ctx, cmd_name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="dschat")
def main() -> None:
    """dschat: a three-stage RLHF pipeline (SFT -> reward model -> PPO/GRPO) on DeepSpeed."""


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                "help_option_names": []})
@click.option("--step", type=click.IntRange(1, 3), help="Stage to run: 1 SFT, 2 reward model, 3 RLHF.")
@click.option("--num-gpus", "--num_gpus", "num_gpus", type=int, default=None,
              help="Run under the deepspeed launcher with N local ranks (CPU ranks when there is no GPU).")
@click.option("--hostfile", default=None, help="Run under the deepspeed launcher on the hosts of this hostfile.")
@click.option("--master-port", "--master_port", "master_port", type=int, default=None,
              help="Rendezvous port for the launcher (default: a free port).")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def train(step: int | None, num_gpus: int | None, hostfile: str | None, master_port: int | None,
          args: tuple[str, ...]) -> None:
    """Train one stage: dschat train --step N [stage flags...]; add --help after --step N for its flags."""
    if step is None:
        if any(a in ("-h", "--help") for a in args):
            click.echo(click.get_current_context().get_help())
            return
        raise UserError("missing --step (1 SFT, 2 reward model, 3 RLHF)")
    module = stage_module(step)
    if num_gpus or hostfile:
        cmd = launcher_argv(module.__file__, list(args), num_gpus, hostfile, master_port)
        click.echo("launching: " + " ".join(cmd), err=True)
        rc = subprocess.call(cmd)
        if rc != 0:
            sys.exit(rc)
        return
    module.command.main(args=list(args), standalone_mode=False)


def cli() -> None:
    """Console-script entry point."""
    run_command(main)
