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


def test_pass_at_k_by_hand_and_against_the_binomial_definition():
    from dschat.stats import pass_at_k

    # n 4, c 1, k 2: 1 - C(3, 2) / C(4, 2) = 1 - 3/6
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5, abs=1e-12)
    # n 5, c 2, k 3: 1 - C(3, 3) / C(5, 3) = 1 - 1/10
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9, abs=1e-12)
    # k 1 is the fraction that passes: n 5, c 2 -> 0.4
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4, abs=1e-12)
    assert pass_at_k(3, 0, 2) == 0.0 and pass_at_k(3, 3, 1) == 1.0
    assert pass_at_k(4, 3, 2) == 1.0  # n - c = 1 < k: every pair holds a passing sample
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_win_rate_counts_ties_half():
    from dschat.stats import win_rate

    # after vs before: win, tie, loss, win -> (1 + 0.5 + 0 + 1) / 4
    wr = win_rate([2.0, 1.0, 0.0, 5.0], [1.0, 1.0, 3.0, 4.0])
    assert (wr["wins"], wr["ties"], wr["losses"]) == (2, 1, 1)
    assert wr["rate"] == pytest.approx(0.625)
    # outcomes [1, .5, 0, 1]: mean .625, deviations [.375, -.125, -.625, .375], squares
    # .140625 + .015625 + .390625 + .140625 = .6875, unbiased variance .6875 / 3, se sqrt(.6875 / 3) / sqrt(4)
    assert wr["se"] == pytest.approx(math.sqrt(0.6875 / 3) / 2, rel=1e-6)
    same = win_rate([1.0, 2.0], [1.0, 2.0])
    assert same["rate"] == 0.5 and same["ties"] == 2 and same["se"] == 0.0
    with pytest.raises(ValueError, match="pair up"):
        win_rate([1.0], [1.0, 2.0])


def test_mean_se_by_hand():
    from dschat.stats import mean_se

    assert mean_se([1.0, 2.0, 3.0]) == pytest.approx(1 / math.sqrt(3), rel=1e-6)  # std 1
    assert math.isnan(mean_se([1.0]))
