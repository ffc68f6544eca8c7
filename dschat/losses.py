"""Losses and RL math for every dschat stage, as small pure functions of tensors.

Nothing here knows about models, configs, ranks or ``torch.distributed``: each function takes tensors and
plain numbers and returns tensors (losses come back as a NamedTuple of the loss plus detached stats). That
keeps every formula of docs/algorithms.md unit-testable against hand-worked numbers, and keeps
``import dschat.losses`` free of deepspeed and transformers.

Shape conventions (the names used throughout dschat):
    B  rows (sequences, or pairs for pairwise losses)
    T  tokens per row; token tensors are ``(B, T)`` and ``action_mask`` marks the answer tokens that count
    V  vocabulary size
    ``logprobs`` (current policy), ``old_logprobs`` (policy that generated the experience), ``ref_logprobs``
    (frozen reference), ``values`` / ``old_values`` (critic), ``rewards``, ``advantages``, ``returns``.

Masks may be bool or 0/1 integer/float tensors; any non-zero entry counts as "keep". Masked positions may hold
any finite garbage (padding logits, values of pad tokens): reductions select with ``torch.where`` rather than
multiply, so they never enter a result.

Distributed note: reductions here are local. A token mean over a sharded batch equals the global one only when
combined as ``sum(masked_sum) / sum(count)`` across shards (see the tests); the caller owns that all-reduce.
"""

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

__all__ = [
    "AdaptiveKLController",
    "DPOLossOutput",
    "FixedKLController",
    "GAEOutput",
    "GRPOLossOutput",
    "DistillSFTLossOutput",
    "KDLossOutput",
    "PairwiseLossOutput",
    "PairwiseMetrics",
    "PolicyLossOutput",
    "ValueLossOutput",
    "BestWorstPairs",
    "approx_kl",
    "best_worst_pairs",
    "discounted_returns",
    "dpo_loss",
    "dynamic_sampling_mask",
    "end_indices",
    "gae",
    "group_advantages",
    "grpo_policy_loss",
    "distill_sft_loss",
    "kd_loss",
    "kl_penalized_rewards",
    "last_token_pairwise_loss",
    "masked_mean",
    "masked_moments",
    "masked_sum",
    "masked_var",
    "overlong_penalty",
    "pairwise_loss",
    "pairwise_metrics",
    "implicit_rewards",
    "per_token_nll",
    "ppo_policy_loss",
    "ppo_value_loss",
    "remax_advantages",
    "rloo_advantages",
    "selective_log_softmax",
    "simpo_loss",
    "whiten",
    "whiten_from_moments",
]

KLEstimator = Literal["k1", "k2", "k3"]
GRPOLossType = Literal["grpo", "dr_grpo", "dapo", "gspo"]
ScaleRewards = Literal["group", "batch", "none"]
DPOLossType = Literal["sigmoid", "ipo", "cdpo"]

# exp() of a log-ratio beyond +-20 overflows fp16 and makes k3 explode. The peers differ: veRL clamps the
# log-ratio (at 20) and the KL estimate (at 10), OpenRLHF clamps the KL estimate only (at 10), and TRL's k3 has no
# clamp; dschat clamps the log-ratio, which leaves every k3 below e^20 exact.
LOG_RATIO_CLAMP = 20.0


# --------------------------------------------------------------------------------------------------
# Output tuples: the loss keeps its graph, every stat is detached.
# --------------------------------------------------------------------------------------------------


class PairwiseLossOutput(NamedTuple):
    loss: torch.Tensor  # () scalar, mean over pairs
    chosen_scores: torch.Tensor  # (B,) detached end scores of the chosen sequences
    rejected_scores: torch.Tensor  # (B,) detached end scores of the rejected sequences


class PairwiseMetrics(NamedTuple):
    accuracy: torch.Tensor  # () fraction of pairs with chosen > rejected, ties count half
    chosen_mean: torch.Tensor  # () mean chosen score
    rejected_mean: torch.Tensor  # () mean rejected score
    margin_mean: torch.Tensor  # () mean of chosen - rejected


class GAEOutput(NamedTuple):
    advantages: torch.Tensor  # (B, T), 0 where action_mask is 0
    returns: torch.Tensor  # (B, T), advantages + values, 0 where action_mask is 0


class PolicyLossOutput(NamedTuple):
    loss: torch.Tensor  # () scalar
    clip_frac: torch.Tensor  # () fraction of answer tokens where the clipped term was chosen
    approx_kl: torch.Tensor  # () k3 estimate of KL(old || new) over answer tokens


class ValueLossOutput(NamedTuple):
    loss: torch.Tensor  # () scalar
    clip_frac: torch.Tensor  # () fraction of answer tokens where the clipped value error was chosen


class GRPOLossOutput(NamedTuple):
    loss: torch.Tensor  # () scalar
    clip_ratio_low: torch.Tensor  # () fraction clipped at 1 - eps_low with A < 0
    clip_ratio_high: torch.Tensor  # () fraction clipped at 1 + eps_high with A > 0
    clip_ratio: torch.Tensor  # () low + high
    kl: torch.Tensor  # () mean per-token KL to the reference (0 without ref_logprobs)
    ratio: torch.Tensor  # (B, T) detached importance ratio; for gspo each token holds its sequence's ratio


class DPOLossOutput(NamedTuple):
    loss: torch.Tensor  # () scalar
    chosen_rewards: torch.Tensor  # (B,) detached beta * (pi_c - ref_c)
    rejected_rewards: torch.Tensor  # (B,) detached beta * (pi_x - ref_x)
    reward_accuracy: torch.Tensor  # () chosen_rewards > rejected_rewards, ties count half
    reward_margin: torch.Tensor  # () mean of chosen_rewards - rejected_rewards


class BestWorstPairs(NamedTuple):
    chosen: torch.Tensor  # (M,) int64 row of each pair's best-rewarded completion
    rejected: torch.Tensor  # (M,) int64 row of its worst-rewarded completion, same group
    ties: torch.Tensor  # () int64 groups skipped because their valid completions' rewards are all equal
    unpaired: torch.Tensor  # () int64 groups skipped for having fewer than two valid completions


