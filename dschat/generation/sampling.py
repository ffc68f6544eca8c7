"""Sampling one token from logits: the settings (``GenerationConfig``), the warpers in HF's order (temperature,
top-k, top-p), the draw (``sample``), the repetition penalty and the sampled token's log-prob. Pure functions of
tensors, shared by every decoder of ``dschat.generation``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class GenerationConfig:
    """How to sample, and nothing else: what a call feeds back (a streaming hook) or drives (episodes) is given
    to the entry beside it (``dschat.generation.backends.generate``)."""

    max_new_tokens: int = 256
    do_sample: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # Also return each sampled token's log-prob (the behaviour policy's: PPO's old log-probs). Off unless a caller
    # uses them: computing them costs a log-softmax over the vocabulary per token.
    logprobs: bool = False
    # Divide the logits of tokens already in the prompt or the answer by this (multiply, where negative), as HF's
    # repetition penalty does; 1 is off.
    repetition_penalty: float = 1.0

    @classmethod
    def from_flags(cls, flags: SamplingFlags) -> GenerationConfig:
        """Sampling as stage 3's flags set it (``--max-answer-seq-len``, ``--temperature``, ``--top-p``,
        ``--top-k``): stage 3, ``dschat generate`` and ``dschat eval --step 3`` all sample through this."""
        return cls(max_new_tokens=flags.max_answer_seq_len, do_sample=True, temperature=flags.temperature,
                   top_p=flags.top_p, top_k=flags.top_k)


class SamplingFlags(Protocol):
    """The sampling flags of stage 3's ``RLArgs`` (and of every command that declares the same ones)."""

    max_answer_seq_len: int
    temperature: float
    top_p: float
    top_k: int



def warp_logits(logits: torch.Tensor, config: GenerationConfig) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) filtering, as HF's sampling warpers apply them."""
    logits = logits / config.temperature if config.temperature != 1.0 else logits
    if config.top_k and config.top_k < logits.shape[-1]:
        kth = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1)  # ascending
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum <= 1 - config.top_p
        drop[..., -1:] = False  # always keep the most likely token
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def sample(probs: torch.Tensor) -> torch.Tensor:
    """One draw per row of ``probs`` (B, V) by inverting its running sum: one uniform per row and a binary search,
    where ``torch.multinomial`` draws an exponential variate per vocabulary entry, so this is much faster. The
    running sum is float64, so a token's share of [0, total) is its probability to ~1e-15 however large the
    vocabulary; the draw lands in the first column whose running sum exceeds it, which never is a zero-probability
    (filtered) token."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    u = torch.rand(total.shape, dtype=torch.float64, device=probs.device) * total
    u = torch.minimum(u, total.nextafter(torch.zeros_like(total)))  # strictly below the total, even rounded up
    return torch.searchsorted(cdf, u, right=True).squeeze(1)


def penalize_repeats(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF's repetition penalty: the logits ``(B, V)`` of the ``seen`` tokens divided by ``penalty`` where positive,
    multiplied where negative (both make a seen token less likely for a penalty above 1)."""
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def next_token(logits: torch.Tensor, config: GenerationConfig) -> torch.Tensor:
    """(B, V) float32 logits -> (B,) next tokens: argmax, or a sample of the warped distribution."""
    if not config.do_sample:
        return logits.argmax(-1)
    return sample(warp_logits(logits, config).softmax(-1))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(token) under softmax(logits / temperature) over the whole vocabulary (no top-k/top-p), float32."""
    logits = logits / temperature if temperature != 1.0 else logits
    return logits.gather(-1, tokens[:, None]).squeeze(-1) - logits.logsumexp(-1)

