"""Stage-3 machinery shared by every algorithm (PPO, GRPO family): the models, rollouts and their scoring.

Layout of a rollout: prompts are left-padded to ``P`` columns, so every answer starts at column ``P``::

    sequences       (B, P + A)   prompt | answer (padding after the first EOS)
    attention_mask  (B, P + A)   prompt mask | action_mask
    action_mask     (B, A)       1 on answer tokens up to and including the first EOS

Log-probs and values are aligned with the answer tokens, ``(B, A)``: the log-prob of answer token ``t`` comes
from the logits at column ``P + t - 1``; the value of the state before token ``t`` likewise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dschat.data.collators import pad_sequences
from dschat.losses import end_indices, selective_log_softmax


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that start at 0 on each row's first real token, so left padding does not shift them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@dataclass
class Rollout:
    sequences: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    prompt_len: int
    reached_eos: torch.Tensor  # (B,) bool

    @property
    def answer_lengths(self) -> torch.Tensor:
        return self.action_mask.sum(-1)

    def select(self, idx: torch.Tensor) -> Rollout:
        return Rollout(self.sequences[idx], self.attention_mask[idx], self.action_mask[idx], self.prompt_len,
                       self.reached_eos[idx])


def make_rollout(prompt: torch.Tensor, prompt_mask: torch.Tensor, sequences: torch.Tensor, eos_token_id: int,
                 pad_token_id: int, min_answer_len: int = 2) -> tuple[Rollout, int]:
    """Mask everything after each answer's first EOS; answers shorter than ``min_answer_len`` get an all-zero
    action mask (dropped from every loss and count) rather than removed, so batch shapes stay equal on all
    ranks. Returns the rollout and the number of answers dropped."""
    P = prompt.shape[1]
    answer = sequences[:, P:]
    is_eos = answer == eos_token_id
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0  # strictly after the first EOS
    action_mask = (~after_eos).long()
    reached_eos = is_eos.any(-1)
    short = action_mask.sum(-1) < min_answer_len
    action_mask[short] = 0
    answer = answer.masked_fill(after_eos, pad_token_id)
    seq = torch.cat([prompt, answer], dim=1)
    mask = torch.cat([prompt_mask.long(), action_mask], dim=1)
    return Rollout(seq, mask, action_mask, P, reached_eos), int(short.sum())


def answer_logprobs(model: Any, rollout: Rollout, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs ``(B, A)`` of the answer tokens under ``model`` (an engine or a module)."""
    logits = model(input_ids=rollout.sequences, attention_mask=rollout.attention_mask,
                   position_ids=positions_from_mask(rollout.attention_mask), use_cache=False).logits
    logits = logits[:, rollout.prompt_len - 1: -1].float()
    if temperature != 1.0:  # the sampling distribution was the tempered one
        logits = logits / temperature
    return selective_log_softmax(logits, rollout.sequences[:, rollout.prompt_len:])


def answer_values(critic: Any, rollout: Rollout) -> torch.Tensor:
    """Critic values ``(B, A)`` of the state before each answer token."""
    values = critic(rollout.sequences, rollout.attention_mask, positions_from_mask(rollout.attention_mask))
    return values[:, rollout.prompt_len - 1: -1]


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
    """Decode with the actor's tokenizer and re-encode for a reward model whose tokenizer differs (SPEC 5)."""

    def __init__(self, actor_tokenizer: Any, reward_tokenizer: Any, max_len: int):
        self.src, self.dst, self.max_len = actor_tokenizer, reward_tokenizer, max_len

    def __call__(self, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        P = rollout.prompt_len
        rows = []
        for seq, mask, ended in zip(rollout.sequences, rollout.attention_mask, rollout.reached_eos, strict=True):
            prompt = self.src.decode(seq[:P][mask[:P].bool()], skip_special_tokens=True)
            answer = self.src.decode(seq[P:][mask[P:].bool()], skip_special_tokens=True)
            ids = self.dst(prompt)["input_ids"] + self.dst(answer, add_special_tokens=False)["input_ids"]
            # As on the same-tokenizer path: only an answer that ended gets the EOS the reward model scores at.
            if self.dst.eos_token_id is not None and bool(ended):
                ids = ids + [self.dst.eos_token_id]
            rows.append(ids[-self.max_len:])
        ids, mask = pad_sequences(rows, self.dst.pad_token_id, "right")
        return ids.to(rollout.sequences.device), mask.to(rollout.sequences.device)


def same_tokenizer(a: Any, b: Any) -> bool:
    if a is b:
        return True
    return a.get_vocab() == b.get_vocab() and a.eos_token_id == b.eos_token_id
