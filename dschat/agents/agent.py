"""A run's tools and environments, built from its flags (``AgentArgs``) without torch, so the flag checks load and
check them before any model does."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any

from dschat.agents.calls import CALL_CLOSE
from dschat.agents.env import EnvHosts, EnvSession, LocalSession
from dschat.agents.tools import ERROR_KINDS, Tool, ToolRunner
from dschat.agents.worker import ERROR_KINDS_ENV
from dschat.errors import UserError


@dataclass
class EpisodeCounts:
    """What episodes did, added up: one row's (``Episodes``), a batch's, and a run's since its metrics were last
    taken (``Agent.counts``). ``kinds`` counts tool results and environment replies by kind (``tool_<kind>``: one of
    ``ERROR_KINDS`` or ``truncated``; ``env_<kind>``: one of ``ERROR_KINDS_ENV`` or ``truncated``)."""

    episodes: int = 0
    turns: int = 0
    calls: int = 0  # tool calls, malformed ones too
    errors: int = 0  # tool errors (malformed calls too) and environment errors
    policy_tokens: int = 0
    context_tokens: int = 0  # tool results and observations: fed, never trained on
    kinds: Counter[str] = field(default_factory=Counter)

    def __iadd__(self, other: EpisodeCounts) -> EpisodeCounts:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def metrics(self, with_env: bool) -> dict[str, float]:
        """Per episode the turns, tool calls and errors, the share of the episodes' tokens that are context
        (masked from the loss), and the counts by kind (``episode/tool_<kind>``, ``episode/env_<kind>`` where
        the run has environments); empty when no episode ran."""
        if not self.episodes:
            return {}
        n, tokens = self.episodes, self.policy_tokens + self.context_tokens
        out = {"episode/turns": self.turns / n, "episode/tool_calls": self.calls / n,
               "episode/tool_errors": self.errors / n,
               "episode/masked_token_frac": self.context_tokens / tokens if tokens else 0.0}
        for kind in (*ERROR_KINDS, "truncated"):
            out[f"episode/tool_{kind}"] = float(self.kinds[f"tool_{kind}"])
        if with_env:
            for kind in (*ERROR_KINDS_ENV, "truncated"):
                out[f"episode/env_{kind}"] = float(self.kinds[f"env_{kind}"])
        return out


@dataclass
class Agent:
    """A run's tools and environments (``AgentArgs`` built): what ``Episodes`` needs besides the batch. ``envs``
    maps each name to an ``EnvClass`` (loaded from a file: it runs in worker processes) or to a class (run in this
    process); environments share the runner's deadline and output cap."""

    tools: list[Tool]
    runner: ToolRunner
    envs: dict[str, Any]
    env_column: str
    max_turns: int
    # the run's episodes since ``take_metrics`` last emptied it (stage 3 adds each sampled batch's)
    counts: EpisodeCounts = field(default_factory=EpisodeCounts, repr=False)
    said_env_error: bool = field(default=False, repr=False)  # the first environment error is printed, once a run
    _closers: dict[int, set[int]] = field(default_factory=dict, repr=False)
    _hosts: EnvHosts | None = field(default=None, repr=False)

    def env_name(self, fields: dict[str, Any], where: str = "") -> str | None:
        """The environment of a row with these fields: none without --env, the only one, or the one the row's
        ``env_column`` names (else a one-line error naming the row, ``where``, and the field)."""
        if not self.envs:
            return None
        if len(self.envs) == 1:
            return next(iter(self.envs))
        name = fields.get(self.env_column)
        if not isinstance(name, str) or name not in self.envs:
            raise UserError(f"{where + ': ' if where else ''}data column {self.env_column!r}: {str(name)[:60]!r} names "
                            f"no --env (environments: {', '.join(self.envs)})")
        return name

    def check_rows(self, rows: list[dict[str, Any]]) -> None:
        """Every row's environment is one of --env: checked on a phase's rows (their ``extra`` fields, ``where``
        they come from) before anything trains or samples, so a bad row stops the run at its start, not at the
        step that first draws it."""
        for row in rows:
            self.env_name(row.get("extra") or {}, str(row.get("where", "")))

    def warm(self) -> None:
        """Start the tools' workers now, in the background (``ToolRunner.warm``)."""
        self.runner.warm()

    def open_env(self, name: str) -> EnvSession | LocalSession:
        """A new episode of the environment ``name`` (not yet reset)."""
        if self._hosts is None:
            self._hosts = EnvHosts(self.envs, self.runner.timeout, self.runner.max_output)
        return self._hosts.open(name)

    def close(self) -> None:
        """Kill every tool and environment worker (the run's end does too); later episodes start fresh ones."""
        self.runner.close()
        if self._hosts is not None:
            self._hosts.close()

    def may_close(self, tokenizer: Any) -> set[int]:
        """The ids whose text may end a call (``</tool_call>``'s last character), once per tokenizer: only after
        one of them is a turn decoded to look for the marker."""
        key = id(tokenizer)
        if key not in self._closers:
            last = CALL_CLOSE[-1]
            pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
            self._closers[key] = {i for i, p in enumerate(pieces) if p and last in p}
        return self._closers[key]

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tools]

    def take_metrics(self) -> dict[str, float]:
        """The episodes' metrics since the last call (``EpisodeCounts.metrics``), and the counts emptied."""
        counts, self.counts = self.counts, EpisodeCounts()
        return counts.metrics(with_env=bool(self.envs))

    def describe(self) -> str:
        parts = []
        if self.tools:
            parts.append(f"tools {', '.join(t.name for t in self.tools)}")
        if self.envs:
            parts.append(f"env {', '.join(self.envs)}")
        return f"{' and '.join(parts)}, at most {self.max_turns} turns"


def build_agent(args: Any) -> Agent | None:
    """The ``Agent`` of ``AgentArgs`` (None without ``--tools`` and ``--env``)."""
    from dschat.agents.env import load_envs
    from dschat.agents.tools import load_tools

    if not args.tools and not args.env:
        return None
    tools = load_tools(list(args.tools))
    return Agent(tools, ToolRunner(tools, args.tool_timeout, args.tool_max_output), load_envs(list(args.env)),
                 args.env_column, args.max_turns)


