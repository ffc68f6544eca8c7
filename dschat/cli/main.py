"""The ``dschat`` command group: every subcommand is a module of ``dschat.cli``, imported when it is used.

``dschat train --step N`` (``dschat.cli.train``) forwards its arguments to the stage command, in-process or under
the ``deepspeed`` launcher; stage flags are generated from the stage's config dataclass (``dschat.config``, by
``dschat.cli.options``).
"""

from __future__ import annotations

import importlib

import click

from dschat.cli.options import run_command

__all__ = ["COMMANDS", "cli", "main"]

# The subcommands, each defined in its own module of dschat.cli (which never imports this one): name ->
# "module:attribute". A module is imported when its command is used (or listed by --help), so `dschat train` does
# not pay for the others.
COMMANDS = {
    "train": "dschat.cli.train:train",
    "chat": "dschat.cli.chat:chat_command",
    "data": "dschat.cli.data:data",
    "doctor": "dschat.cli.doctor:doctor_command",
    "eval": "dschat.cli.eval:eval_command",
    "export": "dschat.cli.export:export",
    "generate": "dschat.cli.generate:generate_command",
    "judge": "dschat.cli.judge:judge_command",
    "pipeline": "dschat.cli.pipeline:pipeline",
    "plan": "dschat.cli.plan:plan_command",
    "report": "dschat.cli.report:report_command",
    "sampler": "dschat.cli.sampler:sampler_command",
    "serve": "dschat.cli.serve:serve_command",
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


def cli() -> None:
    """Console-script entry point."""
    run_command(main)
