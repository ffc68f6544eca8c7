"""Small statistics shared by the evaluations (stage 3, judges, ``dschat eval``): standard errors of means and
paired gains, win rates, pass@k."""

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


def mean_se(values: Sequence[float]) -> float:
    """Standard error of the mean: ``std(values) / sqrt(n)`` with the unbiased (n - 1) std, in float32 as
    ``paired_se``. ``nan`` when n < 2. Example: ``[1, 2, 3]``: std 1, se ``1 / sqrt(3)``."""
    if len(values) < 2:
        return float("nan")
    return torch.tensor(values, dtype=torch.float32).std().item() / math.sqrt(len(values))


def win_rate(after: Sequence[float], before: Sequence[float]) -> dict[str, float | int]:
    """How often ``after`` beats ``before`` item by item (the same prompts): a win counts 1, a tie 1/2, a loss 0.
    Returns the counts, the rate (the mean of those outcomes) and its standard error (``mean_se`` of the
    outcomes). Example: after ``[2, 1, 0, 5]``, before ``[1, 1, 3, 4]``: win, tie, loss, win -> rate
    ``(1 + 0.5 + 0 + 1) / 4 = 0.625``."""
    if len(before) != len(after):
        raise ValueError(f"win_rate: {len(after)} values after and {len(before)} before; they must pair up")
    outcomes = [1.0 if a > b else 0.5 if a == b else 0.0 for a, b in zip(after, before, strict=True)]
    n = len(outcomes)
    return {"wins": outcomes.count(1.0), "ties": outcomes.count(0.5), "losses": outcomes.count(0.0),
            "rate": sum(outcomes) / n if n else float("nan"), "se": mean_se(outcomes)}


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from ``n`` samples of which ``c`` pass (Chen et al. 2021, "Evaluating
    Large Language Models Trained on Code", arXiv:2107.03374, eq. 1): ``1 - C(n - c, k) / C(n, k)``, the
    probability that k of the n samples drawn without replacement include at least one that passes.

    Computed as ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)`` (the paper's numerically stable form; the binomials
    overflow for large n). Example: n 4, c 1, k 2: ``1 - C(3, 2) / C(4, 2) = 1 - 3/6 = 0.5``.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:  # every k-subset holds a passing sample
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod
