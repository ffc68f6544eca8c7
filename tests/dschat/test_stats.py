"""Summary statistics (dschat/stats.py)."""

import math

import pytest

from dschat.stats import paired_se


def test_paired_se_by_hand():
    # differences [1, 0, -1]: mean 0, unbiased variance (1 + 0 + 1) / 2 = 1, se = 1 / sqrt(3)
    assert paired_se([0, 1, 1], [1, 1, 0]) == pytest.approx(1 / math.sqrt(3), rel=1e-6)
    # differences [0.5, 0.5]: no spread, no error
    assert paired_se([1.0, 2.0], [1.5, 2.5]) == 0.0


def test_paired_se_needs_two_pairs_that_pair_up():
    assert math.isnan(paired_se([1.0], [2.0])) and math.isnan(paired_se([], []))
    with pytest.raises(ValueError, match="pair up"):
        paired_se([1.0, 2.0], [1.0])


def test_paired_se_equals_the_float32_torch_formula_stage_3_recorded_with():
    import torch

    before = [0.1 * i - 0.7 for i in range(17)]
    after = [0.37 * ((i * 7) % 5) for i in range(17)]
    diff = torch.tensor(after) - torch.tensor(before)
    assert paired_se(before, after) == diff.std().item() / math.sqrt(17)  # bit for bit
