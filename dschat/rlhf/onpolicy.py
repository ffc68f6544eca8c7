"""Defaults shared by the algorithms that learn from the policy's own samples (PPO, the GRPO family): prompts
in (the phase-3 rows), evaluation by sampling held-out prompts and scoring the answers, nothing kept between
steps and no eval.json fields of their own unless they override."""

from __future__ import annotations

from typing import Any

from dschat.data.collators import DataCollatorRLHF
from dschat.evaluation.policy import evaluate


class OnPolicy:
    tokenize_as = 3  # prompts
    collator = DataCollatorRLHF
    cfg: Any
    models: Any
    hybrid: Any
    gen: Any
    scorer: Any

    @staticmethod
    def batch_size(cfg: Any) -> int:
        """Dataset rows (prompts) per update: a generation batch."""
        return int(cfg.rl.per_device_generation_batch_size)

    @staticmethod
    def inert_flags(cfg: Any) -> dict[str, str]:
        # Training rows are the policy's own samples, batched by the algorithm: the data flags that shape training
        # batches of dataset rows have nothing to act on.
        why = f"with --algo {cfg.rl.algo} (it trains on its own samples, not on dataset rows)"
        return {"packing": why, "group_by_length": why}

    def evaluate(self, loader: Any) -> dict[str, Any]:
        return evaluate(self.models, self.hybrid, loader, self.gen, self.cfg.rl.temperature, self.cfg.run.seed,
                        self.scorer, num_samples=self.cfg.rl.eval_samples, progress=self.cfg.run.progress)

    def summary(self, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
        return {}

    def state(self) -> dict[str, Any]:
        return {}
