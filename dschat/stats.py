"""Small statistics shared by the evaluations (stage 3, judges): standard errors of means and paired gains."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def paired_se(before: Sequence[float], after: Sequence[float]) -> float:
    """Standard error of the mean gain ``after - before`` when both were measured on the same items (the same
    prompts with the same sampling seeds, or the same judge rows): the spread of the per-item differences
    (unbiased std) over sqrt(n); nan with fewer than two items."""
    diff = torch.tensor(after) - torch.tensor(before)
    return diff.std().item() / math.sqrt(len(diff)) if len(diff) > 1 else float("nan")
