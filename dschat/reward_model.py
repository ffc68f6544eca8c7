"""The reward/critic module (SPEC 3): an LM backbone plus ``v_head = Linear(hidden, 1, bias=False)``.

``hf_model`` is here too: it is the one place that looks inside a ``RewardModel`` (or a PEFT wrapper) for the
Hugging Face model to save. Built by ``dschat.models.create_reward_model``; adapted by ``dschat.lora``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dschat.losses import end_indices


class RewardModel(nn.Module):
    """LM backbone + ``v_head = Linear(hidden, 1, bias=False)``: per-token values and end scores.

    It wraps the family's ``*ForSequenceClassification`` (whose ``score`` layer is the v_head), so the saved
    folder loads with ``AutoModelForSequenceClassification`` and scores the same sequences the same way.
    """

    def __init__(self, seq_cls: nn.Module):
        super().__init__()
        self.model = seq_cls
        self.config = seq_cls.config

    @property
    def v_head(self) -> nn.Linear:
        return self.model.score

    @property
    def backbone(self) -> nn.Module:
        return getattr(self.model, self.model.base_model_prefix)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Per-token values ``(B, T)``. Pass ``position_ids`` for left-padded rows (see ``positions_from_mask``)."""
        kwargs = {"position_ids": position_ids} if position_ids is not None else {}
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)[0]
        return self.v_head(hidden).squeeze(-1).float()

    @staticmethod
    def end_scores(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The end score: the value at each row's last real token, found from the mask, which is the EOS that
        ends every input (stages append it). HF's pooling lands on the same token because dschat's pad is never
        EOS (``ensure_distinct_pad``). ``(B, T) -> (B,)``."""
        idx = end_indices(attention_mask)
        return values.gather(1, idx.unsqueeze(1)).squeeze(1)


def hf_model(module: nn.Module) -> tuple[Any, str]:
    """The HF ``PreTrainedModel`` to ``save_pretrained`` and the state-dict prefix to strip to reach it.

    LoRA layers injected by ``dschat.lora`` live inside that model (``dschat.lora.merged_state_dict`` maps their
    keys back); a ``peft.PeftModel`` wrapper is looked through (prefix ``base_model.model.``).
    """
    if isinstance(module, RewardModel):
        return module.model, "model."
    if callable(getattr(module, "get_base_model", None)) and hasattr(module, "peft_config"):  # peft.PeftModel
        return module.get_base_model(), "base_model.model."
    return module, ""
