"""The width of one attention head, read the one way every part of dschat reads it (the decoder, the vLLM
engine's support check and KV sizing, the planner). Torch-free."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def head_dim(config: Any) -> int | None:
    """``head_dim`` where the config sets it (Gemma's heads are wider than hidden / heads), else hidden size over
    the head count; None when the config names neither. ``config`` is a transformers config (GPT-2's attribute map
    answers ``num_attention_heads`` and ``hidden_size`` too) or the dict of a ``config.json``."""
    def field(*names: str) -> Any:
        for name in names:
            value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
            if value:
                return value
        return None

    width = field("head_dim")
    if width:
        return int(width)
    heads, hidden = field("num_attention_heads", "n_head"), field("hidden_size", "n_embd")
    return int(hidden) // int(heads) if heads and hidden else None
