"""``dschat serve``'s flags: its own (``dschat.config.ServeArgs``) and the reward sources' declarations it shares
with stage 3 (``RewardArgs``), so a flag is declared once. Light to import (the sources' checks load the scoring
stack when they run), so ``dschat serve --help`` lists the flags without torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from dschat.config import DataArgs, ModelArgs, ServeArgs, piece
from dschat.rewards.names import JUDGE
from dschat.rlhf.config import RewardArgs


@dataclass
class ServeConfig:
    serve: ServeArgs = field(default_factory=ServeArgs)
    model: ModelArgs = piece(ModelArgs, only=("dtype", "trust_remote_code"))
    rewards: RewardArgs = piece(RewardArgs, only=("reward_model", "reward_funcs", "reward_weights", "judge_model",
                                                  "judge_max_new_tokens"), help={
        "reward_model": "Reward model to serve: a step-2 output (…/model); the source 'rm'.",
        "reward_funcs": "Served source (repeatable): rm (the reward model's end score), judge (--judge-model), "
                        "format, accuracy, judge_match, or path/to/file.py:function; the answer is their weighted "
                        "sum. Default: rm with --reward-model, judge with --judge-model.",
        "judge_model": "Generative judge (RM-R1) to serve, the source 'judge': each completion against the "
                       "request's reference answer ('answers'), in both orders."})
    data: DataArgs = piece(DataArgs, only=("judge_system_prompt",))

    def reward_func_names(self) -> list[str]:
        from dschat.serving.service import source_names  # imports torch: not needed to declare the flags

        r = self.rewards
        return source_names(r.reward_model, r.judge_model, list(r.reward_funcs))

    def inert_flags(self) -> dict[str, str]:
        r = self.rewards
        names = list(r.reward_funcs) or (["rm"] if r.reward_model else []) + ([JUDGE] if r.judge_model else [])
        out: dict[str, str] = {}
        if JUDGE not in names:
            out.update({n: "without the source 'judge'" for n in ("judge_model", "judge_max_new_tokens",
                                                                    "judge_system_prompt")})
        if "rm" not in names:
            out["reward_model"] = "without the source 'rm'"
        if len(names) < 2:
            out["reward_weights"] = "with one source (the answer is its score)"
        return out
