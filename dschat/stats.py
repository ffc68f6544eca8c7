"""Small statistics shared by the evaluations (stage 3, judges): standard errors of means and paired gains."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def paired_se(before: Sequence[float], after: Sequence[float]) -> float:
    """Standard error of the mean gain ``mean(after - before)`` when both were measured on the same items (the
    same prompts with the same sampling seeds, or the same judge rows), so the differences are paired:
    ``std(after - before) / sqrt(n)`` with the unbiased (n - 1) std. ``nan`` when n < 2.

    Computed in float32, as stage 3 always has, so recorded results stay comparable; integer inputs (a judge's
    0/1 correctness) are fine. Example: before ``[0, 1, 1]``, after ``[1, 1, 0]``: differences ``[1, 0, -1]``,
    std 1, se ``1 / sqrt(3) = 0.5774``.
    """
    if len(before) != len(after):
        raise ValueError(f"paired_se: {len(before)} values before and {len(after)} after; they must pair up")
    if len(before) < 2:
        return float("nan")
    diff = torch.tensor(after, dtype=torch.float32) - torch.tensor(before, dtype=torch.float32)  # (n,)
    return diff.std().item() / math.sqrt(len(diff))
