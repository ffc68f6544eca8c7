"""Environments (``--env FILE.py:Class``): multi-turn episodes where something answers the assistant's turns.

An environment is a class with two methods; dschat makes one instance per episode (``Class()``, no arguments)::

    class Guess:
        def reset(self, row: dict) -> str | None:
            '''Start an episode from its data row (every field of the row: ``prompt``, ``answer``, ...). Return
            text to put before the assistant's first turn (context, not trained on), or None.'''

        def step(self, text: str) -> tuple[str | None, float, bool]:
            '''The assistant's finished turn (decoded, special tokens dropped) -> (the next observation, the
            reward of this turn, whether the episode is done). The observation becomes the user's turn.'''

``reset()`` without a row is taken too (the row goes to a required first parameter, or to one named ``row``), and
either method may be ``async``. The shape is checked when the class loads: an ``__init__`` that needs arguments, a
``reset`` or ``step`` that takes more, stop the run with one line that says how to adapt it.

The episode's environment reward is the sum of its turns' rewards; it is the reward source ``env``
(``--reward-funcs env``, the default with ``--env``), which ``--reward-funcs`` may mix with rule, model or remote
sources. An environment loaded from a file runs in worker processes of its own (``dschat.agents.worker``), each
``reset`` and ``step`` under ``--tool-timeout`` and each observation cut at ``--tool-max-output`` characters. One
that raises, runs past the deadline, ends its process or returns something other than ``(text or None, a finite
number, a bool)`` ends its episode with the rewards it gave so far, counted as an error.

Several environments: ``--env NAME=FILE.py:Class`` (repeatable), and each row names its own in the data column
``--env-column`` (default ``env``); with one ``--env`` every row takes it.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass
from typing import Any

from dschat.agents.worker import (
    ERROR_KINDS_ENV,
    EnvPool,
    Job,
    Slot,
    clean,
    env_new,
    env_reset,
    env_step,
    probe,
    worker_spec,
)
from dschat.errors import UserError
from dschat.userfiles import load_object, split_label


@dataclass
class EnvStep:
    """A step's result, as a class may return it instead of the tuple."""

    observation: str | None
    reward: float
    done: bool


@dataclass
class EnvClass:
    """An environment loaded from ``path:name``: the class, and how its ``reset`` takes the row."""

    cls: type
    path: str
    name: str
    takes_row: str  # positional | keyword | none


