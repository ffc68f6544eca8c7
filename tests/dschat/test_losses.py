"""Tests for dschat.losses: hand-worked numbers (arithmetic in the comments) plus property tests.

Notation in comments: sp(d) = -logsigmoid(d) = log(1 + exp(-d)).
"""

import math
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from dschat.losses import (
    AdaptiveKLController,
    FixedKLController,
    approx_kl,
    best_worst_pairs,
    discounted_returns,
    distill_sft_loss,
    dpo_loss,
    dynamic_sampling_mask,
    end_indices,
    gae,
    group_advantages,
    grpo_loss_units,
    grpo_policy_loss,
    kd_loss,
    kl_penalized_rewards,
    last_token_pairwise_loss,
    masked_mean,
    masked_moments,
    masked_sum,
    masked_var,
    overlong_penalty,
    pairwise_loss,
    pairwise_metrics,
    per_token_nll,
    ppo_policy_loss,
    ppo_value_loss,
    remax_advantages,
    rloo_advantages,
    selective_log_softmax,
    simpo_loss,
    whiten,
    whiten_from_moments,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def sp(d: float) -> float:
    """-logsigmoid(d), computed independently of torch."""
    return math.log1p(math.exp(-d))


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0.0)


def t(*rows) -> torch.Tensor:
    return torch.tensor(rows if len(rows) > 1 else rows[0], dtype=torch.float32)


# ------------------------------------------------------------------------------------------------------------
# Masked reductions
# ------------------------------------------------------------------------------------------------------------


def test_masked_reductions_by_hand():
    x = t([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # kept: 1, 2, 4 -> sum 7, mean 7/3
    close(masked_sum(x, mask), 7.0)
    close(masked_mean(x, mask), 7.0 / 3.0)
    # per row: (1 + 2) / 2 = 1.5 ; 4 / 1 = 4
    close(masked_mean(x, mask, dim=1), [1.5, 4.0])
    # deviations from 7/3: -4/3, -1/3, 5/3 -> squares 16/9 + 1/9 + 25/9 = 42/9
    # unbiased: 42/9 / 2 = 7/3 ; biased: 42/9 / 3 = 14/9
    close(masked_var(x, mask), 7.0 / 3.0)
    close(masked_var(x, mask, unbiased=False), 14.0 / 9.0)
    # row 0: values 1, 2 -> mean 1.5, deviations +-0.5 -> unbiased (0.25 + 0.25) / 1 = 0.5
    # row 1: one value -> 0
    close(masked_var(x, mask, dim=1), [0.5, 0.0])


def test_masked_mean_empty_row_is_zero_and_garbage_does_not_leak():
    x = t([1.0, float("nan")], [float("inf"), 3.0])
    mask = torch.tensor([[True, False], [False, False]])
    close(masked_mean(x, mask, dim=1), [1.0, 0.0])
    close(masked_mean(x, mask), 1.0)


def test_whiten_gives_masked_mean_zero_and_unit_variance():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=g) * 3.0 + 2.0
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[0, 4:] = False
    mask[2, 1:] = False
    x[~mask] = 1e4  # padding garbage must not shift the statistics
    w = whiten(x, mask)
    close(masked_mean(w, mask), 0.0, atol=1e-6)
    close(masked_var(w, mask), 1.0, atol=1e-5)
    assert torch.all(w[~mask] == 0)

    kept_mean = masked_mean(x, mask)
    w_keep = whiten(x, mask, shift_mean=False)
    close(masked_mean(w_keep, mask), kept_mean.item(), atol=1e-5)
    close(masked_var(w_keep, mask), 1.0, atol=1e-5)


# ------------------------------------------------------------------------------------------------------------
# Token helpers
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_selective_log_softmax_equals_naive(dtype):
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 5, 11, generator=g) * 4.0).to(dtype)
    index = torch.randint(0, 11, (2, 5), generator=g)
    got = selective_log_softmax(logits, index)
    # Naive reference in at least float32 on the same (possibly rounded) logits.
    ref_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    naive = logits.to(ref_dtype).log_softmax(-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    assert got.shape == (2, 5)
    assert got.dtype == ref_dtype
    torch.testing.assert_close(got, naive, atol=1e-5, rtol=0.0)


def test_selective_log_softmax_2d_input():
    logits = torch.log(t([0.5, 0.25, 0.25], [0.1, 0.2, 0.7]))
    index = torch.tensor([1, 2])
    close(selective_log_softmax(logits, index), [math.log(0.25), math.log(0.7)])


def test_end_indices_from_mask_not_pad_id():
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 1, 1, 0], [0, 0, 0, 0, 0]])
    # last 1 at: 2 ; 4 ; 3 (left and right padded) ; all-zero row -> 0
    assert end_indices(mask).tolist() == [2, 4, 3, 0]


# ------------------------------------------------------------------------------------------------------------
# Stage 2: pairwise reward loss (docs/algorithms.md, Reward-model loss)
# ------------------------------------------------------------------------------------------------------------


class PairCase(NamedTuple):
    chosen_ids: list[int]
    rejected_ids: list[int]
    chosen_mask: list[int]
    rejected_mask: list[int]
    chosen_values: list[float]
    rejected_values: list[float]
    loss: float  # expected, worked by hand
    chosen_score: float
    rejected_score: float


