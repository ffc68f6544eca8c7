"""Click options generated from flag declarations (``dschat.config``): every option of ``dschat train --step N``,
and the options ``dschat eval``, ``dschat chat`` and ``dschat judge`` share with the stages, so a flag's name,
help, default, choices and range live in its dataclass field only; ``stage_command`` (a whole command from a
config class: the stages', ``dschat generate``), ``declared_config`` (the config of a command's declared flags, a
flag given that does nothing refused) and ``run_command`` (user errors as one line, exit code 2). Part of the CLI
layer (it imports click); the library never imports it. Its own module, not ``dschat.cli.main``, so a command under
``dschat/`` can use it without an import cycle through the commands ``dschat.cli.main`` loads by name.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any

import click
from click.core import ParameterSource

from dschat.config import FlagSpec, build_config, canonical_names, flag_specs, load_config_file, refuse_inert
from dschat.errors import ExitCode, UserError


class SiblingChoice(click.Choice):
    """A flag's choices that, when a value is refused, name the command's other flags that take it: ``--algo dpo
    --loss-type ipo`` says that ``--dpo-loss-type`` takes ``ipo`` (each algorithm declares its own loss flag)."""

    def __init__(self, choices: Sequence[str], siblings: dict[str, Sequence[str]]):
        super().__init__(choices)
        self.siblings = siblings  # flag -> its choices, for every choice flag of the command

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            return super().convert(value, param, ctx)
        except click.BadParameter as e:
            own = param.opts[0] if param is not None else ""
            takers = [flag for flag, choices in self.siblings.items() if flag != own and value in choices]
            if not takers:
                raise
            self.fail(f"{e.message.rstrip('.')}; {', '.join(takers)} takes {value!r}", param, ctx)


def declared_options(specs: Sequence[FlagSpec]) -> list[click.Option]:
    """The click options of a command's declared flags (``click_option``), their choices aware of each other."""
    siblings = {f"--{s.name.replace('_', '-')}": list(s.choices) for s in specs if s.choices}
    return [click_option(s, siblings) for s in specs]


def click_option(spec: FlagSpec, siblings: dict[str, Sequence[str]] | None = None) -> click.Option:
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
    ptype: Any = SiblingChoice(spec.choices, siblings or {}) if spec.choices else spec.type
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
            self.params.extend(declared_options(flag_specs(self._flags())))
            self._flags = None
        return super().get_params(ctx)


def given_flags() -> dict[str, str]:
    """The flags given on the running command's command line: parameter name -> its spelling for messages."""
    ctx = click.get_current_context()
    return {p.name: p.opts[0] for p in ctx.command.get_params(ctx)
            if p.name and ctx.get_parameter_source(p.name) == ParameterSource.COMMANDLINE}


def refuse_given(given: dict[str, str], inert: dict[str, str]) -> None:
    """Stop on the first flag ``given`` (``given_flags``) that ``inert`` names (parameter name -> why it does
    nothing here): one line, exit code 2."""
    for name, why in sorted(inert.items()):
        if name in given:
            raise UserError(f"{given[name]} has no effect {why}")


def declared_config(config_cls: type, values: dict[str, Any], given: dict[str, str]) -> Any:
    """The config of a ``DeclaredFlagsCommand``'s declared flags from its callback's ``values``: the flags
    ``given`` on the command line, the others at their declared defaults (the command's own, where its piece sets
    them). A given flag that does nothing in the chosen mode stops before anything loads, as in the stages
    (``refuse_inert``: the pieces' ``inert_fields``, the class's ``inert_flags``)."""
    names = {s.name for s in flag_specs(config_cls)}
    picked = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items() if k in names and k in given}
    cfg = build_config(config_cls, picked)
    refuse_inert(cfg, set(picked))
    return cfg


def stage_command(name: str, config: type | Callable[[], type], run: Callable[[Any], Any],
                  help: str) -> click.Command:
    """A click command whose options are the flags of a config class; ``--config FILE`` fills any of them.

    Precedence: dataclass default < config file < command line. A flag given (in either) that has no effect in
    the chosen mode stops the run before anything loads (``refuse_inert``); defaults never count as given.
    ``config`` is the class, or a function returning it: then its module is imported when the command parses its
    arguments or shows its own help (``DeclaredFlagsCommand``), not when ``dschat --help`` lists it
    (``dschat generate``'s config imports stage 3, so torch and deepspeed).
    """
    config_of: Callable[[], type] = (lambda: config) if isinstance(config, type) else config
    params: list[click.Parameter] = [
        click.Option(["--config", "config_file"], type=click.Path(dir_okay=False),
                     help="YAML or JSON file holding any of these flags (command line wins).")
    ]

    def callback(config_file: str | None, **kwargs: Any) -> Any:
        config_cls = config_of()
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
        result = run_with_rollbacks(run, cfg)
        from dschat.engine import teardown_distributed  # the stage has imported it already

        teardown_distributed()
        return result

    settings = {"max_content_width": 110}
    if not isinstance(config, type):
        return DeclaredFlagsCommand(name, params=params, callback=callback, help=help, context_settings=settings,
                                    flags=config)
    params += declared_options(flag_specs(config))
    return click.Command(name, params=params, callback=callback, help=help, context_settings=settings)


def run_with_rollbacks(run: Callable[[Any], Any], cfg: Any) -> Any:
    """``run(cfg)``; a health alarm's rollback (``dschat.training.health.Rollback``: the state to return to is
    ``latest`` now) runs it again in this process, resuming from that state."""
    import gc

    from dschat.training.health import Rollback

    while True:
        try:
            return run(cfg)
        except Rollback:  # the rollback's decision is in the output folder, beside the state it names
            pass
        gc.collect()  # the engines of the rolled-back attempt go before the next one is built
        cfg.run.resume = True


def run_command(cmd: click.Command, argv: list[str] | None = None) -> None:
    """Run a click command; user errors become one line on stderr and their exit code (``dschat.errors.ExitCode``:
    2 for a mistake in the input), never a traceback."""
    try:
        cmd.main(args=argv, standalone_mode=False)
    except UserError as e:
        click.echo(f"dschat: error: {e}", err=True)
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(ExitCode.USAGE)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(ExitCode.INTERRUPTED)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(ExitCode.INTERRUPTED)