class KDLossOutput(NamedTuple):
    loss: torch.Tensor  # () scalar, T^2 * mean token KL(teacher_T || student_T)
    top1_agreement: torch.Tensor  # () fraction of answer tokens where student and teacher argmax agree


class DistillSFTLossOutput(NamedTuple):
    loss: torch.Tensor  # () (1 - coef) * ce + coef * kd
    ce: torch.Tensor  # () detached: mean token cross-entropy of the labels
    kd: torch.Tensor  # () detached: T^2 * mean token KL(teacher_T || student_T)
    top1_agreement: torch.Tensor  # () detached


# --------------------------------------------------------------------------------------------------
# Masked reductions
# --------------------------------------------------------------------------------------------------


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over positions where ``mask`` is non-zero.

    Args:
        x: any shape, e.g. ``(B, T)``.
        mask: broadcastable to ``x``; non-zero = keep.
        dim: dimension to reduce; ``None`` reduces everything to a scalar.
    """
    # where() and not x * mask: a NaN/inf at a padded position must not turn the sum into NaN.
    kept = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim)


def _mask_count(x: torch.Tensor, mask: torch.Tensor, dim: int | None) -> torch.Tensor:
    count = mask.bool().expand_as(x).to(x.dtype)
    return count.sum() if dim is None else count.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is non-zero; an empty selection gives 0 (not NaN).

    Args:
        x: any shape, e.g. ``(B, T)``.
        mask: broadcastable to ``x``.
        dim: ``None`` for one scalar over all kept elements (a token mean), or a dim, e.g. ``dim=1`` for a
            per-sequence mean ``(B,)``.
    """
    # The count is a whole number, so clamping it to 1 only changes the empty case (sum 0 / 1 = 0).
    return masked_sum(x, mask, dim) / _mask_count(x, mask, dim).clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over kept positions (Bessel-corrected by default, like ``torch.var``)."""
    mean = masked_mean(x, mask, dim)
    if dim is not None:
        mean = mean.unsqueeze(dim)
    var = masked_mean((x - mean) ** 2, mask, dim)
    if unbiased:
        n = _mask_count(x, mask, dim)
        # n == 1 has zero spread; clamp avoids 0/0.
        var = var * n / (n - 1).clamp(min=1)
    return var


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalise ``x`` to mean 0 and (unbiased) variance 1 over the kept positions of the whole tensor.

    Used for advantage whitening (optional; docs/algorithms.md, PPO). With ``shift_mean=False`` the mean is kept
    and only the scale changes (as is usual when whitening rewards). Masked positions come back as 0.

    Args:
        x: ``(B, T)`` e.g. advantages.
        mask: ``(B, T)`` action mask.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask.bool(), out, torch.zeros((), dtype=out.dtype, device=out.device))


# --------------------------------------------------------------------------------------------------
# Token helpers
# --------------------------------------------------------------------------------------------------


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[..., index]`` without materialising the full ``(B, T, V)`` log-softmax.

    Equivalent to ``logits.log_softmax(-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)``.

    Args:
        logits: ``(B, T, V)`` (any leading shape ``(..., V)``).
        index: ``(B, T)`` token ids (same leading shape), all in ``[0, V)``; mask out -100 labels first.

    Returns:
        ``(B, T)`` log-probs; float32 for fp16/bf16 logits, else the logits' dtype.
    """
    if logits.dtype in (torch.float32, torch.float64):
        # log p(i) = z_i - logsumexp(z): one gather and one reduction instead of a (B, T, V) copy.
        picked = torch.gather(logits, -1, index.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1)
    # Half precision: logsumexp in fp16/bf16 loses the small differences a PPO ratio depends on, so upcast,
    # but one row at a time so only a (T, V) float32 copy exists at once.
    rows = [
        row_logits.float().log_softmax(-1).gather(-1, row_index.unsqueeze(-1)).squeeze(-1)
        for row_logits, row_index in zip(logits, index, strict=True)
    ]
    return torch.stack(rows)