PAIR_CASES = {
    # Unequal answer lengths. Prompt [5], answers share token 6 then differ. pad 0, EOS 2.
    #   chosen   5 6 7 8 2 .   c_end = 5
    #   rejected 5 6 9 2 . .   x_end = 4
    # div = 2, end = max(5, 4) = 5 -> t in {2, 3, 4}
    # chosen eff: 0.5, 1.0, 2.0 ; rejected eff: 0.3, -1.0, -1.0 (t=4 is past x_end: its end score -1.0,
    # not the pad value 7.0)
    # diffs 0.2, 2.0, 3.0 -> loss = (sp(0.2) + sp(2) + sp(3)) / 3 = (0.598139 + 0.126928 + 0.048587) / 3
    "unequal_lengths": PairCase(
        chosen_ids=[5, 6, 7, 8, 2, 0],
        rejected_ids=[5, 6, 9, 2, 0, 0],
        chosen_mask=[1, 1, 1, 1, 1, 0],
        rejected_mask=[1, 1, 1, 1, 0, 0],
        chosen_values=[0.1, 0.2, 0.5, 1.0, 2.0, 9.0],
        rejected_values=[0.1, 0.2, 0.3, -1.0, 7.0, 8.0],
        loss=(sp(0.2) + sp(2.0) + sp(3.0)) / 3,
        chosen_score=2.0,
        rejected_score=-1.0,
    ),
    # Chosen answer "a" is a prefix of rejected "a b". Prompt [4, 5]; a = 6, b = 7; EOS 2, pad 0.
    #   chosen   4 5 6 2 . .   c_end = 4
    #   rejected 4 5 6 7 2 .   x_end = 5
    # div = 3 (2 vs 7), end = 5 -> t in {3, 4}
    # chosen eff: 1.5, 1.5 (t=4 is chosen padding, value 50.0 replaced by its end score 1.5)
    # rejected eff: 0.5, 1.0 -> diffs 1.0, 0.5 -> loss = (sp(1.0) + sp(0.5)) / 2 = (0.313262 + 0.474077) / 2
    "prefix": PairCase(
        chosen_ids=[4, 5, 6, 2, 0, 0],
        rejected_ids=[4, 5, 6, 7, 2, 0],
        chosen_mask=[1, 1, 1, 1, 0, 0],
        rejected_mask=[1, 1, 1, 1, 1, 0],
        chosen_values=[0.0, 0.0, 0.3, 1.5, 50.0, 50.0],
        rejected_values=[0.0, 0.0, 0.3, 0.5, 1.0, -50.0],
        loss=(sp(1.0) + sp(0.5)) / 2,
        chosen_score=1.5,
        rejected_score=1.0,
    ),
    # Diverges at the first answer token. Prompt [4, 5] (values 3.0 on both: before div, they never count).
    #   chosen   4 5 6 2 .   c_end = 4
    #   rejected 4 5 8 9 2   x_end = 5
    # div = 2, end = 5 -> t in {2, 3, 4}; chosen eff 0.1, 0.3, 0.3 (pad 7.0 -> end score 0.3)
    # rejected eff 0.6, -0.2, -0.7 -> diffs -0.5, 0.5, 1.0 -> loss = (sp(-0.5) + sp(0.5) + sp(1.0)) / 3
    "first_answer_token": PairCase(
        chosen_ids=[4, 5, 6, 2, 0],
        rejected_ids=[4, 5, 8, 9, 2],
        chosen_mask=[1, 1, 1, 1, 0],
        rejected_mask=[1, 1, 1, 1, 1],
        chosen_values=[3.0, 3.0, 0.1, 0.3, 7.0],
        rejected_values=[3.0, 3.0, 0.6, -0.2, -0.7],
        loss=(sp(-0.5) + sp(0.5) + sp(1.0)) / 3,
        chosen_score=0.3,
        rejected_score=-0.7,
    ),
    # pad == EOS == 2. Both answers end with a real EOS that has the pad id.
    #   chosen   4 6 7 2 2    mask 1 1 1 1 0   c_end = 4 (first pad *id* would say 3)
    #   rejected 4 6 2 2 2    mask 1 1 1 0 0   x_end = 3 (first pad *id* would say 2)
    # div = 2 (7 vs 2), end = 4 -> t in {2, 3}; chosen eff 0.4, 1.2 ; rejected eff -0.6, -0.6 (t=3 past x_end)
    # diffs 1.0, 1.8 -> loss = (sp(1.0) + sp(1.8)) / 2 ; scores 1.2 and -0.6 (the EOS values)
    "pad_equals_eos": PairCase(
        chosen_ids=[4, 6, 7, 2, 2],
        rejected_ids=[4, 6, 2, 2, 2],
        chosen_mask=[1, 1, 1, 1, 0],
        rejected_mask=[1, 1, 1, 0, 0],
        chosen_values=[0.0, 0.0, 0.4, 1.2, 8.0],
        rejected_values=[0.0, 0.0, -0.6, 5.0, 5.0],
        loss=(sp(1.0) + sp(1.8)) / 2,
        chosen_score=1.2,
        rejected_score=-0.6,
    ),
    # pad == EOS == 2 and the ids are IDENTICAL: chosen is truncated "6" (no EOS), rejected is "6 EOS".
    #   chosen   4 6 2 2   mask 1 1 0 0   c_end = 2
    #   rejected 4 6 2 2   mask 1 1 1 0   x_end = 3
    # Only the mask tells them apart: div = 2, end = 3 -> t in {2}
    # chosen eff at 2 = chosen end score 0.7 ; rejected 2 -> -0.3 ; diff 1.0 -> loss = sp(1.0)
    "ids_equal_masks_differ": PairCase(
        chosen_ids=[4, 6, 2, 2],
        rejected_ids=[4, 6, 2, 2],
        chosen_mask=[1, 1, 0, 0],
        rejected_mask=[1, 1, 1, 0],
        chosen_values=[0.0, 0.7, 9.0, 9.0],
        rejected_values=[0.0, 0.2, -0.3, 9.0],
        loss=sp(1.0),
        chosen_score=0.7,
        rejected_score=-0.3,
    ),
    # pad == unk == 0 (Llama-style padding with <unk>), and the rejected answer ends in two real <unk> tokens:
    #   chosen   4 6 0 0 0   mask 1 1 0 0 0   c_end = 2
    #   rejected 4 6 0 0 0   mask 1 1 1 1 0   x_end = 4
    # ids identical again; the masks give div = 2, end = 4 -> t in {2, 3} (an ids-only comparison would treat
    # the pair as identical and compare only t = 3)
    # chosen eff 0.7, 0.7 (its end score) ; rejected -0.3, 0.2 -> diffs 1.0, 0.5 -> (sp(1.0) + sp(0.5)) / 2
    "pad_equals_unk_two_tokens": PairCase(
        chosen_ids=[4, 6, 0, 0, 0],
        rejected_ids=[4, 6, 0, 0, 0],
        chosen_mask=[1, 1, 0, 0, 0],
        rejected_mask=[1, 1, 1, 1, 0],
        chosen_values=[0.0, 0.7, 9.0, 9.0, 9.0],
        rejected_values=[0.0, 0.2, -0.3, 0.2, -9.0],
        loss=(sp(1.0) + sp(0.5)) / 2,
        chosen_score=0.7,
        rejected_score=0.2,
    ),
}


def _pair_tensors(case: PairCase):
    ids = [torch.tensor([v]) for v in (case.chosen_ids, case.rejected_ids, case.chosen_mask, case.rejected_mask)]
    return (t([case.chosen_values]), t([case.rejected_values]), *ids)


@pytest.mark.parametrize("name", list(PAIR_CASES))
def test_pairwise_loss_by_hand(name):
    case = PAIR_CASES[name]
    out = pairwise_loss(*_pair_tensors(case))
    close(out.loss, case.loss)
    close(out.chosen_scores, [case.chosen_score])
    close(out.rejected_scores, [case.rejected_score])


def test_pairwise_loss_batched_equals_mean_of_pairs_and_ignores_padding():
    # All cases in one batch, right-padded to L = 6 with mask 0 (pad id 0, pad values random garbage).
    L = 6
    g = torch.Generator().manual_seed(2)
    rows = {k: [] for k in ("cv", "xv", "ci", "xi", "cm", "xm")}
    for case in PAIR_CASES.values():
        c_ids, x_ids, c_mask, x_mask, c_vals, x_vals = case[:6]
        n = L - len(c_ids)
        garbage = (torch.randn(2, n, generator=g) * 100).tolist()
        rows["ci"].append(c_ids + [0] * n)
        rows["xi"].append(x_ids + [0] * n)
        rows["cm"].append(c_mask + [0] * n)
        rows["xm"].append(x_mask + [0] * n)
        rows["cv"].append(c_vals + garbage[0])
        rows["xv"].append(x_vals + garbage[1])
    cv = torch.tensor(rows["cv"], requires_grad=True)
    xv = torch.tensor(rows["xv"], requires_grad=True)
    cm, xm = torch.tensor(rows["cm"]), torch.tensor(rows["xm"])
    out = pairwise_loss(cv, xv, torch.tensor(rows["ci"]), torch.tensor(rows["xi"]), cm, xm)

    expected = sum(c.loss for c in PAIR_CASES.values()) / len(PAIR_CASES)
    close(out.loss, expected)
    close(out.chosen_scores, [c.chosen_score for c in PAIR_CASES.values()])
    close(out.rejected_scores, [c.rejected_score for c in PAIR_CASES.values()])

    # Padding never enters: no gradient reaches a pad position of either sequence.
    out.loss.backward()
    assert torch.all(cv.grad[cm == 0] == 0)
    assert torch.all(xv.grad[xm == 0] == 0)


def test_last_token_pairwise_loss_with_margin_and_centring():
    chosen, rejected = t([1.0, 0.0]), t([0.5, 0.5])
    margin = t([0.25, -0.5])
    # pair 1: d = 1.0 - 0.5 - 0.25 = 0.25 -> sp(0.25) + 0.1 * (1.0 + 0.5)^2 = 0.575939 + 0.225 = 0.800939
    # pair 2: d = 0.0 - 0.5 + 0.5 = 0   -> log 2   + 0.1 * (0.0 + 0.5)^2 = 0.693147 + 0.025 = 0.718147
    out = last_token_pairwise_loss(chosen, rejected, margin=margin, center_coef=0.1)
    close(out.loss, (sp(0.25) + 0.225 + math.log(2) + 0.025) / 2)  # 0.759543
    # no margin, no centring: (sp(0.5) + sp(-0.5)) / 2 = (0.474077 + 0.974077) / 2
    close(last_token_pairwise_loss(chosen, rejected).loss, (sp(0.5) + sp(-0.5)) / 2)


