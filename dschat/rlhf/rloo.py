"""RLOO (``--algo rloo``; Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for
Learning from Human Feedback in LLMs"; Kool et al. 2019): k completions per prompt, each one's baseline the mean
reward of the other k - 1 (``L.rloo_advantages``), no critic, no std scaling.

GRPO's generation, grouping and policy loss (``GRPO``), with the leave-one-out advantage in place of the
group-normalised one, so every GRPO flag but ``--scale-rewards`` applies: ``--num-generations`` is k,
``--loss-type`` the aggregation, ``--beta`` the KL coefficient to the reference. Where the KL goes:

- by default in the loss, ``beta * k3`` per token as GRPO places it (veRL's ``use_kl_loss``);
- with ``--kl-in-reward``, as TRL's ``RLOOTrainer`` and OpenRLHF's ``--advantage_estimator rloo`` place it: each
  completion's reward becomes ``score - beta * sum_t (logp_old - ref)`` (the k1 estimate summed over its answer
  tokens) before the leave-one-out baseline, and the loss has no KL term.

Peers: OpenRLHF ``--advantage_estimator rloo``, veRL ``compute_rloo_outcome_advantage``, TRL ``RLOOTrainer``.
"""

from __future__ import annotations

from typing import Any

import torch

from dschat import losses as L
from dschat.rlhf.grpo import GRPO
from dschat.rlhf.rollout import Rollout
from dschat.rlhf.specs import RLOOSpec


def kl_folded_rewards(rewards: torch.Tensor, old: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor,
                      beta: float) -> torch.Tensor:
    """``rewards - beta * sum_t mask * (old - ref)``: each completion's reward less its KL to the reference (k1,
    summed over its answer tokens), ``(N,)`` from ``(N,)`` rewards and ``(N, A)`` log-probs and mask."""
    return rewards.float() - beta * ((old.float() - ref.float()) * mask).sum(-1).to(rewards.device)


class RLOO(GRPO, RLOOSpec):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.kl_in_reward = self.cfg.rloo.kl_in_reward
        self.kl_coef = self.g.beta
        if self.kl_in_reward:
            self.beta = 0.0  # the KL is in the reward: no loss-side term

    def needs_old(self, n_micro: int, grad_accum: int, micro_offset: int) -> bool:
        # The reward's KL reads the generating policy's log-probs.
        return (self.kl_in_reward and self.kl_coef != 0.0) or super().needs_old(n_micro, grad_accum, micro_offset)

    def advantages(self, rewards: torch.Tensor, rollout: Rollout, old: torch.Tensor | None,
                   ref: torch.Tensor | None, baselines: torch.Tensor | None) -> torch.Tensor:
        if self.kl_in_reward and old is not None and ref is not None:
            rewards = kl_folded_rewards(rewards, old, ref, rollout.action_mask, self.kl_coef)
        return L.rloo_advantages(rewards, self.g.num_generations)

    def describe(self) -> str:
        g = self.g
        kl = f"kl_coef {g.beta} in the reward" if self.kl_in_reward else f"beta {g.beta}"
        return (f"RLOO k {g.num_generations}, loss {self.loss_type}, mu {g.num_iterations}, {kl}, rewards "
                + self.scorer.describe() + (", dynamic sampling" if self.dynamic else ""))
