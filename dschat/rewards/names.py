"""The names of the reward sources that score with a model, as ``--reward-funcs`` takes them: the flag checks and
``dschat plan`` read them without importing the scorers (``functions``, ``judge``), which re-export them."""

from __future__ import annotations

RM = "rm"  # the reward model's end score, computed by stage 3
JUDGE = "judge"  # the reward-function name of a trained judge in --reward-funcs