def test_pairwise_metrics_ties_count_half():
    chosen, rejected = t([2.0, 1.0, 0.0, 3.0]), t([1.0, 1.0, 1.0, 0.0])
    m = pairwise_metrics(chosen, rejected)
    # win, tie, loss, win -> (1 + 0.5 + 0 + 1) / 4 = 0.625
    close(m.accuracy, 0.625)
    close(m.chosen_mean, 1.5)  # (2 + 1 + 0 + 3) / 4
    close(m.rejected_mean, 0.75)  # (1 + 1 + 1 + 0) / 4
    close(m.margin_mean, 0.75)  # (1 + 0 - 1 + 3) / 4


# ------------------------------------------------------------------------------------------------------------
# Stage 3: PPO (docs/algorithms.md, PPO)
# ------------------------------------------------------------------------------------------------------------


def test_kl_penalized_rewards_put_clipped_score_at_last_real_token():
    logprobs = t([-1.0, -2.0, -0.5, -1.0], [-0.7, -0.9, 0.0, 0.0])
    ref = t([-1.2, -1.9, -0.5, -1.5], [-1.0, -1.0, -1.0, -1.0])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])  # row 1 stopped early, padded after EOS
    scores = t([7.0, -2.0])
    r = kl_penalized_rewards(logprobs, ref, scores, mask, kl_ctl=0.1, clip_reward_value=5.0)
    # row 0: logp - ref = 0.2, -0.1, 0.0, 0.5 -> -0.1 * that = -0.02, 0.01, 0.0, -0.05
    #        clip(7, -5, 5) = 5 added at t=3 -> -0.05 + 5 = 4.95
    # row 1: logp - ref = 0.3, 0.1 -> -0.03, -0.01 ; score -2 (inside the clip) added at t=1 -> -2.01
    #        padding stays 0 even though its log-ratio is 1.0
    close(r, [[-0.02, 0.01, 0.0, 4.95], [-0.03, -2.01, 0.0, 0.0]])


def test_gae_by_hand_gamma1_lam095_with_early_stop():
    values = t([0.5, 0.4, 0.3, 0.2], [1.0, 0.5, 9.0, 9.0])
    rewards = t([0.0, 0.0, 0.0, 1.0], [0.1, 2.0, 5.0, 5.0])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])  # row 1: 2 answer tokens, then padding (garbage)
    adv, ret = gae(values, rewards, mask, gamma=1.0, lam=0.95)
    # row 0, backwards, V after the last token = 0:
    #   t3: delta = 1 + 0 - 0.2 = 0.8                 A3 = 0.8
    #   t2: delta = 0 + 0.2 - 0.3 = -0.1              A2 = -0.1 + 0.95 * 0.8   = 0.66
    #   t1: delta = 0 + 0.3 - 0.4 = -0.1              A1 = -0.1 + 0.95 * 0.66  = 0.527
    #   t0: delta = 0 + 0.4 - 0.5 = -0.1              A0 = -0.1 + 0.95 * 0.527 = 0.40065
    #   R = A + V = 0.90065, 0.927, 0.96, 1.0
    # row 1: last real token t1, padding values/rewards never enter:
    #   t1: delta = 2.0 + 0 - 0.5 = 1.5               A1 = 1.5
    #   t0: delta = 0.1 + 0.5 - 1.0 = -0.4            A0 = -0.4 + 0.95 * 1.5 = 1.025
    #   R = 2.025, 2.0, then 0 on padding
    close(adv, [[0.40065, 0.527, 0.66, 0.8], [1.025, 1.5, 0.0, 0.0]])
    close(ret, [[0.90065, 0.927, 0.96, 1.0], [2.025, 2.0, 0.0, 0.0]])


def test_gae_by_hand_gamma09_lam05():
    values = t([[0.5, 0.4, 0.3, 0.2]])
    rewards = t([[0.0, 0.0, 0.0, 1.0]])
    mask = torch.ones(1, 4)
    adv, ret = gae(values, rewards, mask, gamma=0.9, lam=0.5)  # gamma * lam = 0.45
    #   t3: delta = 1 - 0.2 = 0.8                     A3 = 0.8
    #   t2: delta = 0.9 * 0.2 - 0.3 = -0.12           A2 = -0.12 + 0.45 * 0.8    = 0.24
    #   t1: delta = 0.9 * 0.3 - 0.4 = -0.13           A1 = -0.13 + 0.45 * 0.24   = -0.022
    #   t0: delta = 0.9 * 0.4 - 0.5 = -0.14           A0 = -0.14 + 0.45 * -0.022 = -0.1499
    close(adv, [[-0.1499, -0.022, 0.24, 0.8]])
    close(ret, [[0.3501, 0.378, 0.54, 1.0]])


def test_gae_lam1_gamma1_is_monte_carlo_and_masked_prefix_is_skipped():
    g = torch.Generator().manual_seed(3)
    values, rewards = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])  # row 0: a masked prompt token, then padding
    adv, _ = gae(values, rewards, mask, gamma=1.0, lam=1.0)
    # lam = gamma = 1: A_t = sum of the row's kept rewards from t on - V_t
    kept_r = rewards * mask
    mc = kept_r.flip(1).cumsum(1).flip(1) - values
    close(adv, mc * mask, atol=1e-5)


def test_ppo_policy_loss_at_ratio_one_is_minus_mean_advantage():
    g = torch.Generator().manual_seed(4)
    logprobs = torch.randn(3, 5, generator=g).requires_grad_()
    advantages = torch.randn(3, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0]])
    out = ppo_policy_loss(logprobs, logprobs.detach(), advantages, mask, cliprange=0.2)
    close(out.loss, -masked_mean(advantages, mask).item())
    close(out.clip_frac, 0.0)
    close(out.approx_kl, 0.0)
    out.loss.backward()
    # d/dlogp of -A * exp(logp - old) at ratio 1 = -A, divided by the 10 kept tokens
    close(logprobs.grad, -advantages * mask / 10)


def test_ppo_policy_loss_clipped_by_hand():
    ratios = [1.5, 0.5, 0.5, 1.1, 1.0]
    logprobs = torch.log(t([ratios])).requires_grad_()
    old = torch.zeros(1, 5)
    adv = t([[1.0, 1.0, -2.0, -1.0, 100.0]])  # last token is padding: its 100 must not count
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    out = ppo_policy_loss(logprobs, old, adv, mask, cliprange=0.2)
    # t0: r 1.5, A  1: max(-1.5, -1.2) = -1.2  (clipped)
    # t1: r 0.5, A  1: max(-0.5, -0.8) = -0.5
    # t2: r 0.5, A -2: max( 1.0,  1.6) =  1.6  (clipped)
    # t3: r 1.1, A -1: max( 1.1,  1.1) =  1.1
    # loss = (-1.2 - 0.5 + 1.6 + 1.1) / 4 = 1.0 / 4 = 0.25 ; clip_frac = 2 / 4
    close(out.loss, 0.25)
    close(out.clip_frac, 0.5)
    # k3 KL(old || new) per token = (r - 1) - log r: 0.094535, 0.193147, 0.193147, 0.004690 -> mean 0.121380
    close(out.approx_kl, sum(r - 1 - math.log(r) for r in ratios[:4]) / 4)
    out.loss.backward()
    # clipped tokens get no gradient; t1: -A * r / 4 = -0.125 ; t3: -A * r / 4 = 1.1 / 4 = 0.275
    close(logprobs.grad, [[0.0, -0.125, 0.0, 0.275, 0.0]])


