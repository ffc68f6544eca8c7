"""What a rollout earns: the reward model's end score (re-tokenized for it when its tokenizer differs) and the
rule, judge and user reward functions, mixed by weight (docs/algorithms.md, PPO and Rule rewards)."""

from __future__ import annotations

from typing import Any

import torch

from dschat.data.collators import pad_sequences
from dschat.data.usertext import reencode_for_reward
from dschat.losses import end_indices
from dschat.models.loading import same_tokenizer
from dschat.rewards.functions import RM, MixedRewards, RewardMixer, get_reward_func, parse_weights
from dschat.rewards.judge import JUDGE, load_judge_reward
from dschat.rlhf.rollout import Rollout, completion_texts, positions_from_mask

__all__ = ["JUDGE", "RM", "Retokenizer", "Scorer", "build_scorer", "reward_scores", "row_fields", "same_tokenizer"]

@torch.no_grad()
def reward_scores(reward_model: Any, rollout: Rollout, retokenize: Any | None = None) -> torch.Tensor:
    """End scores ``(B,)`` of prompt + answer under the reward model (its own tokenizer via ``retokenize``)."""
    if retokenize is not None:
        ids, mask = retokenize(rollout)
    else:
        ids, mask = rollout.sequences, rollout.attention_mask
    values = reward_model(ids, mask, positions_from_mask(mask))
    return values.gather(1, end_indices(mask).unsqueeze(1)).squeeze(1)


class Retokenizer:
    """Decode with the actor's tokenizer and re-encode for a reward model whose tokenizer differs.

    Too long for the reward model: the prompt loses its start after BOS, never the BOS or the scored end
    (``dschat.data.usertext.reencode_for_reward``); ``truncated`` counts such rows.
    """

    def __init__(self, actor_tokenizer: Any, reward_tokenizer: Any, max_len: int):
        self.src, self.dst, self.max_len = actor_tokenizer, reward_tokenizer, max_len
        self.truncated = 0

    def __call__(self, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        P = rollout.prompt_len
        rows = []
        for seq, mask, ended in zip(rollout.sequences, rollout.attention_mask, rollout.reached_eos, strict=True):
            prompt = self.src.decode(seq[:P][mask[:P].bool()], skip_special_tokens=True)
            answer = self.src.decode(seq[P:][mask[P:].bool()], skip_special_tokens=True)
            # As on the same-tokenizer path: only an answer that ended gets the EOS the reward model scores at.
            ids, cut = reencode_for_reward(prompt, answer, bool(ended), self.dst, self.max_len)
            self.truncated += cut
            rows.append(ids)
        ids, mask = pad_sequences(rows, self.dst.pad_token_id, "right")
        return ids.to(rollout.sequences.device), mask.to(rollout.sequences.device)


def row_fields(batch: dict[str, Any]) -> dict[str, list[Any]]:
    """The reward functions' ``row_fields`` (dschat.rewards.functions): ``answer`` plus every other field of the
    rows."""
    extras: list[dict[str, Any]] = batch.get("extra") or [{} for _ in batch["answer"]]
    reserved = {"answer", "prompts", "completions", "completion_lengths", "external"}
    names = sorted({k for e in extras for k in e} - reserved)
    fields = {k: [e.get(k) for e in extras] for k in names}
    fields["answer"] = list(batch["answer"])
    return fields


class Scorer:
    """What a rollout earns under the run's reward sources: the mixer over rule functions and, for ``rm``, the
    reward model's end score (re-tokenized for it when its tokenizer differs)."""

    def __init__(self, mixer: RewardMixer, tokenizer: Any, reward_model: Any | None, retok: Retokenizer | None):
        self.mixer, self.tokenizer, self.reward_model, self.retok = mixer, tokenizer, reward_model, retok
        self.needs_text = any(n != RM for n in mixer.names)

    def stats(self) -> dict[str, float]:
        """Counters to log: rows cut to fit the reward model after re-tokenization, so far."""
        return {"train/reward_truncated": self.retok.truncated} if self.retok is not None else {}

    def describe(self) -> str:
        return " + ".join(f"{w:g}*{n}" for n, w in zip(self.mixer.names, self.mixer.weights, strict=True))

    @torch.no_grad()
    def __call__(self, rollout: Rollout, batch: dict[str, Any]) -> MixedRewards:
        external: dict[str, torch.Tensor] = {}
        if RM in self.mixer.names:
            external[RM] = reward_scores(self.reward_model, rollout, self.retok).float().cpu()
        if not self.needs_text:  # rm only (PPO): no decoding
            n = rollout.sequences.shape[0]
            return self.mixer([""] * n, [""] * n, external=external)
        prompts, completions, lengths = completion_texts(self.tokenizer, rollout, batch["prompt_att_mask"])
        return self.mixer(prompts, completions, external=external, completion_lengths=lengths, **row_fields(batch))


def reward_weights(r: Any, names: list[str]) -> list[float]:
    """--reward-weights (``r`` the ``RewardArgs``), with weight 1 for an 'overlong' that --overlong-penalty added
    after them."""
    weights = parse_weights(r.reward_weights)
    if weights and len(weights) == len(names) - 1 and names[-1] == "overlong" and "overlong" not in r.reward_funcs:
        weights.append(1.0)
    return weights


def build_scorer(cfg: Any, models: Any | None) -> Scorer:
    """The run's ``Scorer`` (``cfg`` an ``RLHFConfig``; ``models`` the engine set, None when no source needs the
    reward model). A judge is a model, not a rule: it loads here, on this rank's device, with the run's rubric."""
    r = cfg.rewards
    names = cfg.reward_func_names()
    weights = reward_weights(r, names)
    funcs = {n: get_reward_func(n, cfg.rl.max_answer_seq_len, r.overlong_buffer, r.overlong_factor) for n in names
             if n != JUDGE}
    if JUDGE in names:
        funcs[JUDGE] = load_judge_reward(r.judge_model, r.judge_max_new_tokens, cfg.data.judge_system_prompt,
                                         cfg.model.dtype, cfg.model.trust_remote_code)
    tokenizer = getattr(models, "tokenizer", None)
    reward_model = getattr(models, "reward", None)
    rm_tok = getattr(models, "reward_tokenizer", None)
    retok = None if rm_tok is None or same_tokenizer(tokenizer, rm_tok) else \
        Retokenizer(tokenizer, rm_tok, cfg.data.max_prompt_seq_len + cfg.rl.max_answer_seq_len)
    return Scorer(RewardMixer(names, weights, funcs), tokenizer, reward_model, retok)
