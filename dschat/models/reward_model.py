"""The reward/critic module (docs/models.md, Reward and critic models): an LM backbone plus
``v_head = Linear(hidden, 1, bias=False)``.

``hf_model`` is here too: it is the one place that looks inside a ``RewardModel`` (or a PEFT wrapper) for the
Hugging Face model to save. Built by ``dschat.models.loading.create_reward_model``; adapted by ``dschat.models.lora``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dschat.errors import UserError
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

    LoRA layers injected by ``dschat.models.lora`` live inside that model (``dschat.models.lora.merged_state_dict``
    maps their keys back); a ``peft.PeftModel`` wrapper is looked through (prefix ``base_model.model.``).
    """
    if isinstance(module, RewardModel):
        return module.model, "model."
    if callable(getattr(module, "get_base_model", None)) and hasattr(module, "peft_config"):  # peft.PeftModel
        return module.get_base_model(), "base_model.model."
    return module, ""


def is_reward_checkpoint(path: str, trust_remote_code: bool = False) -> bool:
    """Whether the model folder holds a trained scoring head (saved as ``*ForSequenceClassification``)."""
    from transformers import AutoConfig

    archs = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).architectures or []
    return any(a.endswith("ForSequenceClassification") for a in archs)


def check_reward_checkpoint(path: str, trust_remote_code: bool = False) -> None:
    """Stop with one line unless ``path`` holds a trained reward model: a ``*ForSequenceClassification`` with one
    label (a causal LM would be scored by a randomly initialised head)."""
    from transformers import AutoConfig

    if not is_reward_checkpoint(path, trust_remote_code):
        raise UserError(f"{path}: not a reward model (its config names no *ForSequenceClassification "
                        "architecture); a causal LM would be scored by a random head")
    num_labels = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).num_labels
    if num_labels != 1:
        raise UserError(f"{path}: a reward model has one output label, this one has {num_labels}")