def test_ppo_value_loss_clipped_by_hand():
    values = t([[1.0, 0.0, 2.0, 50.0]]).requires_grad_()
    old_values = t([[0.5, 0.1, 1.0, 0.0]])
    returns = t([[1.0, 1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    out = ppo_value_loss(values, old_values, returns, mask, cliprange_value=0.2)
    # t0: (1-1)^2 = 0 ; clip(1.0, 0.3, 0.7) = 0.7 -> (0.7-1)^2 = 0.09 -> max 0.09 (clipped)
    # t1: (0-1)^2 = 1 ; clip(0.0, -0.1, 0.3) = 0.0 -> 1            -> 1
    # t2: (2-0)^2 = 4 ; clip(2.0, 0.8, 1.2) = 1.2 -> 1.44          -> 4
    # loss = 0.5 * (0.09 + 1 + 4) / 3 = 0.848333 ; clip_frac = 1 / 3
    close(out.loss, 0.5 * 5.09 / 3)
    close(out.clip_frac, 1.0 / 3.0)
    out.loss.backward()
    # t0: the clipped value is a constant -> 0 ; t1: 0.5 * 2 * (0 - 1) / 3 ; t2: 0.5 * 2 * (2 - 0) / 3
    close(values.grad, [[0.0, -1.0 / 3.0, 2.0 / 3.0, 0.0]])


def test_approx_kl_estimators_by_hand():
    logprobs, ref = t([-1.0, -2.0]), t([-1.5, -1.0])
    # logp - ref = 0.5, -1.0 ; ref - logp = -0.5, 1.0
    close(approx_kl(logprobs, ref, "k1"), [0.5, -1.0])
    close(approx_kl(logprobs, ref, "k2"), [0.125, 0.5])  # 0.5 * 0.25, 0.5 * 1
    # k3 = exp(ref - logp) - (ref - logp) - 1: exp(-0.5) + 0.5 - 1 = 0.106531 ; e - 1 - 1 = 0.718282
    close(approx_kl(logprobs, ref, "k3"), [math.exp(-0.5) - 0.5, math.e - 2.0])
    with pytest.raises(ValueError):
        approx_kl(logprobs, ref, "k4")  # type: ignore[arg-type]


def test_approx_kl_k3_clamps_log_ratio_to_20():
    logprobs = torch.zeros(2, dtype=torch.float64)
    ref = torch.tensor([-100.0, 100.0], dtype=torch.float64)
    # clamped to -20 / +20: exp(-20) + 20 - 1 ; exp(20) - 20 - 1 (finite, not exp(100))
    expected = torch.tensor([math.exp(-20) + 19.0, math.exp(20) - 21.0], dtype=torch.float64)
    torch.testing.assert_close(approx_kl(logprobs, ref, "k3"), expected, rtol=1e-12, atol=0.0)


def test_kl_controllers():
    fixed = FixedKLController(0.1)
    fixed.update(current_kl=100.0, n_steps=10)
    assert fixed.value == 0.1
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    # KL 12: error = clip(12 / 6 - 1, -0.2, 0.2) = 0.2 -> 0.1 * (1 + 0.2 * 256 / 10000) = 0.1 * 1.00512
    ctl.update(current_kl=12.0, n_steps=256)
    assert ctl.value == pytest.approx(0.100512, abs=1e-12)
    # KL 3: error = clip(-0.5) = -0.2 -> * (1 - 0.00512)
    ctl.update(current_kl=3.0, n_steps=256)
    assert ctl.value == pytest.approx(0.100512 * 0.99488, abs=1e-12)


# ------------------------------------------------------------------------------------------------------------
# GRPO family (docs/algorithms.md, GRPO family)
# ------------------------------------------------------------------------------------------------------------


def test_group_advantages_by_hand():
    rewards = t([1.0, 2.0, 3.0, 0.0, 0.0, 6.0])  # two prompts, G = 3
    eps = 1e-4
    # group means: 2 and 2 -> centred: -1, 0, 1 | -2, -2, 4
    centred = [-1.0, 0.0, 1.0, -2.0, -2.0, 4.0]
    close(group_advantages(rewards, 3, scale="none"), centred)
    # group stds (unbiased): sqrt((1 + 0 + 1) / 2) = 1 ; sqrt((4 + 4 + 16) / 2) = sqrt(12) = 3.464102
    s1, s2 = 1.0, math.sqrt(12.0)
    expected = [c / (s1 + eps) for c in centred[:3]] + [c / (s2 + eps) for c in centred[3:]]
    close(group_advantages(rewards, 3, scale="group", eps=eps), expected)
    # batch std (unbiased) of all six rewards: mean 2, squared deviations 1 + 0 + 1 + 4 + 4 + 16 = 26
    # -> sqrt(26 / 5) = 2.280351
    sb = math.sqrt(26.0 / 5.0)
    close(group_advantages(rewards, 3, scale="batch", eps=eps), [c / (sb + eps) for c in centred])
    with pytest.raises(ValueError):
        group_advantages(rewards, 4)


def _two_lengths():
    # seq 0: 1 token, A = +2 ; seq 1: 3 tokens, A = -1 ; T = 4. Ratio 1 -> per-token loss = -A.
    logprobs = t([-1.0, 0.0, 0.0, 0.0], [-0.5, -0.6, -0.7, 0.0])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]])
    return logprobs, logprobs.clone(), t([2.0, -1.0]), mask


def test_grpo_vs_dr_grpo_vs_dapo_on_unequal_lengths():
    logprobs, old, adv, mask = _two_lengths()
    # per-token losses: seq 0: [-2] ; seq 1: [1, 1, 1]
    kw = {"eps_low": 0.2, "eps_high": 0.2}
    # grpo: sequence means -2 and 1 -> (-2 + 1) / 2 = -0.5
    close(grpo_policy_loss(logprobs, old, adv, mask, loss_type="grpo", **kw).loss, -0.5)
    # dr_grpo: sum (-2 + 3) = 1 / (batch 2 * max_completion_length 4) = 0.125
    close(grpo_policy_loss(logprobs, old, adv, mask, loss_type="dr_grpo", **kw).loss, 0.125)
    # dr_grpo with max_completion_length 8: 1 / 16
    out = grpo_policy_loss(logprobs, old, adv, mask, loss_type="dr_grpo", max_completion_length=8, **kw)
    close(out.loss, 1.0 / 16.0)
    # dapo: token mean 1 / 4 = 0.25
    close(grpo_policy_loss(logprobs, old, adv, mask, loss_type="dapo", **kw).loss, 0.25)
    # gspo at ratio 1: sequence losses -2 and 1 -> -0.5
    close(grpo_policy_loss(logprobs, old, adv, mask, loss_type="gspo", **kw).loss, -0.5)


def test_grpo_kl_term_by_hand():
    logprobs, old, adv, mask = _two_lengths()
    ref = logprobs.clone()
    ref[1, 0] += 1.0  # ref - logp = 1 on one token: k3 = e - 1 - 1 = 0.718282 ; 0 elsewhere
    k = math.e - 2.0
    out = grpo_policy_loss(logprobs, old, adv, mask, 0.2, 0.2, "grpo", ref_logprobs=ref, beta=0.1)
    # seq 1 mean: (1 + 0.1 * k + 1 + 1) / 3 = 1 + 0.1 * k / 3 ; loss = (-2 + 1 + 0.1 * k / 3) / 2
    close(out.loss, (-1.0 + 0.1 * k / 3.0) / 2.0)
    close(out.kl, k / 4.0)  # mean over the 4 completion tokens
    with pytest.raises(ValueError):
        grpo_policy_loss(logprobs, old, adv, mask, 0.2, 0.2, "grpo", beta=0.1)


def test_grpo_clip_higher_by_hand():
    # seq 0: A = +1, ratios 1.5, 0.5 ; seq 1: A = -1, ratios 0.5, 1.5 ; eps_low 0.2, eps_high 0.28
    logprobs = torch.log(t([1.5, 0.5], [0.5, 1.5]))
    old = torch.zeros(2, 2)
    mask = torch.ones(2, 2)
    out = grpo_policy_loss(logprobs, old, t([1.0, -1.0]), mask, eps_low=0.2, eps_high=0.28, loss_type="dapo")
    # s0 t0: -min(1.5, 1.28) = -1.28 (high clip)   s0 t1: -min(0.5, 0.8) = -0.5
    # s1 t0: -min(-0.5, -0.8) = 0.8 (low clip)      s1 t1: -min(-1.5, -1.28) = 1.5
    # dapo: (-1.28 - 0.5 + 0.8 + 1.5) / 4 = 0.52 / 4 = 0.13
    close(out.loss, 0.13)
    close(out.clip_ratio_high, 0.25)
    close(out.clip_ratio_low, 0.25)
    close(out.clip_ratio, 0.5)