def _params(cls: type, method: str) -> list[inspect.Parameter] | None:
    """The parameters of ``cls.method`` after ``self`` (None when inspect cannot read them)."""
    raw = inspect.getattr_static(cls, method, None)
    try:
        params = list(inspect.signature(getattr(cls, method)).parameters.values())
    except (TypeError, ValueError):
        return None
    if inspect.isfunction(raw) and params:
        params = params[1:]
    return params


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def env_shape(cls: Any, what: str) -> str:
    """Check that ``cls`` is an environment dschat can drive, and how its ``reset`` takes the row: ``positional``
    (a required first parameter), ``keyword`` (an optional one named ``row``) or ``none`` (``reset()``). One-line
    ``UserError`` otherwise, saying how to adapt it."""
    if not inspect.isclass(cls) or not all(callable(getattr(cls, m, None)) for m in ("reset", "step")):
        raise UserError(f"{what}: expected a class with reset(row) and step(text) methods")
    name = cls.__name__
    try:
        init = inspect.signature(cls)
    except (TypeError, ValueError):
        init = None
    if init is not None:
        needs = [p.name for p in init.parameters.values()
                 if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if needs:
            raise UserError(f"{what}: {name}() needs {', '.join(needs)}; dschat makes each episode's environment "
                            f"with no arguments: give them defaults, or subclass it with an __init__ that passes "
                            f"them")
    adapt = "or wrap it in a class whose reset(row) and step(text) call it"
    reset = _params(cls, "reset")
    takes_row = "positional"
    if reset is not None:
        required = [p for p in reset if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if len(required) > 1 or (required and required[0].kind not in _POSITIONAL and required[0].name != "row"):
            raise UserError(f"{what}: {name}.reset needs {', '.join(p.name for p in required)}; dschat calls "
                            f"reset(row) with the data row, or reset(): take one parameter (or none), {adapt}")
        if required:
            takes_row = "positional" if required[0].kind in _POSITIONAL else "keyword"
        elif any(p.name == "row" and p.kind is not p.POSITIONAL_ONLY for p in reset):
            takes_row = "keyword"
        else:
            takes_row = "none"
    step = _params(cls, "step")
    if step is not None:
        required = [p for p in step if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        takes_text = any(p.kind in _POSITIONAL or p.kind is p.VAR_POSITIONAL for p in step)
        if len(required) > 1 or not takes_text or (required and required[0].kind not in _POSITIONAL):
            said = ", ".join(p.name for p in required) or "no argument"
            raise UserError(f"{what}: {name}.step takes {said}; dschat calls step(text) with the assistant's "
                            f"turn and takes (observation, reward, done) back: take one parameter, {adapt}")
    return takes_row


def load_envs(specs: list[str]) -> dict[str, EnvClass]:
    """``--env`` entries by name (``NAME=FILE.py:Class``; without ``NAME=`` the class's name). The file is
    imported in a child process first (``worker.probe``) and the class's shape checked (``env_shape``)."""
    out: dict[str, EnvClass] = {}
    for spec in specs:
        label, source = split_label(spec)
        what = f"--env {spec!r}"
        cls = load_object(source, what, probe=probe)
        takes_row = env_shape(cls, what)
        name = label or cls.__name__
        if name in out:
            raise UserError(f"--env: two environments named {name!r}; name them with NAME=FILE.py:Class")
        path, _, attr = source.rpartition(":")
        out[name] = EnvClass(cls, path, attr, takes_row)
    return out


# ------------------------------------------------------------------------------------------------ running
@dataclass
class EnvReply:
    """What an environment's ``reset`` or ``step`` came to: ``error`` (one of ``ERROR_KINDS_ENV``) with its
    one-line ``message``, or the observation (text or None), the reward and whether the episode is done."""

    error: str | None = None
    message: str = ""
    observation: str | None = None
    reward: float = 0.0
    done: bool = False
    truncated: bool = False


class EnvCall:
    """A ``reset`` or ``step`` in flight: ``done()`` once it is in, ``wait()`` gives its ``EnvReply``."""

    def __init__(self, job: Job, op: str, timeout: float, limit: int, session: Any = None):
        self.job, self.op, self.timeout, self.limit, self.session = job, op, timeout, limit, session
        self.reply: EnvReply | None = None

    def done(self) -> bool:
        return self.reply is not None or self.job.done()

    def wait(self) -> EnvReply:
        if self.reply is None:
            self.reply = self._read(self.job.wait())
            if self.session is not None and self.op == "reset":
                self.session.generation = self.job.generation
        return self.reply

    def _read(self, reply: dict[str, Any]) -> EnvReply:
        """The reply, checked: only plain text, a finite number and a bool come through; any other shape is the
        worker's fault (``crashed``)."""
        kind, message = reply.get("error"), reply.get("message")
        message = clean(message)[:300] if isinstance(message, str) else ""
        if kind is not None:
            kind = kind if kind in ERROR_KINDS_ENV else "crashed"
            said = {"timeout": f"{self.op} timed out after {self.timeout:g} s",
                    "crashed": f"{self.op} failed: {message}",
                    "lost": "the episode's environment was lost: its process was restarted after a fault of "
                            "another episode's"}.get(kind, message)
            return EnvReply(kind, said)
        key = "text" if self.op == "reset" else "observation"
        text, truncated = reply.get(key), reply.get("truncated", False)
        reward, done = reply.get("reward", 0.0), reply.get("done", False)
        if not ((text is None or isinstance(text, str)) and isinstance(truncated, bool) and isinstance(done, bool)
                and isinstance(reward, int | float) and not isinstance(reward, bool) and abs(reward) < float("inf")):
            return EnvReply("crashed", f"{self.op} failed: its process sent a reply that is not one")
        if text is not None:
            text = clean(text)
            truncated = truncated or len(text) > self.limit
            text = text[: self.limit]
        return EnvReply(None, "", text, float(reward), done, truncated)


class EnvSession:
    """One episode's environment in a worker process (``EnvPool``): ``reset``, ``step`` and ``close``."""

    def __init__(self, pool: EnvPool, timeout: float, limit: int):
        self.pool, self.timeout, self.limit = pool, timeout, limit
        self.slot: Slot
        self.slot, self.id = pool.open()
        self.generation: int | None = None
        self.closed = False

    def _submit(self, payload: dict[str, Any], answers: bool = True) -> Job:
        job = Job(payload, answers, None if payload["op"] == "reset" else self.generation)
        self.slot.jobs.put(job)
        return job

    def reset(self, row: dict[str, Any]) -> EnvCall:
        return EnvCall(self._submit({"op": "reset", "id": self.id, "row": row}), "reset", self.timeout, self.limit,
                       self)

    def step(self, text: str) -> EnvCall:
        return EnvCall(self._submit({"op": "step", "id": self.id, "text": text}), "step", self.timeout, self.limit)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.slot.live.discard(self.id)
            self._submit({"op": "close", "id": self.id}, answers=False)


class LocalSession:
    """One episode's environment in this process: a class given as a Python object (not through ``--env``). The
    same checks as in a worker, but no deadline: a hung ``step`` hangs the run."""

    def __init__(self, cls: type, takes_row: str, limit: int):
        self.cls, self.takes_row, self.limit = cls, takes_row, limit
        self.instance: Any = None

    def _done(self, op: str, reply: dict[str, Any]) -> EnvCall:
        return EnvCall(Job(reply=reply), op, 0.0, self.limit)

    def reset(self, row: dict[str, Any]) -> EnvCall:
        self.instance, error = env_new(self.cls)
        if error is not None:
            return self._done("reset", error)
        return self._done("reset", env_reset(self.instance, row, self.takes_row, self.limit))

    def step(self, text: str) -> EnvCall:
        return self._done("step", env_step(self.instance, text, self.limit))

    def close(self) -> None:
        self.instance = None


class EnvHosts:
    """A run's environments by name, each opened per episode: a worker pool for a class loaded from a file, this
    process for one given as a class."""

    def __init__(self, envs: dict[str, Any], timeout: float, limit: int):
        self.envs, self.timeout, self.limit = envs, timeout, limit
        self.pools: dict[str, EnvPool] = {}
        self.local: dict[str, str] = {}
        weakref.finalize(self, _close_pools, self.pools)

    def open(self, name: str) -> EnvSession | LocalSession:
        env = self.envs[name]
        if isinstance(env, EnvClass):
            pool = self.pools.get(name)
            if pool is None:
                pool = self.pools[name] = EnvPool(worker_spec(env.path, env.name, self.limit, env.takes_row),
                                                  f"env-{name}", self.timeout)
            return EnvSession(pool, self.timeout, self.limit)
        if name not in self.local:
            self.local[name] = env_shape(env, f"environment {name!r}")
        return LocalSession(env, self.local[name], self.limit)

    def close(self) -> None:
        _close_pools(self.pools)


def _close_pools(pools: dict[str, EnvPool]) -> None:
    for pool in pools.values():
        pool.close()
    pools.clear()