def end_indices(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last real (mask non-zero) token of each row.

    Read from the mask, never from the pad id: pad may equal EOS or BOS (Llama, Qwen), so "first pad id" would
    cut real EOS tokens (DeepSpeed-Chat issue #316). Works for left or right padding. An all-zero row gives 0.

    Args:
        attention_mask: ``(B, T)``.

    Returns:
        ``(B,)`` int64 indices.
    """
    positions = torch.arange(attention_mask.size(-1), device=attention_mask.device)
    return torch.where(attention_mask.bool(), positions, 0).amax(dim=-1)


# --------------------------------------------------------------------------------------------------
# Stage 2: reward model losses (docs/algorithms.md, Reward-model loss)
# --------------------------------------------------------------------------------------------------


def pairwise_loss(
    chosen_values: torch.Tensor,
    rejected_values: torch.Tensor,
    chosen_ids: torch.Tensor,
    rejected_ids: torch.Tensor,
    chosen_mask: torch.Tensor,
    rejected_mask: torch.Tensor,
) -> PairwiseLossOutput:
    """DeepSpeed-Chat's divergence-truncated pairwise loss, made pad-safe (docs/algorithms.md, Reward-model loss).

    For each pair, ``c_end`` / ``x_end`` = one past the last real token (from the attention mask), ``div`` =
    first position where the two sequences differ (a token differs, or one is real and the other padding),
    ``end = max(c_end, x_end)``. The loss of the pair is the mean over ``t in [div, end)`` of
    ``-logsigmoid(r_c[t] - r_x[t])``, where a position at or past a sequence's own end uses that sequence's
    end score. Unlike DeepSpeed-Chat (issue #316), pad positions are never compared, so the values the model
    happens to produce on padding cannot move the loss. The shared prompt/prefix carries no preference signal,
    hence the truncation at ``div`` (Ouyang et al. 2022 compare whole answers; DeepSpeed-Chat compares the
    diverging tail token by token).

    Identical pairs are dropped by the data pipeline (docs/data.md, Drops and the cache); if one slips through,
    the pair compares only its end scores (``div = end - 1``) instead of producing an empty mean.

    Args:
        chosen_values, rejected_values: ``(B, L)`` per-token values ``v_head(h)``.
        chosen_ids, rejected_ids: ``(B, L)`` token ids, right-padded to the same ``L``.
        chosen_mask, rejected_mask: ``(B, L)`` attention masks.

    Returns:
        loss (mean over pairs, float32) and the detached end scores ``(B,)`` of chosen and rejected.
    """
    length = chosen_ids.size(1)
    positions = torch.arange(length, device=chosen_ids.device).unsqueeze(0)  # (1, L)
    c_real, x_real = chosen_mask.bool(), rejected_mask.bool()

    c_last, x_last = end_indices(c_real), end_indices(x_real)  # (B,)
    c_end, x_end = c_last + 1, x_last + 1
    end = torch.maximum(c_end, x_end)

    # A position differs when exactly one side is real, or both are real with different ids. Comparing ids
    # alone would call "answer" and "answer + EOS" identical when pad == EOS.
    differs = (c_real != x_real) | (c_real & x_real & (chosen_ids != rejected_ids))  # (B, L)
    first_diff = differs.to(torch.int64).argmax(dim=1)  # argmax returns the first maximal index
    div = torch.where(differs.any(dim=1), first_diff, end - 1)

    # Float32 for the loss: v_head outputs in bf16 would round the small score gaps logsigmoid sees.
    c_vals, x_vals = chosen_values.float(), rejected_values.float()
    c_score = c_vals.gather(1, c_last.unsqueeze(1))  # (B, 1)
    x_score = x_vals.gather(1, x_last.unsqueeze(1))
    c_eff = torch.where(positions < c_end.unsqueeze(1), c_vals, c_score)  # past its end: the end score
    x_eff = torch.where(positions < x_end.unsqueeze(1), x_vals, x_score)

    window = (positions >= div.unsqueeze(1)) & (positions < end.unsqueeze(1))  # (B, L)
    per_pair = masked_mean(-F.logsigmoid(c_eff - x_eff), window, dim=1)  # (B,)
    return PairwiseLossOutput(
        loss=per_pair.mean(),
        chosen_scores=c_score.squeeze(1).detach(),
        rejected_scores=x_score.squeeze(1).detach(),
    )


def last_token_pairwise_loss(
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    margin: torch.Tensor | None = None,
    center_coef: float = 0.0,
) -> PairwiseLossOutput:
    """Bradley-Terry loss on end scores (``--rm-loss last-token``; docs/algorithms.md, Reward-model loss).

    ``loss_i = -logsigmoid(c_i - x_i - margin_i) + center_coef * (c_i + x_i)^2``, mean over pairs. The
    margin is Llama 2's preference-strength margin (Touvron et al. 2023, sec. 3.2.2); the centring term keeps
    scores near zero (Eisenstein et al. 2023, "Helping or Herding?"), which the loss alone leaves free.

    Args:
        chosen_scores, rejected_scores: ``(B,)`` end scores.
        margin: ``(B,)`` or scalar, optional.
        center_coef: weight of the centring term; 0 disables it.
    """
    c, x = chosen_scores.float(), rejected_scores.float()
    logits = c - x
    if margin is not None:
        logits = logits - margin
    per_pair = -F.logsigmoid(logits)
    if center_coef:
        per_pair = per_pair + center_coef * (c + x) ** 2
    return PairwiseLossOutput(
        loss=per_pair.mean(),
        chosen_scores=chosen_scores.detach(),
        rejected_scores=rejected_scores.detach(),
    )


@torch.no_grad()
def pairwise_metrics(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> PairwiseMetrics:
    """Reward-model eval metrics: accuracy with ties counted half, mean scores, mean margin.

    Ties count half so that a constant model scores 0.5, not 0 or 1.

    Args:
        chosen_scores, rejected_scores: ``(B,)``.
    """
    c, x = chosen_scores.float(), rejected_scores.float()
    wins = (c > x).float() + 0.5 * (c == x).float()
    return PairwiseMetrics(
        accuracy=wins.mean(),
        chosen_mean=c.mean(),
        rejected_mean=x.mean(),
        margin_mean=(c - x).mean(),
    )


# --------------------------------------------------------------------------------------------------
# Stage 3: PPO (docs/algorithms.md, PPO)
# --------------------------------------------------------------------------------------------------


def approx_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLEstimator = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi (Schulman, "Approximating KL Divergence", 2020).

    With ``log_r = ref_logprobs - logprobs``:
        k1 = -log_r                  (unbiased, high variance, can be negative)
        k2 = 0.5 * log_r^2           (biased, low variance, >= 0)
        k3 = exp(log_r) - log_r - 1  (unbiased, >= 0; DeepSeekMath's GRPO KL term), with ``log_r`` clamped
                                     to +-20 first so ``exp`` stays finite.

    Args:
        logprobs, ref_logprobs: ``(B, T)``; the samples come from the distribution of ``logprobs``.
        kind: ``"k1" | "k2" | "k3"``.

    Returns:
        ``(B, T)`` per-token estimates, unmasked (reduce with ``masked_mean``).
    """
    log_r = ref_logprobs - logprobs
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r**2
    if kind == "k3":
        # Only the exp needs the clamp; k1/k2 stay exact.
        log_r = log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return torch.exp(log_r) - log_r - 1.0
    raise ValueError(f"unknown KL estimator {kind!r}; expected 'k1', 'k2' or 'k3'")


def kl_penalized_rewards(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    scores: torch.Tensor,
    action_mask: torch.Tensor,
    kl_ctl: float,
    clip_reward_value: float,
) -> torch.Tensor:
    """Per-token PPO rewards (Ziegler et al. 2019, Ouyang et al. 2022).

    ``r_t = -kl_ctl * (logprobs_t - ref_logprobs_t)`` on answer tokens, plus
    ``clip(score, -clip_reward_value, clip_reward_value)`` at the last real answer token. The last token is
    found from ``action_mask``, not from the padded length: answers that stop early are padded after EOS, and
    DeepSpeed-Chat's "last position of the tensor" would put the score on padding.

    Args:
        logprobs, ref_logprobs: ``(B, T)`` old actor / reference log-probs of the taken tokens.
        scores: ``(B,)`` reward-model end scores.
        action_mask: ``(B, T)`` answer tokens.
        kl_ctl: KL coefficient (current value of the KL controller).
        clip_reward_value: symmetric clip for the score.

    Returns:
        ``(B, T)`` rewards, 0 outside ``action_mask`` (a row with no answer token gets all zeros).
    """
    rewards = -kl_ctl * (logprobs.float() - ref_logprobs.float())  # (B, T)
    clipped = scores.float().clamp(-clip_reward_value, clip_reward_value)  # (B,)
    last = end_indices(action_mask).unsqueeze(1)  # (B, 1)
    rewards = rewards.scatter_add(1, last, clipped.unsqueeze(1))
    return torch.where(action_mask.bool(), rewards, torch.zeros((), device=rewards.device)).detach()


@torch.no_grad()
def gae(
    values: torch.Tensor,
    rewards: torch.Tensor,
    action_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> GAEOutput:
    """Generalised advantage estimation over answer tokens (Schulman et al. 2016).

    Backwards over t: ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = delta_t + gamma * lam * A_{t+1}``,
    ``R_t = A_t + V_t``, with ``V`` and ``A`` after the last real answer token taken as 0 (the episode ends
    there: answers that stop early are padded, and the padding is not a continuation).

    Positions where ``action_mask`` is 0 output 0 and are skipped: ``t`` bootstraps from the next *kept*
    position, so padding (or a masked prompt prefix) never leaks into a kept position. Computed without grad:
    advantages and returns are targets.

    Args:
        values: ``(B, T)`` critic values ``V_t`` (old values, eval mode).
        rewards: ``(B, T)`` per-token rewards, e.g. from ``kl_penalized_rewards``.
        action_mask: ``(B, T)``.
        gamma: discount [1.0].
        lam: GAE lambda [0.95].

    Returns:
        advantages and returns, ``(B, T)`` each, 0 where masked.
    """
    values, rewards = values.float(), rewards.float()
    keep = action_mask.bool()
    next_value = torch.zeros_like(values[:, 0])  # (B,) V_{t+1}; 0 past the end
    next_adv = torch.zeros_like(values[:, 0])  # (B,) A_{t+1}
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.size(1))):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        # where(), not multiply: garbage at masked positions must not reach the carried state.
        next_value = torch.where(keep[:, t], values[:, t], next_value)
        next_adv = torch.where(keep[:, t], adv, next_adv)
        advantages[:, t] = torch.where(keep[:, t], adv, 0.0)
    returns = torch.where(keep, advantages + values, 0.0)
    return GAEOutput(advantages=advantages, returns=returns)


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    cliprange: float,
    weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate (Schulman et al. 2017), mean over all answer tokens of the batch.

    ``loss = mean_t max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - eps, 1 + eps))``,
    ``ratio = exp(logp - old)``.

    Args:
        logprobs: ``(B, T)`` current actor log-probs (with grad).
        old_logprobs: ``(B, T)`` log-probs at experience time (no grad).
        advantages: ``(B, T)``.
        action_mask: ``(B, T)``.
        cliprange: eps [0.2].
        weights: ``(B, T)`` importance weights per token (``rollout.importance_weights``), or None.

    Returns:
        loss, fraction of tokens where the clipped term won, and k3 KL(old || new).
    """
    old_logprobs, advantages = old_logprobs.detach(), advantages.detach()
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cliprange, 1.0 + cliprange)
    surrogate = torch.maximum(unclipped, clipped)
    if weights is not None:
        surrogate = surrogate * weights.detach()
    loss = masked_mean(surrogate, action_mask)
    # Samples come from the old policy, so KL(old || new) takes old as the sampling side of approx_kl.
    kl = approx_kl(old_logprobs, logprobs.detach(), "k3")
    return PolicyLossOutput(
        loss=loss,
        clip_frac=masked_mean((clipped > unclipped).float(), action_mask).detach(),
        approx_kl=masked_mean(kl, action_mask),
    )


def ppo_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    action_mask: torch.Tensor,
    cliprange_value: float,
) -> ValueLossOutput:
    """Clipped critic loss: ``0.5 * mean_t max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)``.

    The pessimistic max keeps the critic from moving far from the values used to build the advantages in one
    update (as in OpenAI baselines' PPO2; Engstrom et al. 2020 question its benefit, so ``c`` is a flag).

    Args:
        values: ``(B, T)`` current critic values (with grad).
        old_values: ``(B, T)`` values at experience time.
        returns: ``(B, T)`` GAE returns.
        action_mask: ``(B, T)``.
        cliprange_value: c [0.2].
    """
    old_values, returns = old_values.detach(), returns.detach()
    clipped_values = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    err_unclipped = (values - returns) ** 2
    err_clipped = (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(err_unclipped, err_clipped), action_mask)
    return ValueLossOutput(
        loss=loss,
        clip_frac=masked_mean((err_clipped > err_unclipped).float(), action_mask).detach(),
    )


class FixedKLController:
    """Constant KL coefficient (``kl_ctl``)."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op; present so both controllers share one interface."""


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 ("Fine-Tuning LMs from Human Preferences", sec. 2.2).

    ``e = clip(KL / target - 1, -0.2, 0.2)``; ``beta <- beta * (1 + e * n_steps / horizon)``: the coefficient
    grows while the policy drifts further than ``target`` nats and shrinks while it stays closer.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int) -> None:
        self.value = init_kl_coef
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adjust ``value`` after ``n_steps`` samples whose mean KL to the reference was ``current_kl``."""
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


# --------------------------------------------------------------------------------------------------
# GRPO family (docs/algorithms.md, GRPO family)
# --------------------------------------------------------------------------------------------------


def group_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    scale: ScaleRewards = "group",
    eps: float = 1e-4,
) -> torch.Tensor:
    """GRPO advantages (Shao et al. 2024, DeepSeekMath): reward minus its group's mean, optionally scaled.

    ``scale="group"``: divide by the group's std + eps (the original GRPO); ``"batch"``: by the std of all
    rewards in ``rewards`` + eps (Hu 2025, REINFORCE++: per-group std over-weights near-uniform groups);
    ``"none"``: centring only (Liu et al. 2025, Dr. GRPO: the std term biases toward easy/hard prompts).
    Stds are unbiased (Bessel), as ``torch.std``.

    Args:
        rewards: ``(N,)`` with ``N = P * num_generations``, ordered as ``num_generations`` consecutive
            completions per prompt.
        num_generations: G.

    Returns:
        ``(N,)`` advantages, one per completion (broadcast over its tokens by the loss).
    """
    if rewards.dim() != 1 or rewards.numel() % num_generations != 0:
        raise ValueError(
            f"rewards must be 1-D with a multiple of num_generations={num_generations} entries, "
            f"got shape {tuple(rewards.shape)}"
        )
    grouped = rewards.float().view(-1, num_generations)  # (P, G)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)  # (N,)
    if scale == "group":
        std = grouped.std(dim=1).repeat_interleave(num_generations)  # (N,)
        return centred / (std + eps)
    if scale == "batch":
        return centred / (rewards.float().std() + eps)
    if scale == "none":
        return centred
    raise ValueError(f"unknown scale {scale!r}; expected 'group', 'batch' or 'none'")


def grpo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    loss_type: GRPOLossType = "grpo",
    ref_logprobs: torch.Tensor | None = None,
    beta: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    max_completion_length: int | None = None,
    normalizer: float | None = None,
    weights: torch.Tensor | None = None,
) -> GRPOLossOutput:
    """GRPO-family policy loss (docs/algorithms.md, GRPO family).

    Per token: ``-min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A) + beta * kl`` with
    ``ratio = exp(logp - old)`` and ``kl`` the chosen estimator of KL(pi || ref). Aggregation:

    - ``grpo``: mean over each sequence's tokens, then over sequences (Shao et al. 2024). Long answers get
      less weight per token, which Dr. GRPO shows biases length.
    - ``dr_grpo``: sum over all tokens / (B * max_completion_length) (Liu et al. 2025): a constant normaliser.
    - ``dapo``: sum / number of answer tokens in the batch (Yu et al. 2025, DAPO token-level loss). Across
      shards combine as ``sum(masked_sum) / sum(count)``, not as a mean of shard means.
    - ``gspo``: sequence ratio ``exp(mean_t(logp - old))``, clipped at sequence level, sequence loss
      ``-min(s * A, clip(s) * A) + beta * mean_t kl``, averaged over sequences (Zheng et al. 2025, GSPO).
      Every token of a sequence shares one ratio, so one outlier token cannot be clipped away alone.

    Args:
        logprobs: ``(B, T)`` current policy (with grad).
        old_logprobs: ``(B, T)``; with one iteration per generation pass ``logprobs.detach()``.
        advantages: ``(B,)`` per completion (or ``(B, T)`` per token; gspo uses its per-sequence mean).
        action_mask: ``(B, T)`` completion tokens.
        eps_low, eps_high: clip range ``[1 - eps_low, 1 + eps_high]`` (DAPO clip-higher: eps_high 0.28).
        loss_type: ``"grpo" | "dr_grpo" | "dapo" | "gspo"``.
        ref_logprobs: ``(B, T)`` reference log-probs; needed when ``beta > 0``.
        beta: KL coefficient; 0 means no reference model.
        kl_estimator: ``"k1" | "k2" | "k3"`` (see ``approx_kl``).
        max_completion_length: dr_grpo's normaliser; defaults to ``T``.
        normalizer: what the summed loss is divided by; default ``grpo_loss_units`` of this batch (the means
            above). A micro-batch of a larger batch passes the units of the whole batch (all micro-batches and
            ranks of one optimizer step), so the accumulated gradient is that of the whole batch's loss rather
            than a mean of micro-batch means, which would weigh tokens of short micro-batches more (dapo) or
            change the constant (dr_grpo).
        weights: ``(B, T)`` importance weights on the policy term (not the KL term), from
            ``rollout.importance_weights``: answers a serving engine sampled; gspo weighs each sequence's term
            by its tokens' mean weight.

    Sequences without answer tokens count nowhere: they carry no gradient and would only dilute the mean
    over sequences (grpo, gspo).
    """
    if beta != 0.0 and ref_logprobs is None:
        raise ValueError("beta > 0 needs ref_logprobs")
    if loss_type not in ("grpo", "dr_grpo", "dapo", "gspo"):
        raise ValueError(f"unknown loss_type {loss_type!r}; expected grpo, dr_grpo, dapo or gspo")
    keep = action_mask.bool()
    old_logprobs, advantages = old_logprobs.detach(), advantages.detach().float()
    log_ratio = logprobs - old_logprobs  # (B, T)

    if ref_logprobs is not None:
        kl = approx_kl(logprobs, ref_logprobs.detach(), kl_estimator)  # (B, T), with grad through logprobs
    else:
        kl = torch.zeros_like(logprobs)

    if loss_type == "gspo":
        adv = masked_mean(advantages, keep, dim=1) if advantages.dim() == 2 else advantages  # (B,)
        ratio = torch.exp(masked_mean(log_ratio, keep, dim=1))  # (B,) sequence ratio
        clipped_ratio = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
        seq_loss = -torch.minimum(ratio * adv, clipped_ratio * adv)
        if weights is not None:
            seq_loss = seq_loss * masked_mean(weights.detach(), keep, dim=1)
        if beta != 0.0:
            seq_loss = seq_loss + beta * masked_mean(kl, keep, dim=1)
        low = ((ratio < 1.0 - eps_low) & (adv < 0)).float().mean()
        high = ((ratio > 1.0 + eps_high) & (adv > 0)).float().mean()
        total = torch.where(keep.any(dim=1), seq_loss, torch.zeros_like(seq_loss)).sum()
        token_ratio = ratio.detach().unsqueeze(1).expand_as(logprobs)
    else:
        adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # (B, 1) or (B, T)
        ratio = torch.exp(log_ratio)  # (B, T)
        clipped_ratio = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
        per_token = -torch.minimum(ratio * adv, clipped_ratio * adv)
        if weights is not None:
            per_token = per_token * weights.detach()
        if beta != 0.0:
            per_token = per_token + beta * kl
        # Clip stats count only where clipping removes the gradient (Yu et al. 2025 track both sides).
        low = masked_mean(((ratio < 1.0 - eps_low) & (adv < 0)).float(), keep)
        high = masked_mean(((ratio > 1.0 + eps_high) & (adv > 0)).float(), keep)
        if loss_type == "grpo":
            total = masked_mean(per_token, keep, dim=1).sum()  # a sequence without tokens adds 0
        else:  # dr_grpo, dapo: token sums
            total = masked_sum(per_token, keep)
        token_ratio = ratio.detach()
    if normalizer is None:
        normalizer = float(grpo_loss_units(action_mask, loss_type, max_completion_length).clamp(min=1))
    loss = total / normalizer

    low, high = low.detach(), high.detach()
    return GRPOLossOutput(
        loss=loss,
        clip_ratio_low=low,
        clip_ratio_high=high,
        clip_ratio=low + high,
        kl=masked_mean(kl.detach(), keep),
        ratio=token_ratio,
    )


def grpo_loss_units(action_mask: torch.Tensor, loss_type: GRPOLossType,
                    max_completion_length: int | None = None) -> torch.Tensor:
    """What a GRPO-family loss averages over in this batch: answer tokens (dapo), sequences with at least one
    answer token (grpo, gspo), or sequences times the longest allowed completion (dr_grpo's constant).

    Summed over the micro-batches and ranks of one optimizer step it is the ``normalizer`` that makes their
    accumulated gradient equal to the gradient of the whole batch's loss (``grpo_policy_loss``).
    """
    keep = action_mask.bool()
    if loss_type == "dapo":
        return keep.sum()
    if loss_type == "dr_grpo":
        length = max_completion_length if max_completion_length is not None else action_mask.size(1)
        return torch.tensor(action_mask.size(0) * length)
    return keep.any(dim=1).sum()


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, eq. 13; rule ``overlong``, docs/algorithms.md).

    0 up to ``max_len - buffer`` tokens, then falls linearly to ``-factor`` at ``max_len`` and stays there:
    ``-min(len - (max_len - buffer), buffer) / buffer * factor``.

    Args:
        lengths: ``(N,)`` completion lengths in tokens.

    Returns:
        ``(N,)`` float penalties (<= 0), added to the rewards.
    """
    if not 0 < buffer <= max_len:
        raise ValueError(f"need 0 < buffer <= max_len, got buffer={buffer}, max_len={max_len}")
    excess = (lengths.float() - (max_len - buffer)).clamp(min=0.0, max=float(buffer))
    return -excess / buffer * factor


@torch.no_grad()
def dynamic_sampling_mask(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """DAPO dynamic sampling (Yu et al. 2025): keep only groups whose rewards are not all equal.

    A group with equal rewards has zero advantage everywhere, so it adds no gradient and only dilutes the
    token mean.

    Args:
        rewards: ``(N,)``, ``num_generations`` consecutive completions per prompt.

    Returns:
        ``(N,)`` bool, one entry per completion (the same for all of a group), so ``batch[mask]`` filters the
        flat batch directly; ``mask.view(-1, G)[:, 0]`` gives the per-group flags.
    """
    grouped = rewards.view(-1, num_generations)  # (P, G)
    varied = grouped.amax(dim=1) != grouped.amin(dim=1)  # (P,)
    return varied.repeat_interleave(num_generations)


# --------------------------------------------------------------------------------------------------
# Critic-free estimators (docs/algorithms.md, Critic-free estimators): RLOO, REINFORCE++, ReMax
# --------------------------------------------------------------------------------------------------


def rloo_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """RLOO advantages (Ahmadian et al. 2024, "Back to Basics", eq. 5; Kool et al. 2019): each completion's
    reward minus the mean reward of the other ``k - 1`` completions of its prompt,
    ``A_i = r_i - 1/(k-1) * sum_{j != i} r_j``, which equals ``k/(k-1) * (r_i - mean_group)``.

    The baseline leaves ``r_i`` out, so it does not depend on completion ``i`` and the estimator is unbiased
    (GRPO's group mean includes ``r_i``). No std scaling.

    Args:
        rewards: ``(N,)`` with ``N = P * k``, ``k`` consecutive completions per prompt.
        num_generations: ``k >= 2``.

    Returns:
        ``(N,)`` advantages, one per completion (broadcast over its tokens by the loss).
    """
    if num_generations < 2 or rewards.dim() != 1 or rewards.numel() % num_generations != 0:
        raise ValueError(f"rewards must be 1-D with a multiple of num_generations={num_generations} (>= 2) "
                         f"entries, got shape {tuple(rewards.shape)}")
    grouped = rewards.float().view(-1, num_generations)  # (P, k)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (num_generations - 1)  # (P, k) leave-one-out mean
    return (grouped - others).view(-1)


def remax_advantages(rewards: torch.Tensor, greedy_rewards: torch.Tensor) -> torch.Tensor:
    """ReMax advantages (Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method
    for Aligning Large Language Models", Algorithm 1): each sampled answer's reward minus the reward of the greedy
    answer to the same prompt, ``A_i = r(x, a_i) - r(x, a_greedy)``. The greedy answer does not depend on the
    sample, so the baseline keeps the estimator unbiased; no scaling.

    Args:
        rewards: ``(N,)`` sampled answers.
        greedy_rewards: ``(N,)`` the greedy answer's reward of each row's prompt (repeated per sample).

    Returns:
        ``(N,)`` advantages, one per completion.
    """
    if rewards.shape != greedy_rewards.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and greedy_rewards {tuple(greedy_rewards.shape)} must be "
                         "the same 1-D shape")
    return rewards.float() - greedy_rewards.float()


@torch.no_grad()
def discounted_returns(rewards: torch.Tensor, action_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Discounted return of every answer token, ``G_t = sum_{s >= t} gamma^(s - t) r_s`` over the kept tokens
    (REINFORCE++, Hu 2025, eq. 3-4; the same as ``gae`` with ``V = 0`` and ``lam = 1``).

    Args:
        rewards: ``(B, T)`` per-token rewards, e.g. ``kl_penalized_rewards``.
        action_mask: ``(B, T)``; masked positions add nothing and come back as 0.
        gamma: discount (REINFORCE++ uses 1).

    Returns:
        ``(B, T)`` returns.
    """
    keep = action_mask.bool()
    r = torch.where(keep, rewards.float(), 0.0)  # (B, T)
    out = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])  # (B,) G_{t+1}
    for t in reversed(range(r.size(1))):
        running = torch.where(keep[:, t], r[:, t] + gamma * running, running)  # padding passes the carry on
        out[:, t] = running
    return torch.where(keep, out, 0.0)


def masked_moments(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[count, sum, sum of squares]`` of ``x`` over the kept positions, in float64: the statistics that add
    up across micro-batches and ranks. Summed over shards (the caller all-reduces), they give the whole batch's
    mean and variance for ``whiten_from_moments``; float64 keeps ``E[x^2] - E[x]^2`` from cancelling.

    Args:
        x, mask: ``(B, T)``.

    Returns:
        ``(3,)`` float64.
    """
    keep = mask.bool()
    v = torch.where(keep, x.double(), 0.0)
    return torch.stack([keep.sum().double(), v.sum(), (v * v).sum()])


def whiten_from_moments(x: torch.Tensor, mask: torch.Tensor, moments: torch.Tensor,
                        eps: float = 1e-8) -> torch.Tensor:
    """``whiten`` with the mean and (unbiased) variance of a larger batch given by its summed
    ``masked_moments``: REINFORCE++ normalises advantages over the whole global batch (Hu 2025, sec. 3.3), not
    per micro-batch. With the moments of ``x`` itself it equals ``whiten(x, mask)``.

    Args:
        x, mask: ``(B, T)``.
        moments: ``(3,)`` ``[count, sum, sum of squares]`` of the whole batch.

    Returns:
        ``(B, T)``, 0 where masked.
    """
    n, s, ss = moments.double().unbind()
    mean = s / n.clamp(min=1)
    var = ((ss - n * mean * mean) / (n - 1).clamp(min=1)).clamp(min=0.0)  # Bessel, as ``whiten``
    out = ((x.double() - mean) * torch.rsqrt(var + eps)).to(torch.float32)
    return torch.where(mask.bool(), out, 0.0)


# --------------------------------------------------------------------------------------------------
# Other stages (docs/algorithms.md, DPO family and Distillation)
# --------------------------------------------------------------------------------------------------


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
    loss_type: DPOLossType = "sigmoid",
) -> DPOLossOutput:
    """DPO (Rafailov et al. 2023), conservative DPO and IPO (Azar et al. 2023) on answer log-probs.

    ``h = (pi_c - ref_c) - (pi_x - ref_x)``.
    ``sigmoid``: ``-logsigmoid(beta * h)`` (DPO, arXiv:2305.18290 eq. 7); with ``label_smoothing`` ``eps > 0`` it is
    ``cdpo``.
    ``cdpo``: ``-(1 - eps) * logsigmoid(beta * h) - eps * logsigmoid(-beta * h)`` (Mitchell 2023, "A note on DPO
    with noisy preferences": each label flipped with probability ``eps``).
    ``ipo``: ``(h - 1 / (2 * beta))^2`` (IPO, arXiv:2310.12036 eq. 17, where ``beta`` is their ``tau``); the paper
    uses length-averaged log-probs, so pass ``sum / answer length`` for all four (``dschat.rlhf.dpo`` does;
    docs/algorithms.md, DPO family).

    Args:
        policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps: ``(B,)``.
        beta: [0.1].
        label_smoothing: ``eps`` in [0, 0.5) for sigmoid/cdpo.

    Returns:
        loss (mean over pairs) and detached implicit rewards ``beta * (pi - ref)`` with accuracy and margin.
    """
    chosen_logratio = policy_chosen_logps.float() - ref_chosen_logps.float().detach()
    rejected_logratio = policy_rejected_logps.float() - ref_rejected_logps.float().detach()
    h = chosen_logratio - rejected_logratio  # (B,)
    if loss_type in ("sigmoid", "cdpo"):
        losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        if label_smoothing:
            raise ValueError("label_smoothing applies to the sigmoid/cdpo loss only")
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected 'sigmoid', 'cdpo' or 'ipo'")
    return implicit_rewards(losses.mean(), chosen_logratio, rejected_logratio, beta)


def implicit_rewards(loss: torch.Tensor, chosen_logratio: torch.Tensor, rejected_logratio: torch.Tensor,
                     beta: float) -> DPOLossOutput:
    """``loss`` with DPO's detached implicit rewards ``beta * (pi - ref)`` of the given log-ratios ``(B,)``, their
    accuracy (chosen above rejected, ties half) and mean margin."""
    chosen_rewards = (beta * chosen_logratio.float()).detach()
    rejected_rewards = (beta * rejected_logratio.float()).detach()
    metrics = pairwise_metrics(chosen_rewards, rejected_rewards)
    return DPOLossOutput(loss=loss, chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards,
                         reward_accuracy=metrics.accuracy, reward_margin=metrics.margin_mean)


def simpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    beta: float,
    gamma: float,
) -> DPOLossOutput:
    """SimPO (Meng, Xia and Chen 2024, arXiv:2405.14734 eq. 6): reference-free, on length-normalised log-probs,
    with a target reward margin ``gamma``: ``-logsigmoid(beta * (avg_c - avg_x) - gamma)``.

    Args:
        policy_chosen_logps, policy_rejected_logps: ``(B,)`` answer log-probs averaged over answer tokens.
        beta: [2.0 in the paper]; gamma: the margin [0.5 in the paper; dschat subtracts it as is].

    Returns:
        loss (mean over pairs) and detached implicit rewards ``beta * avg`` with accuracy and margin.
    """
    chosen_rewards = beta * policy_chosen_logps.float()
    rejected_rewards = beta * policy_rejected_logps.float()
    losses = -F.logsigmoid(chosen_rewards - rejected_rewards - gamma)  # (B,)
    metrics = pairwise_metrics(chosen_rewards.detach(), rejected_rewards.detach())
    return DPOLossOutput(
        loss=losses.mean(),
        chosen_rewards=chosen_rewards.detach(),
        rejected_rewards=rejected_rewards.detach(),
        reward_accuracy=metrics.accuracy,
        reward_margin=metrics.margin_mean,
    )