def test_gspo_ratio_is_per_sequence():
    old = torch.zeros(2, 4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    adv = t([1.0, 1.0])
    base = t([0.3, -0.1, 0.1, 5.0], [0.0, 0.0, 0.0, 0.0])  # seq 0 masked token holds garbage 5.0
    out = grpo_policy_loss(base, old, adv, mask, 0.2, 0.28, "gspo")
    # seq 0: mean log-ratio over its 3 tokens (0.3 - 0.1 + 0.1) / 3 = 0.1 -> every token's ratio exp(0.1)
    close(out.ratio[0], [math.exp(0.1)] * 4)

    changed = base.clone()
    changed[0, 1] += 0.3  # one token: mean becomes 0.2
    changed.requires_grad_()
    out = grpo_policy_loss(changed, old, adv, mask, 0.2, 0.28, "gspo")
    close(out.ratio[0], [math.exp(0.2)] * 4)  # all tokens of the sequence move together
    close(out.ratio[1], [1.0] * 4)  # the other sequence is untouched
    # exp(0.2) = 1.2214 < 1.28: unclipped ; loss = -(exp(0.2) * 1 + 1 * 1) / 2
    close(out.loss, -(math.exp(0.2) + 1.0) / 2.0)
    out.loss.backward()
    # each kept token of seq 0: d/dlogp = -A * exp(0.2) / 3 tokens / 2 sequences ; masked token: 0
    g0 = -math.exp(0.2) / 6.0
    close(changed.grad[0], [g0, g0, g0, 0.0])
    close(changed.grad[1], [-1.0 / 8.0] * 4)  # ratio 1: -A / 4 tokens / 2 sequences


def test_gspo_clips_at_sequence_level_where_grpo_clips_tokens():
    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    adv = t([1.0])
    logprobs = t([[1.0, -1.0]])
    # gspo: mean log-ratio 0 -> ratio 1, no clipping, loss -1
    out = grpo_policy_loss(logprobs, old, adv, mask, 0.2, 0.28, "gspo")
    close(out.loss, -1.0)
    close(out.clip_ratio, 0.0)
    # grpo: token ratios e and 1/e: -min(e, 1.28) = -1.28 (clipped), -min(0.367879, 0.367879) -> mean
    out = grpo_policy_loss(logprobs, old, adv, mask, 0.2, 0.28, "grpo")
    close(out.loss, (-1.28 - math.exp(-1.0)) / 2.0)
    close(out.clip_ratio_high, 0.5)
    # gspo clipped: mean log-ratio 0.5 -> exp(0.5) = 1.648721 > 1.28 -> loss -1.28, no gradient
    clipped_in = t([[0.5, 0.5]]).requires_grad_()
    out = grpo_policy_loss(clipped_in, old, adv, mask, 0.2, 0.28, "gspo")
    close(out.loss, -1.28)
    close(out.clip_ratio_high, 1.0)
    out.loss.backward()
    close(clipped_in.grad, [[0.0, 0.0]])


def test_dapo_token_mean_sharded_equals_global():
    g = torch.Generator().manual_seed(5)
    logprobs = torch.randn(4, 5, generator=g).requires_grad_()
    old = logprobs.detach() + 0.1 * torch.randn(4, 5, generator=g)
    adv = torch.randn(4, generator=g)
    mask = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    kw = {"eps_low": 0.2, "eps_high": 0.28, "loss_type": "dapo"}
    global_loss = grpo_policy_loss(logprobs, old, adv, mask, **kw).loss
    (global_grad,) = torch.autograd.grad(global_loss, logprobs)

    # Two shards (rows 0-1: 4 tokens, rows 2-3: 7 tokens). Each shard's token mean times its own token count
    # is its masked_sum; the global mean is sum(shard sums) / sum(shard counts) = (4 * l0 + 7 * l1) / 11.
    shards = [slice(0, 2), slice(2, 4)]
    losses = [grpo_policy_loss(logprobs[s], old[s], adv[s], mask[s], **kw).loss for s in shards]
    counts = [mask[s].sum() for s in shards]
    total = sum(counts)
    combined = sum(loss * n for loss, n in zip(losses, counts, strict=True)) / total
    close(combined, global_loss.item())
    # The naive mean of shard means weights the 4-token shard like the 7-token one and is wrong.
    assert abs((losses[0] + losses[1]).item() / 2 - global_loss.item()) > 1e-3
    # Gradients: each rank backprops loss_i * n_i * world / N (N all-reduced); DDP averages over the world.
    world = len(shards)
    rank_losses = [loss * n * world / total for loss, n in zip(losses, counts, strict=True)]
    (sharded_grad,) = torch.autograd.grad(sum(rank_losses) / world, logprobs)
    torch.testing.assert_close(sharded_grad, global_grad, atol=1e-7, rtol=0.0)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "gspo"])
def test_micro_batches_with_the_batch_normalizer_equal_the_whole_batch(loss_type):
    # Stage 3 splits one optimizer step's completions into micro-batches (and ranks); with the whole batch's
    # units as normalizer their summed losses and gradients equal the whole batch's. Row 4 has no tokens.
    g = torch.Generator().manual_seed(7)
    logprobs = torch.randn(5, 5, generator=g).requires_grad_()
    old = logprobs.detach() + 0.1 * torch.randn(5, 5, generator=g)
    adv = torch.randn(5, generator=g)
    mask = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]])
    kw = {"eps_low": 0.2, "eps_high": 0.28, "loss_type": loss_type, "max_completion_length": 6}
    whole = grpo_policy_loss(logprobs, old, adv, mask, **kw).loss
    (whole_grad,) = torch.autograd.grad(whole, logprobs)
    parts = [slice(0, 1), slice(1, 3), slice(3, 5)]
    units = sum(float(grpo_loss_units(mask[s], loss_type, 6)) for s in parts)
    assert units == {"grpo": 4, "gspo": 4, "dapo": 11, "dr_grpo": 30}[loss_type]  # by hand
    split = sum(grpo_policy_loss(logprobs[s], old[s], adv[s], mask[s], normalizer=units, **kw).loss for s in parts)
    close(split, whole.item())
    (split_grad,) = torch.autograd.grad(split, logprobs)
    torch.testing.assert_close(split_grad, whole_grad, atol=1e-7, rtol=0.0)
    if loss_type in ("grpo", "gspo", "dapo"):  # the empty row does not dilute the mean
        close(whole, grpo_policy_loss(logprobs[:4], old[:4], adv[:4], mask[:4], **kw).loss.item())
    # micro-batch means averaged (what one would get without the normalizer) differ on unequal parts
    naive = sum(grpo_policy_loss(logprobs[s], old[s], adv[s], mask[s], **kw).loss for s in parts) / 3
    assert abs(naive.item() - whole.item()) > 1e-4


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([10, 15, 16, 18, 20, 25])
    # Lmax 20, buffer 5 -> free up to 15, then -(len - 15) / 5, capped at -1:
    # 10 -> 0 ; 15 -> 0 ; 16 -> -0.2 ; 18 -> -0.6 ; 20 -> -1 ; 25 -> -min(10, 5) / 5 = -1
    close(overlong_penalty(lengths, max_len=20, buffer=5, factor=1.0), [0.0, 0.0, -0.2, -0.6, -1.0, -1.0])
    close(overlong_penalty(lengths, max_len=20, buffer=5, factor=2.0), [0.0, 0.0, -0.4, -1.2, -2.0, -2.0])


