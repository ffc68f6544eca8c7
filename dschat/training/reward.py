"""Stage 2's training loss: the per-token values of a ``DataCollatorReward`` batch (B chosen rows, then B
rejected rows) and the pairwise loss over them (docs/algorithms.md, Reward-model loss). Stage 2 trains with it and
``dschat.evaluation.reward_model`` scores with the same two functions."""

from __future__ import annotations

from typing import Any

import torch

from dschat.data.packing import common_prefix, packed_inputs, shared_prefix_inputs, unpack
from dschat.losses import PairwiseLossOutput, last_token_pairwise_loss, pairwise_loss
from dschat.models.reward_model import RewardModel


def reward_loss(values: torch.Tensor, batch: dict[str, torch.Tensor], rm_loss: str = "pairwise",
                center_coef: float = 0.0) -> PairwiseLossOutput:
    """The stage-2 loss of one ``DataCollatorReward`` batch from the per-token values ``(2B, T)``: 'pairwise'
    (divergence-truncated) or 'last-token' (end scores, minus each row's optional 'margin')."""
    chosen, rejected = split_pairs(batch)
    b = chosen["input_ids"].size(0)
    if rm_loss == "last-token":
        scores = RewardModel.end_scores(values, batch["attention_mask"])  # (2B,)
        return last_token_pairwise_loss(scores[:b], scores[b:], batch.get("margin"), center_coef)
    return pairwise_loss(values[:b], values[b:], chosen["input_ids"], rejected["input_ids"],
                         chosen["attention_mask"], rejected["attention_mask"])


def reward_values(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """Per-token values ``(2B, T)`` of a ``DataCollatorReward`` batch, laid out as the right-padded view the losses
    read. The model runs on the packed sequences of a ``--packing`` batch; otherwise on one sequence per pair that
    holds the tokens both rows begin with (the prompt, at least) once (``shared_prefix_layout``: the same values,
    fewer tokens), or on the rows one by one where that layout does not apply (flash attention)."""
    if "packed_index" in batch:
        return unpack(model(**packed_inputs(model, batch, "packed_")), batch["packed_index"])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    shared = shared_prefix_inputs(model, ids, mask, common_prefix(ids, mask))
    if shared is None:
        return model(input_ids=ids, attention_mask=mask)
    inputs, index = shared
    return unpack(model(**inputs), index)


def split_pairs(batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A ``DataCollatorReward`` batch ``(2B, T)`` -> its chosen half and its rejected half, each ``(B, T)``."""
    b = batch["input_ids"].size(0) // 2
    keys = ("input_ids", "attention_mask")
    return {k: batch[k][:b] for k in keys}, {k: batch[k][b:] for k in keys}
