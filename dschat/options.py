"""Click options generated from flag declarations (``dschat.config``): every option of ``dschat train --step N``,
and the options ``dschat eval`` shares with the stages, so a flag's name, help, default, choices and range live
in its dataclass field only. Part of the CLI layer (it imports click); the library never imports it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from dschat.config import FlagSpec, flag_specs


def click_option(spec: FlagSpec) -> click.Option:
    """The click option of one declared flag: ``--name`` and ``--name_with_underscores``, its aliases, and
    ``--no-name`` for booleans."""
    dash = spec.name.replace("_", "-")
    help_text = spec.help
    if spec.type is bool:
        decls = [f"--{dash}/--no-{dash}"]
        if dash != spec.name:
            decls.append(f"--{spec.name}/--no_{spec.name}")
        return click.Option(decls + [spec.name], default=spec.default, help=help_text, hidden=spec.hidden,
                            show_default=True)
    decls = [f"--{dash}"] + ([f"--{spec.name}"] if dash != spec.name else [])
    decls += [d for a in spec.aliases for d in dict.fromkeys((f"--{a.replace('_', '-')}", f"--{a}"))]
    if spec.type is list:
        return click.Option(decls + [spec.name], multiple=True, help=help_text, hidden=spec.hidden)
    ptype: Any = click.Choice(spec.choices) if spec.choices else spec.type
    return click.Option(decls + [spec.name], type=ptype, default=spec.default, help=help_text,
                        hidden=spec.hidden, show_default=spec.default is not None and spec.default != "")


class DeclaredFlagsCommand(click.Command):
    """A click command that also takes the flags of a config class (a dataclass of pieces, as a stage config),
    generated from their declarations when the command parses its arguments or shows its help, not when it is
    defined: ``flags`` is a function returning the class, so a declaration whose module is slow to import
    (stage 3's pieces import deepspeed) costs nothing to ``dschat --help``. The callback receives the flags by
    name."""

    def __init__(self, *args: Any, flags: Callable[[], type], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._flags: Callable[[], type] | None = flags

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        if self._flags is not None:
            self.params.extend(click_option(s) for s in flag_specs(self._flags()))
            self._flags = None
        return super().get_params(ctx)