def test_dynamic_sampling_mask_drops_constant_groups():
    rewards = t([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0])
    mask = dynamic_sampling_mask(rewards, num_generations=3)
    assert mask.tolist() == [False] * 3 + [True] * 3 + [False] * 3


def test_per_token_nll_by_hand_with_gradient():
    # A token mean over the batch (TRL's rpo_alpha): rows -6 over 3 tokens and -2 over 4 -> 8 / 7
    # (a mean of the rows' own means would give (2 + 0.5) / 2 = 1.25)
    logps = torch.tensor([-6.0, -2.0], requires_grad=True)
    loss = per_token_nll(logps, torch.tensor([3, 4]))
    close(loss.detach(), 8 / 7)
    loss.backward()
    close(logps.grad, [-1 / 7, -1 / 7])  # d/dlogp_i of -(logp_1 + logp_2) / 7
    # One chosen answer of 1 token at log p -4, one of 9 tokens at -1 each: (4 + 9) / 10 = 1.3 (TRL's figure; the
    # mean of per-answer means would be (4 + 1) / 2 = 2.5)
    close(per_token_nll(torch.tensor([-4.0, -9.0]), torch.tensor([1, 9])), 1.3)


def test_best_worst_pairs_by_hand():
    # Three prompts, G = 4 (rows 0-3, 4-7, 8-11):
    #   group 0: 1, 3, 2, 3 -> best 3 (first of the two: row 1), worst 1 (row 0)
    #   group 1: 5, 5, 5, 5 -> all equal: a tie, no pair
    #   group 2: 0, 1, 2, -1 -> best row 10 (2), worst row 11 (-1)
    rewards = t([1.0, 3.0, 2.0, 3.0, 5.0, 5.0, 5.0, 5.0, 0.0, 1.0, 2.0, -1.0])
    p = best_worst_pairs(rewards, 4)
    assert p.chosen.tolist() == [1, 10] and p.rejected.tolist() == [0, 11]
    assert p.ties.item() == 1 and p.unpaired.item() == 0
    # G = 2: every pair is the group itself, unless the two tie.
    p = best_worst_pairs(t([0.5, -1.0, 2.0, 2.0, -3.0, 0.0]), 2)
    assert p.chosen.tolist() == [0, 5] and p.rejected.tolist() == [1, 4] and p.ties.item() == 1


def test_best_worst_pairs_skip_padded_answers():
    # valid False marks answers dropped as too short (all-zero action mask): they never enter a pair, even with
    # the group's best or worst reward.
    #   group 0: valid rows 0 (1) and 2 (2); row 1 (9) and row 3 (-9) are padding -> chosen 2, rejected 0
    #   group 1: valid rows 4, 5 (both 7); row 6 (0) is padding -> a tie among the valid ones
    #   group 2: only row 11 valid -> no pair, counted as unpaired
    #   group 3: nothing valid -> unpaired
    rewards = t([1.0, 9.0, 2.0, -9.0, 7.0, 7.0, 0.0, 7.0, 0.0, 4.0, 1.0, 3.0, 1.0, 2.0, 3.0, 4.0])
    valid = torch.tensor([1, 0, 1, 0, 1, 1, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0]).bool()
    p = best_worst_pairs(rewards, 4, valid)
    assert p.chosen.tolist() == [2] and p.rejected.tolist() == [0]
    assert p.ties.item() == 1 and p.unpaired.item() == 2


def test_best_worst_pairs_all_equal_groups_give_no_pairs():
    p = best_worst_pairs(torch.zeros(6), 3)
    assert p.chosen.numel() == 0 and p.rejected.numel() == 0 and p.ties.item() == 2 and p.unpaired.item() == 0
    assert p.chosen.dtype == torch.int64  # empty, but still usable as an index
    with pytest.raises(ValueError, match="num_generations"):
        best_worst_pairs(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="multiple"):
        best_worst_pairs(torch.zeros(5), 2)


# ------------------------------------------------------------------------------------------------------------
# Other stages (docs/algorithms.md, DPO family and Distillation)
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("label_smoothing", [0.0, 0.3])
def test_dpo_equal_logprobs_is_log2(label_smoothing):
    g = torch.Generator().manual_seed(6)
    pc, px = torch.randn(5, generator=g), torch.randn(5, generator=g)
    out = dpo_loss(pc, px, pc.clone(), px.clone(), beta=0.1, label_smoothing=label_smoothing)
    close(out.loss, math.log(2.0))
    close(out.reward_accuracy, 0.5)  # all ties
    close(out.reward_margin, 0.0)


def test_dpo_sigmoid_with_label_smoothing_by_hand():
    pc, px, rc, rx = t([-1.0]), t([-3.0]), t([-2.0]), t([-2.5])
    # h = (-1 + 2) - (-3 + 2.5) = 1 + 0.5 = 1.5 ; beta * h = 0.15
    # loss = 0.9 * sp(0.15) + 0.1 * sp(-0.15) = 0.9 * 0.621527 + 0.1 * 0.771527 = 0.635957
    out = dpo_loss(pc, px, rc, rx, beta=0.1, label_smoothing=0.1)
    close(out.loss, 0.9 * sp(0.15) + 0.1 * sp(-0.15))
    close(out.chosen_rewards, [0.1])  # 0.1 * (-1 + 2)
    close(out.rejected_rewards, [-0.05])  # 0.1 * (-3 + 2.5)
    close(out.reward_accuracy, 1.0)
    close(out.reward_margin, 0.15)


def test_ipo_by_hand():
    pc, px = t([-1.0, -2.0]), t([-3.0, -2.0])
    rc, rx = t([-2.0, -1.0]), t([-2.5, -1.0])
    # pair 0: h = 1.5 ; pair 1: h = (-2 + 1) - (-2 + 1) = 0 ; beta 0.5 -> 1 / (2 * 0.5) = 1
    # (1.5 - 1)^2 = 0.25 ; (0 - 1)^2 = 1 -> mean 0.625
    close(dpo_loss(pc, px, rc, rx, beta=0.5, loss_type="ipo").loss, 0.625)


def test_cdpo_by_hand_with_gradient():
    # cdpo is the sigmoid loss with label smoothing eps (Mitchell 2023); h = 1.5, beta 0.1 -> beta * h = 0.15
    pc, px = torch.tensor([-1.0], requires_grad=True), torch.tensor([-3.0], requires_grad=True)
    out = dpo_loss(pc, px, t([-2.0]), t([-2.5]), beta=0.1, label_smoothing=0.2, loss_type="cdpo")
    # loss = 0.8 * sp(0.15) + 0.2 * sp(-0.15) = 0.8 * 0.620957 + 0.2 * 0.770957 = 0.650957
    close(out.loss, 0.650957, atol=1e-6)
    out.loss.backward()
    # d loss / d h = beta * (-(1 - eps) * sigmoid(-0.15) + eps * sigmoid(0.15))
    #              = 0.1 * (-0.8 * 0.462570 + 0.2 * 0.537430) = 0.1 * (-0.370056 + 0.107486) = -0.026257
    # h = pc - px + const: d/d pc = -0.026257, d/d px = +0.026257
    close(pc.grad, [-0.026257], atol=1e-6)
    close(px.grad, [0.026257], atol=1e-6)
    # eps = 0 is plain DPO
    close(dpo_loss(t([-1.0]), t([-3.0]), t([-2.0]), t([-2.5]), 0.1, loss_type="cdpo").loss, sp(0.15))


def test_ipo_gradient_by_hand():
    pc = torch.tensor([-1.0], requires_grad=True)
    out = dpo_loss(pc, t([-3.0]), t([-2.0]), t([-2.5]), beta=0.5, loss_type="ipo")
    out.loss.backward()
    # h = 1.5, 1 / (2 beta) = 1 -> loss (0.5)^2 = 0.25, d/d pc = 2 * (1.5 - 1) = 1
    close(out.loss, 0.25)
    close(pc.grad, [1.0])


