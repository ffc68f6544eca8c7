"""Run-time defaults shared by the algorithms that learn from the policy's own samples (PPO, the GRPO family, online
DPO): prompts batched by ``DataCollatorRLHF``, evaluation by sampling held-out prompts and scoring the answers,
nothing kept between steps and no eval.json fields of their own unless they override. Their config-time defaults
are ``specs.OnPolicySpec``'s."""

from __future__ import annotations

from typing import Any

from dschat.data.collators import DataCollatorRLHF
from dschat.rlhf.evaluation import evaluate


class OnPolicy:
    collator = DataCollatorRLHF
    cfg: Any
    models: Any
    hybrid: Any
    gen: Any
    scorer: Any

    def evaluate(self, loader: Any) -> dict[str, Any]:
        return evaluate(self.models, self.hybrid, loader, self.gen, self.cfg.rl.temperature, self.cfg.run.seed,
                        self.scorer, num_samples=self.cfg.rl.eval_samples, progress=self.cfg.run.progress)

    def summary(self, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
        return {}

    def state(self) -> dict[str, Any]:
        return {}
