"""A run's tools and environments, built from its flags (``AgentArgs``) without torch, so the flag checks load and
check them before any model does."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dschat.agents.calls import CALL_CLOSE
from dschat.agents.env import EnvHosts, EnvSession, LocalSession
from dschat.agents.tools import ERROR_KINDS, Tool, ToolRunner
from dschat.agents.worker import ERROR_KINDS_ENV
from dschat.errors import UserError


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
    _closers: dict[int, set[int]] = field(default_factory=dict, repr=False)
    _hosts: EnvHosts | None = field(default=None, repr=False)
    env_counts: dict[str, int] = field(default_factory=lambda: {"truncated": 0, **{k: 0 for k in ERROR_KINDS_ENV}},
                                       repr=False)

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

    _totals: dict[str, float] = field(default_factory=dict, repr=False)
    _runner_seen: dict[str, int] = field(default_factory=dict, repr=False)
    _env_seen: dict[str, int] = field(default_factory=dict, repr=False)

    def record(self, episodes: int, turns: int, calls: int, errors: int, policy_tokens: int,
               context_tokens: int) -> None:
        """Add a sampled batch of episodes to what ``take_metrics`` reports."""
        for k, v in (("episodes", episodes), ("turns", turns), ("calls", calls), ("errors", errors),
                     ("policy_tokens", policy_tokens), ("context_tokens", context_tokens)):
            self._totals[k] = self._totals.get(k, 0) + v

    def take_metrics(self) -> dict[str, float]:
        """Since the last call: per episode the turns, tool calls and errors (a tool's or an environment's, and
        malformed calls), the share of the episodes' tokens that are context (masked from the loss), and the
        runner's counts by kind (``episode/tool_<kind>``); empty when no episode ran."""
        t, self._totals = self._totals, {}
        counts = dict(self.runner.counts)
        seen, self._runner_seen = self._runner_seen, counts
        if not t.get("episodes"):
            return {}
        n, tokens = t["episodes"], t["policy_tokens"] + t["context_tokens"]
        out = {"episode/turns": t["turns"] / n, "episode/tool_calls": t["calls"] / n,
               "episode/tool_errors": t["errors"] / n,
               "episode/masked_token_frac": t["context_tokens"] / tokens if tokens else 0.0}
        for kind in (*ERROR_KINDS, "truncated"):
            out[f"episode/tool_{kind}"] = float(counts.get(kind, 0) - seen.get(kind, 0))
        if self.envs:
            env, env_seen = dict(self.env_counts), self._env_seen
            self._env_seen = env
            for kind in (*ERROR_KINDS_ENV, "truncated"):
                out[f"episode/env_{kind}"] = float(env.get(kind, 0) - env_seen.get(kind, 0))
        return out

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