def test_simpo_by_hand_with_gradient():
    # Length-averaged log-probs (SimPO eq. 6): chosen -0.5, -1.0 ; rejected -1.0, -0.6 ; beta 2, gamma 0.5
    c = torch.tensor([-0.5, -1.0], requires_grad=True)
    x = torch.tensor([-1.0, -0.6], requires_grad=True)
    out = simpo_loss(c, x, beta=2.0, gamma=0.5)
    # pair 0: 2 * (-0.5 + 1.0) - 0.5 = 0.5 -> -logsigmoid(0.5) = log(1 + e^-0.5) = 0.474077
    # pair 1: 2 * (-1.0 + 0.6) - 0.5 = -1.3 -> -logsigmoid(-1.3) = log(1 + e^1.3) = 1.541008 ; mean 1.007543
    close(out.loss, 1.007543, atol=1e-6)
    close(out.chosen_rewards, [-1.0, -2.0])
    close(out.rejected_rewards, [-2.0, -1.2])
    close(out.reward_accuracy, 0.5)
    close(out.reward_margin, (1.0 - 0.8) / 2)
    out.loss.backward()
    # d/d c_i = -beta * sigmoid(-z_i) / 2 (mean over 2): z0 = 0.5 -> sigmoid(-0.5) = 0.377541 -> -0.377541
    # z1 = -1.3 -> sigmoid(1.3) = 0.785835 -> -0.785835
    close(c.grad, [-0.377541, -0.785835], atol=1e-6)
    close(x.grad, [0.377541, 0.785835], atol=1e-6)


def test_simpo_equal_logprobs_without_margin_is_log2():
    avg = torch.tensor([-0.7, -1.3])
    close(simpo_loss(avg, avg.clone(), beta=2.0, gamma=0.0).loss, math.log(2.0))


def test_kd_loss_by_hand():
    T = 2.0
    ln2 = math.log(2.0)
    student = t([[[2 * ln2, 0.0, 0.0], [1.0, 2.0, 3.0], [0.0, 0.0, 100.0]]])
    teacher = t([[[0.0, 0.0, 0.0], [1.0, 2.0, 3.0], [100.0, 0.0, 0.0]]])
    mask = torch.tensor([[1, 1, 0]])  # token 2 is prompt/padding: its huge disagreement must not count
    out = kd_loss(student, teacher, mask, temperature=T)
    # token 0: teacher/T uniform (1/3 each); student/T = [ln 2, 0, 0] -> probs [1/2, 1/4, 1/4]
    #   KL = 1/3 * log((1/3) / (1/2)) + 2/3 * log((1/3) / (1/4)) = 1/3 log(2/3) + 2/3 log(4/3) = 0.056633
    # token 1: identical -> 0 ; loss = T^2 * (0.056633 + 0) / 2 = 0.113266
    kl0 = math.log(2 / 3) / 3 + 2 * math.log(4 / 3) / 3
    close(out.loss, T**2 * kl0 / 2)
    close(out.top1_agreement, 1.0)  # argmax: 0 vs 0 (first of ties), 2 vs 2
    same = kd_loss(teacher, teacher, torch.ones(1, 3), temperature=1.0)
    close(same.loss, 0.0)


def test_distill_sft_loss_by_hand():
    ln2, ln3 = math.log(2.0), math.log(3.0)
    labels = torch.tensor([[-100, 0, 1]])  # logits at t predict labels[t + 1]: positions 0 and 1 count
    student = t([[[0.0, 0.0], [ln3, 0.0], [50.0, -50.0]]])  # position 2 predicts nothing: never counted
    # The teacher's logits are one column wider (a checkpoint padded to another width); the extra column, and
    # its huge value, must be cut off, not enter the softmax.
    teacher = t([[[0.0, 0.0, 9.0], [0.0, ln3, 9.0], [-50.0, 50.0, 9.0]]])
    out = distill_sft_loss(student, teacher, labels, coef=0.25, temperature=1.0)
    # CE: position 0 p = [1/2, 1/2] -> -log 1/2 = ln 2; position 1 p = [3/4, 1/4], target 1 -> ln 4; mean 1.5 ln 2
    # KL(teacher || student): position 0 equal -> 0; position 1 teacher [1/4, 3/4] vs student [3/4, 1/4]:
    #   1/4 ln(1/3) + 3/4 ln 3 = ln 3 / 2; mean over the two tokens ln 3 / 4 (T = 1: no scaling)
    close(out.ce, 1.5 * ln2)
    close(out.kd, ln3 / 4)
    close(out.loss, 0.75 * 1.5 * ln2 + 0.25 * ln3 / 4)
    close(out.top1_agreement, 0.5)  # position 0: 0 vs 0 (first of ties); position 1: 0 vs 1
    # coef 0 is plain SFT (the model's own token-mean CE), coef 1 pure distillation
    close(distill_sft_loss(student, teacher, labels, coef=0.0).loss, 1.5 * ln2)
    close(distill_sft_loss(student, teacher, labels, coef=1.0).loss, ln3 / 4)
    # T = 2 on position 1: teacher [0, ln3/2] -> [1/(1+sqrt3), sqrt3/(1+sqrt3)], student the mirror; T^2 * KL / 2
    r3 = math.sqrt(3.0)
    q, q2 = 1 / (1 + r3), r3 / (1 + r3)
    kl = q * math.log(q / q2) + q2 * math.log(q2 / q)
    close(distill_sft_loss(student, teacher, labels, coef=1.0, temperature=2.0).loss, 4 * kl / 2)


# ------------------------------------------------------------------------------------------------------------
# Packaging
# ------------------------------------------------------------------------------------------------------------


def test_import_does_not_pull_deepspeed_or_transformers():
    code = (
        "import dschat.losses, sys; "
        "assert 'deepspeed' not in sys.modules and 'transformers' not in sys.modules, "
        "sorted(m for m in sys.modules if m.split('.')[0] in ('deepspeed', 'transformers'))"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)


# --------------------------------------------------------------------------------------------------
# Critic-free estimators: RLOO, REINFORCE++ (and its group baseline), ReMax
# --------------------------------------------------------------------------------------------------