@torch.no_grad()
def best_worst_pairs(rewards: torch.Tensor, num_generations: int, valid: torch.Tensor | None = None) -> BestWorstPairs:
    """Online DPO's preference pairs: in each group of ``num_generations`` completions of one prompt, the
    best-rewarded completion is chosen and the worst-rewarded one rejected (best-vs-worst of n, as in iterative
    DPO: Xiong et al. 2024, arXiv:2312.11456; Dong et al. 2024, "RLHF Workflow", arXiv:2405.07863).

    A group whose valid completions all have the same reward carries no preference: it is skipped and counted in
    ``ties``. Invalid completions (``valid`` False: answers dropped as too short, whose action mask is all zero)
    never enter a pair; a group with fewer than two valid ones is skipped and counted in ``unpaired``. Among
    equal best (or equal worst) rewards the first completion is taken, so the pairing is deterministic.

    Args:
        rewards: ``(N,)``, ``num_generations`` consecutive completions per prompt.
        num_generations: ``G >= 2``.
        valid: ``(N,)`` bool, default all True.

    Returns:
        row indices into the flat batch, one pair per kept group in group order, and the skip counts.
    """
    if num_generations < 2 or rewards.dim() != 1 or rewards.numel() % num_generations != 0:
        raise ValueError(f"rewards must be 1-D with a multiple of num_generations={num_generations} (>= 2) "
                         f"entries, got shape {tuple(rewards.shape)}")
    grouped = rewards.float().view(-1, num_generations)  # (P, G)
    ok = torch.ones_like(grouped, dtype=torch.bool) if valid is None else valid.bool().view(-1, num_generations)
    best = torch.where(ok, grouped, -torch.inf).argmax(dim=1)  # (P,) first maximum among the valid
    worst = torch.where(ok, grouped, torch.inf).argmin(dim=1)  # (P,) first minimum among the valid
    enough = ok.sum(dim=1) >= 2  # (P,)
    rows = torch.arange(grouped.shape[0])
    differ = grouped[rows, best] > grouped[rows, worst]  # (P,) False for an all-equal group
    keep = enough & differ
    offset = rows * num_generations
    return BestWorstPairs(chosen=(offset + best)[keep], rejected=(offset + worst)[keep],
                          ties=(enough & ~differ).sum(), unpaired=(~enough).sum())


