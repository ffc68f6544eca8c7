"""Saving models as plain Hugging Face folders, atomically, whatever the ZeRO stage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dschat import engine as E
from dschat.models import hf_model
from dschat.utils import atomic_dir


def save_hf(model: Any, tokenizer: Any, out_dir: str | Path, config_updates: dict[str, Any] | None = None,
            state_dict: dict[str, Any] | None = None) -> None:
    """Write ``model`` (engine or module) as a HF folder: config.json, safetensors, tokenizer files.

    Call on every rank (ZeRO-3 gathers shards collectively); rank 0 writes. The folder appears in one rename,
    so a killed run leaves the previous folder or none, never a half-written one. ``state_dict`` (full, keys
    of the module) replaces the module's own weights, e.g. an EMA copy.
    """
    module = E.unwrap(model)
    state = state_dict if state_dict is not None else E.full_state_dict(module)
    if E.is_main():
        target, prefix = hf_model(module)
        state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        with atomic_dir(out_dir) as tmp:
            for key, value in (config_updates or {}).items():
                setattr(target.config, key, value)
            target.save_pretrained(tmp, state_dict=state, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
    E.barrier()
