"""Environments (``--env FILE.py:Class``): multi-turn episodes where something answers the assistant's turns.

An environment is a class with two methods; dschat makes one instance per episode (``Class()``)::

    class Guess:
        def reset(self, row: dict) -> str | None:
            '''Start an episode from its data row (every field of the row: ``prompt``, ``answer``, ...). Return
            text to put before the assistant's first turn (context, not trained on), or None.'''

        def step(self, text: str) -> tuple[str | None, float, bool]:
            '''The assistant's finished turn (decoded, special tokens dropped) -> (the next observation, the
            reward of this turn, whether the episode is done). The observation becomes the user's turn.'''

The episode's environment reward is the sum of its turns' rewards; it is the reward source ``env``
(``--reward-funcs env``, the default with ``--env``), which ``--reward-funcs`` may mix with rule, model or remote
sources. An environment that raises ends its episode with the rewards it gave so far, counted as an error.

Several environments: ``--env NAME=FILE.py:Class`` (repeatable), and each row names its own in the data column
``--env-column`` (default ``env``); with one ``--env`` every row takes it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from dschat.errors import UserError
from dschat.userfiles import load_object, split_label


@dataclass
class EnvStep:
    observation: str | None
    reward: float
    done: bool


def load_envs(specs: list[str]) -> dict[str, type]:
    """``--env`` entries as classes by name (``NAME=FILE.py:Class``; without ``NAME=`` the class's name)."""
    out: dict[str, type] = {}
    for spec in specs:
        label, source = split_label(spec)
        cls = load_object(source, f"--env {spec!r}")
        if not inspect.isclass(cls) or not all(callable(getattr(cls, m, None)) for m in ("reset", "step")):
            raise UserError(f"--env {spec!r}: expected a class with reset(row) and step(text) methods")
        name = label or cls.__name__
        if name in out:
            raise UserError(f"--env: two environments named {name!r}; name them with NAME=FILE.py:Class")
        out[name] = cls
    return out


def as_step(value: Any, where: str) -> EnvStep:
    """An environment's ``step`` result as an ``EnvStep``: ``(observation, reward, done)``; ``ValueError`` with one
    line otherwise."""
    if isinstance(value, EnvStep):
        return value
    if not isinstance(value, tuple | list) or len(value) != 3:
        raise ValueError(f"{where}: step() must return (observation, reward, done), got {type(value).__name__}")
    obs, reward, done = value
    if obs is not None and not isinstance(obs, str):
        raise ValueError(f"{where}: the observation must be text or None, got {type(obs).__name__}")
    try:
        reward = float(reward if reward is not None else 0.0)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: the reward must be a number, got {type(reward).__name__}") from None
    if reward != reward or reward in (float("inf"), float("-inf")):
        raise ValueError(f"{where}: the reward is not finite")
    return EnvStep(obs, reward, bool(done))