def per_token_nll(logps: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The negative log-likelihood per answer token over all the batch's tokens, ``-sum(logps) / sum(lengths)``:
    RPO's term (Pang et al. 2024, "Iterative Reasoning Preference Optimization", arXiv:2404.19733 eq. 3) added to
    DPO on the chosen answers. A token mean, as TRL's ``rpo_alpha`` takes it (a cross-entropy over the chosen
    tokens), so a long answer weighs by its tokens rather than as one row.

    Args:
        logps: ``(B,)`` summed answer log-probs (with grad).
        lengths: ``(B,)`` answer lengths in tokens (at least 1).
    """
    return -logps.float().sum() / lengths.float().sum()


def kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels_mask: torch.Tensor,
    temperature: float = 1.0,
) -> KDLossOutput:
    """Knowledge distillation (Hinton et al. 2015; docs/algorithms.md, Distillation):
    ``T^2 * KL(teacher_T || student_T)``.

    Softmax at temperature T on both sides; the ``T^2`` keeps gradient magnitudes comparable across T (Hinton
    et al. sec. 2). Averaged over answer tokens. Logits must already be aligned with the positions they
    predict (shift before calling), and both models must share the tokenizer.

    Args:
        student_logits: ``(B, T, V)`` (with grad).
        teacher_logits: ``(B, T, V)`` (no grad).
        labels_mask: ``(B, T)`` answer tokens.
        temperature: T > 0.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    student_logp = F.log_softmax(student_logits.float() / temperature, dim=-1)
    teacher_logp = F.log_softmax(teacher_logits.detach().float() / temperature, dim=-1)
    teacher_p = teacher_logp.exp()
    # where(): a vocab entry the teacher masks with -inf has p = 0 and must give 0, not 0 * inf = NaN.
    terms = torch.where(teacher_p > 0, teacher_p * (teacher_logp - student_logp), 0.0)
    kl = terms.sum(dim=-1)  # (B, T)
    loss = temperature**2 * masked_mean(kl, labels_mask)
    agree = (student_logits.detach().argmax(-1) == teacher_logits.argmax(-1)).float()
    return KDLossOutput(loss=loss, top1_agreement=masked_mean(agree, labels_mask))


