"""The names of the reward sources that score with a model, as ``--reward-funcs`` takes them: the flag checks and
``dschat plan`` read them without importing the scorers (``functions``, ``judge``), which re-export them.

Each source also has a short, stable label, which names its metrics (``train/reward/<label>``, ``eval/reward/<label>``)
and its column in the evaluation: ``LABEL=SOURCE`` chooses it, else the source's own short name (``source_label``),
made unique when two collide (``reward_labels``). A label is what every tracker accepts as part of a metric name.
"""

from __future__ import annotations

import re
from typing import Any

from dschat.errors import UserError
from dschat.userfiles import LABEL, split_label

RM = "rm"  # the reward model's end score, computed by stage 3
JUDGE = "judge"  # the reward-function name of a trained judge in --reward-funcs
REMOTE = "remote"  # the label of a reward server that its URL does not name
ENV = "env"  # the environments' own reward (--env)


def given_or_default(reward_funcs: list[str], env: Any, otherwise: list[str]) -> list[str]:
    """The ``--reward-funcs`` entries as given; without them, the environments' reward when ``--env`` names any
    (an environment owns its reward), else ``otherwise`` (the command's own default). Training, evaluation and
    ``dschat generate`` all choose so."""
    return list(reward_funcs) or ([ENV] if env else list(otherwise))


def reward_sources(entries: list[str]) -> list[str]:
    """The sources of ``--reward-funcs`` entries, without their labels."""
    return [split_label(e)[1] for e in entries]


def source_label(source: str) -> str:
    """A source's own short name: a rule's or model source's name; the function's name of ``file.py:function``;
    the last path segment of a reward server's URL (``remote`` when it has none)."""
    if source.startswith(("http://", "https://")):
        path = source.split("://", 1)[1].split("?", 1)[0].split("#", 1)[0]
        segment = path.rstrip("/").rsplit("/", 1)[-1] if "/" in path else ""
        name = re.sub(r"[^A-Za-z0-9_-]", "_", segment)
        return name if LABEL.fullmatch(name) else REMOTE
    path, sep, fn = source.rpartition(":")
    if sep and path.endswith(".py") and fn:
        return fn if LABEL.fullmatch(fn) else re.sub(r"[^A-Za-z0-9_-]", "_", fn) or "function"
    return source


def reward_labels(entries: list[str]) -> list[str]:
    """The label of each ``--reward-funcs`` entry, in order: its ``LABEL=`` or its ``source_label``; a name two
    entries would share gets ``_2``, ``_3``, ... on the later ones. Two entries given the same label are refused."""
    given = [split_label(e)[0] for e in entries]
    chosen = [g for g in given if g is not None]
    if len(set(chosen)) != len(chosen):
        twice = sorted({g for g in chosen if chosen.count(g) > 1})
        raise UserError(f"--reward-funcs gives the label {', '.join(twice)} to two sources; give each its own")
    taken, labels = set(chosen), []
    for entry, label in zip(entries, given, strict=True):
        if label is None:
            base = source_label(split_label(entry)[1])
            label, n = base, 1
            while label in taken:
                n += 1
                label = f"{base}_{n}"
            taken.add(label)
        labels.append(label)
    return labels
