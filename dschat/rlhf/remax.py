"""ReMax (``--algo remax``; Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning
Method for Aligning Large Language Models"): REINFORCE whose baseline is the reward of the greedy answer to the
same prompt (``L.remax_advantages``), so no critic and no group statistics.

One extra generation per prompt and step: the greedy answer (``prompt_baselines``), scored by the same reward
sources. The rest is GRPO's machinery: ``--num-generations`` sampled answers per prompt, each against the shared
greedy baseline (the paper samples one; veRL's ``compute_remax_outcome_advantage`` allows n), the clipped loss
with ``--loss-type`` aggregation and ``--beta`` KL to the reference. Every sampled group has a gradient even when
its rewards are equal, so dynamic sampling and ``--scale-rewards`` do not apply. The default aggregation is
dr_grpo (sum over tokens, constant normaliser): with a baseline that is not the group mean a per-sequence mean
biases the update by answer length (see ``specs.ReMaxSpec.default_loss_type``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from dschat import losses as L
from dschat.rlhf.grpo import GRPO
from dschat.rlhf.rollout import Rollout, generate_rollout
from dschat.rlhf.scoring import Scorer
from dschat.rlhf.specs import ReMaxSpec


class ReMax(GRPO, ReMaxSpec):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.dynamic = False  # every group has a gradient against the greedy baseline, also --loss-type dapo's

    def prompt_baselines(self, batch: dict[str, Any], scorer: Scorer) -> torch.Tensor | None:
        """``(P,)``: the reward of each prompt's greedy answer (generated with the actor, no sampling)."""
        greedy, _ = generate_rollout(self.hybrid, self.models.tokenizer, batch, replace(self.gen, do_sample=False),
                                     min_answer_len=0)
        self.hybrid.release()  # its generate phase ends before scoring and the sampled answers' own
        return scorer(greedy, batch).total

    def advantages(self, rewards: torch.Tensor, rollout: Rollout, old: torch.Tensor | None,
                   ref: torch.Tensor | None, baselines: torch.Tensor | None) -> torch.Tensor:
        assert baselines is not None  # prompt_baselines always measures one
        return L.remax_advantages(rewards, baselines)

    def describe(self) -> str:
        g = self.g
        return (f"ReMax G {g.num_generations} + 1 greedy, loss {self.loss_type}, mu {g.num_iterations}, beta {g.beta}, "
                "rewards " + self.scorer.describe())
