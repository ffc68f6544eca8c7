"""REINFORCE++ (``--algo reinforce_pp``; Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning
Large Language Models") and its group-baseline variant (``--algo reinforce_pp_baseline``).

Per answer token the reward is PPO's (``L.kl_penalized_rewards``): ``-kl_ctl * (logp_old - ref)``
plus the clipped score at the last answer token; the advantage is the discounted return
(``L.discounted_returns``, ``--gamma``) whitened over the whole global batch, every micro-batch on every rank
(``L.masked_moments`` summed by ``E.all_reduce_sum``, then ``L.whiten_from_moments``): no critic, no per-prompt
normalisation. The loss is GRPO's clipped surrogate (``--epsilon``, ``--epsilon-high``) averaged over the
tokens of each optimizer step, with the KL in the reward rather than the loss.

``reinforce_pp_baseline`` first subtracts the group mean from each score (``--num-generations`` completions per
prompt), then does the same; OpenRLHF recommends it for reasoning tasks, where rule rewards differ in scale
across prompts. Peers: OpenRLHF ``--advantage_estimator reinforce|reinforce_baseline``, veRL
``compute_reinforce_plus_plus_outcome_advantage`` (both whiten on a driver that holds the whole batch; here each
rank holds its share, hence the all-reduced moments). dschat follows veRL where the two differ:

- the whitening's variance divides by n - 1 (veRL's ``masked_whiten``); OpenRLHF divides by n, so its advantages
  are larger by ``sqrt(n / (n - 1))``, a factor that vanishes with the batch size;
- the per-token KL is the plain k1 estimate, unclamped; OpenRLHF clamps its KL estimate to [-10, 10];
- ``--gamma`` applies to both variants; OpenRLHF forces gamma = 1 for ``reinforce_baseline``.

The two live in one file: they differ in one line (the score's baseline), as GRPO's loss types share grpo.py.
Flags: GRPO's generation and clip flags, PPO's ``--kl-ctl``, ``--gamma`` and ``--clip-reward-value``.
"""

from __future__ import annotations

from typing import Any

import torch

from dschat import engine as E
from dschat import losses as L
from dschat.rlhf.grpo import GRPO
from dschat.rlhf.rollout import Rollout
from dschat.rlhf.specs import ReinforcePPBaselineSpec, ReinforcePPSpec


class ReinforcePP(GRPO, ReinforcePPSpec):
    group_baseline = False  # reinforce_pp_baseline: score minus its group's mean first

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.p = self.cfg.ppo
        self.loss_type, self.beta = "dapo", 0.0  # token mean over each optimizer step; KL is in the reward
        self.dynamic = False

    def needs_old(self, n_micro: int, grad_accum: int, micro_offset: int) -> bool:
        # The per-token KL reward reads the generating policy's log-probs.
        return self.p.kl_ctl != 0.0 or super().needs_old(n_micro, grad_accum, micro_offset)

    def advantages(self, rewards: torch.Tensor, rollout: Rollout, old: torch.Tensor | None,
                   ref: torch.Tensor | None, baselines: torch.Tensor | None) -> torch.Tensor:
        mask = rollout.action_mask  # (N, A)
        scores = L.group_advantages(rewards, self.g.num_generations, "none") if self.group_baseline else rewards
        if ref is None or old is None:  # --kl-ctl 0: no reference model, no KL term
            old = ref = torch.zeros(mask.shape, device=mask.device)
        token_rewards = L.kl_penalized_rewards(old, ref, scores, mask, self.p.kl_ctl, self.p.clip_reward_value)
        returns = L.discounted_returns(token_rewards, mask, self.p.gamma)  # (N, A)
        moments = E.all_reduce_sum(L.masked_moments(returns, mask))  # the whole step's batch, every rank
        return L.whiten_from_moments(returns, mask, moments)

    def describe(self) -> str:
        g, p = self.g, self.p
        return (f"{self.name} G {g.num_generations}, mu {g.num_iterations}, kl_ctl {p.kl_ctl}, gamma {p.gamma}, "
                f"rewards " + self.scorer.describe())

    def summary(self, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
        return {}  # no --loss-type: its aggregation is fixed


class ReinforcePPBaseline(ReinforcePP, ReinforcePPBaselineSpec):
    group_baseline = True