def distill_sft_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    coef: float,
    temperature: float = 1.0,
) -> DistillSFTLossOutput:
    """Stage 1 with a teacher (docs/algorithms.md, Distillation):
    ``(1 - coef) * CE + coef * T^2 * KL(teacher_T || student_T)``, both token means over the answer tokens
    (``labels != -100``), the CE exactly as a causal LM's own loss.

    Both models must share the tokenizer; their logits may be padded to different widths (checkpoints round the
    embedding up, e.g. Qwen2.5 0.5B vs 7B), so the KL is taken over the common first ``V`` columns, which hold
    every real token.

    Args:
        student_logits: ``(B, T, V_s)`` at the input positions, unshifted (with grad).
        teacher_logits: ``(B, T, V_t)`` likewise (no grad).
        labels: ``(B, T)`` input ids with prompt and padding at -100; logits at ``t`` predict ``labels[t + 1]``.
        coef: weight of the distillation term in [0, 1].
        temperature: T > 0.
    """
    logits, teacher, target = student_logits[:, :-1], teacher_logits[:, :-1], labels[:, 1:]
    mask = target != -100
    ce = F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), ignore_index=-100, reduction="sum")
    ce = ce / mask.sum().clamp(min=1)
    width = min(logits.shape[-1], teacher.shape[-1])
    kd = kd_loss(logits[..., :width], teacher[..., :width], mask, temperature)
    loss = (1.0 - coef) * ce + coef * kd.loss
    return DistillSFTLossOutput(loss=loss, ce=ce.detach(), kd=kd.loss.detach(), top1_agreement=kd.top1_agreement)
