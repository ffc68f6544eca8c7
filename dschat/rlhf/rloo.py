"""RLOO (``--algo rloo``; Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for
Learning from Human Feedback in LLMs"; Kool et al. 2019): k completions per prompt, each one's baseline the mean
reward of the other k - 1 (``L.rloo_advantages``), no critic, no std scaling.

GRPO's generation, grouping and policy loss (``GRPO``), with the leave-one-out advantage in place of the
group-normalised one, so every GRPO flag but ``--scale-rewards`` applies: ``--num-generations`` is k, the
KL to the reference is ``--beta`` in the loss (TRL's RLOO; OpenRLHF folds it into the reward instead), ``--loss-type``
the aggregation. Peers: OpenRLHF ``--advantage_estimator rloo``, veRL ``compute_rloo_outcome_advantage``.
"""

from __future__ import annotations

import torch

from dschat import losses as L
from dschat.rlhf.grpo import GRPO, grpo_flags
from dschat.rlhf.rollout import Rollout


class RLOO(GRPO):
    name = "rloo"
    help = "RLOO: k completions per prompt, leave-one-out baseline, no critic (Ahmadian et al. 2024)"
    uses = grpo_flags("scale_rewards")
    output_name = "step3_rloo"

    def advantages(self, rewards: torch.Tensor, rollout: Rollout, old: torch.Tensor | None,
                   ref: torch.Tensor | None, baselines: torch.Tensor | None) -> torch.Tensor:
        return L.rloo_advantages(rewards, self.g.num_generations)

    def describe(self) -> str:
        g = self.g
        return (f"RLOO k {g.num_generations}, loss {self.loss_type}, mu {g.num_iterations}, beta {g.beta}, rewards "
                + self.scorer.describe() + (", dynamic sampling" if self.dynamic else ""))