def test_rloo_leave_one_out_by_hand():
    # group 1 (k = 3): [1, 2, 6]
    #   A_0 = 1 - (2 + 6)/2 = -3, A_1 = 2 - (1 + 6)/2 = -1.5, A_2 = 6 - (1 + 2)/2 = 4.5
    #   (= k/(k-1) * (r - mean) = 1.5 * ([1, 2, 6] - 3))
    # group 2, equal rewards [4, 4, 4]: each baseline is 4, so A = 0 (no gradient, no NaN)
    adv = rloo_advantages(torch.tensor([1.0, 2.0, 6.0, 4.0, 4.0, 4.0]), 3)
    torch.testing.assert_close(adv, torch.tensor([-3.0, -1.5, 4.5, 0.0, 0.0, 0.0]), rtol=0, atol=1e-6)
    # k = 2: each answer against the other, r_i - r_j
    torch.testing.assert_close(rloo_advantages(torch.tensor([0.5, -1.0]), 2), torch.tensor([1.5, -1.5]))
    # against the closed form k/(k-1) * (r - group mean), on random rewards
    r = torch.randn(12, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(rloo_advantages(r, 4), 4 / 3 * group_advantages(r, 4, "none"), rtol=0, atol=1e-6)
    with pytest.raises(ValueError):
        rloo_advantages(torch.ones(3), 1)  # one sample has no "others"
    with pytest.raises(ValueError):
        rloo_advantages(torch.ones(5), 2)


def test_remax_greedy_baseline_by_hand():
    # prompt 1: samples 1.0, 0.5 vs greedy 0.5 -> 0.5, 0; prompt 2: sample -1 vs greedy 0 -> -1
    adv = remax_advantages(torch.tensor([1.0, 0.5, -1.0]), torch.tensor([0.5, 0.5, 0.0]))
    torch.testing.assert_close(adv, torch.tensor([0.5, 0.0, -1.0]), rtol=0, atol=0)
    # every sample as good as the greedy answer: no gradient
    assert remax_advantages(torch.full((4,), 2.0), torch.full((4,), 2.0)).abs().max() == 0
    with pytest.raises(ValueError):
        remax_advantages(torch.ones(4), torch.ones(2))


def test_discounted_returns_by_hand_with_padding_and_without_eos():
    rewards = torch.tensor([[1.0, 2.0, 3.0, 9.0],  # stopped at EOS after 3 tokens; 9 sits on padding
                            [0.0, 0.0, 0.0, 4.0],  # never reached EOS: every column is an answer token
                            [5.0, 5.0, 5.0, 5.0]])  # dropped short answer: all-zero mask
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    # gamma 0.5, row 0: G2 = 3, G1 = 2 + 0.5*3 = 3.5, G0 = 1 + 0.5*3.5 = 2.75 (the 9 on padding never enters)
    # row 1: G3 = 4, G2 = 0.5*4 = 2, G1 = 1, G0 = 0.5
    out = discounted_returns(rewards, mask, 0.5)
    torch.testing.assert_close(out, torch.tensor([[2.75, 3.5, 3.0, 0.0], [0.5, 1.0, 2.0, 4.0], [0.0] * 4]),
                               rtol=0, atol=1e-6)
    # the same as GAE with V = 0 and lambda = 1
    torch.testing.assert_close(out, gae(torch.zeros(3, 4), rewards, mask, 0.5, 1.0).advantages, rtol=0, atol=1e-6)


def test_reinforce_pp_token_rewards_then_returns_by_hand():
    # REINFORCE++ per token: r_t = -kl_ctl * (logp - ref) + score at the last answer token; gamma 1.
    logp = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-1.5, -1.0, -0.5]])  # logp - ref = [0.5, 0, -0.5]
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])  # row 0 stops after 2 tokens (padding), row 1 has no EOS
    scores = torch.tensor([2.0, 2.0])
    rewards = kl_penalized_rewards(logp, ref, scores, mask, kl_ctl=0.1, clip_reward_value=5.0)
    # row 0: [-0.05, 0 + 2, pad 0]; row 1: [-0.05, 0, +0.05 + 2 = 2.05]
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 2.0, 0.0], [-0.05, 0.0, 2.05]]), rtol=0, atol=1e-6)
    # returns (sum of what follows): row 0: [1.95, 2, 0]; row 1: [2.0, 2.05, 2.05]
    torch.testing.assert_close(discounted_returns(rewards, mask, 1.0),
                               torch.tensor([[1.95, 2.0, 0.0], [2.0, 2.05, 2.05]]), rtol=0, atol=1e-6)


def test_global_whitening_two_shards_equal_the_whole_batch_by_hand():
    # Kept returns 1, 2 (shard A) and 3 (shard B): mean 2, unbiased var ((1)^2 + 0 + 1^2) / 2 = 1 -> -1, 0, 1.
    a, mask_a = torch.tensor([[1.0, 2.0, 7.0]]), torch.tensor([[1, 1, 0]])  # 7 on padding
    b, mask_b = torch.tensor([[3.0, -5.0]]), torch.tensor([[1, 0]])
    mom_a, mom_b = masked_moments(a, mask_a), masked_moments(b, mask_b)
    torch.testing.assert_close(mom_a, torch.tensor([2.0, 3.0, 5.0], dtype=torch.float64))  # count, sum, 1 + 4
    torch.testing.assert_close(mom_b, torch.tensor([1.0, 3.0, 9.0], dtype=torch.float64))
    total = mom_a + mom_b  # what E.all_reduce_sum gives across two ranks (or two micro-batches)
    torch.testing.assert_close(whiten_from_moments(a, mask_a, total), torch.tensor([[-1.0, 0.0, 0.0]]),
                               rtol=0, atol=1e-6)
    torch.testing.assert_close(whiten_from_moments(b, mask_b, total), torch.tensor([[1.0, 0.0]]), rtol=0, atol=1e-6)
    # whitening each shard alone would not: shard B's single token comes back 0, not 1
    assert whiten_from_moments(b, mask_b, mom_b)[0, 0].item() == 0.0
    # random shards of uneven width: concatenated, the same as whiten() over the whole padded batch
    g = torch.Generator().manual_seed(1)
    x1, x2 = torch.randn(3, 5, generator=g) * 3 + 1, torch.randn(2, 5, generator=g) * 3 + 1
    m1, m2 = torch.rand(3, 5, generator=g) > 0.3, torch.rand(2, 5, generator=g) > 0.3
    moments = masked_moments(x1, m1) + masked_moments(x2, m2)
    whole = whiten(torch.cat([x1, x2]), torch.cat([m1, m2]))
    torch.testing.assert_close(torch.cat([whiten_from_moments(x1, m1, moments), whiten_from_moments(x2, m2, moments)]),
                               whole, rtol=0, atol=1e-5)


def test_reinforce_pp_baseline_equal_group_gives_zero_advantages():
    # reinforce_pp_baseline: scores minus their group mean first. A group of equal scores (and no KL) has zero
    # return everywhere, and a whole batch of them whitens to 0, not NaN (variance 0 + eps).
    scores = group_advantages(torch.tensor([3.0, 3.0, 1.0, 1.0]), 2, "none")  # all 0
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    zeros = torch.zeros(4, 3)
    returns = discounted_returns(kl_penalized_rewards(zeros, zeros, scores, mask, 0.1, 5.0), mask, 1.0)
    adv = whiten_from_moments(returns, mask, masked_moments(returns, mask))
    assert torch.equal(adv, torch.zeros(4, 3))



def test_the_decoupled_loss_of_asynchronous_rollouts_matches_a_hand_computation():
    # One answer of two tokens, advantage 1, eps 0.2, cap C = 1.2. The sampler (behaviour mu) gave the tokens
    # 0.5 and 0.2; the trainer before its update (proximal) gives 0.4 and 0.3; the trainer now gives 0.44, 0.45.
    #   w = min(prox / mu, C) = (0.8, min(1.5, 1.2) = 1.2);   r = theta / prox = (1.1, 1.5 -> clipped 1.2)
    #   per token -w * min(r A, clip(r) A) = (-0.8 * 1.1, -1.2 * 1.2) = (-0.88, -1.44): mean -1.16
    from dschat.rlhf.rollout import Rollout, importance_weights

    mu, prox, theta = (torch.tensor([[math.log(a), math.log(b)]]) for a, b in ((0.5, 0.2), (0.4, 0.3), (0.44, 0.45)))
    mask = torch.ones(1, 2, dtype=torch.long)
    rollout = Rollout(torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.long), mask, 1,
                      torch.tensor([True]), None, mu, None, "async")
    weights, stats = importance_weights(rollout, prox, "token", cap=1.2)
    torch.testing.assert_close(weights, torch.tensor([[0.8, 1.2]]))
    assert stats["async/is_weight_mean"] == pytest.approx(1.0) and stats["async/is_truncated_frac"] == 0.5
    d = (math.log(0.8), math.log(1.5))  # k3 of KL(mu || prox) per token: exp(d) - 1 - d, d = log prox - log mu
    assert stats["async/kl_behaviour_prox"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 2, rel=1e-5)
    assert stats["async/logprob_diff_max"] == pytest.approx(math.log(1.5), rel=1e-5)
    ppo = ppo_policy_loss(theta, prox, torch.ones(1, 2), mask, 0.2, weights)
    grpo = grpo_policy_loss(theta, prox, torch.ones(1), mask, 0.2, 0.2, "grpo", weights=weights)
    assert ppo.loss.item() == pytest.approx(-1.16, rel=1e-5) and grpo.loss.item() == pytest.approx(-1.16, rel=1e-5)
    same, _ = importance_weights(rollout, mu, "token", cap=1.2)  # lag 0 on an exact sampler: prox = mu, w = 1
    assert torch.equal(same, torch.ones(1, 2))
