"""Saving models as plain Hugging Face folders, atomically, whatever the ZeRO stage or LoRA."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dschat import engine as E
from dschat.diskfull import DiskFull, disk_full_error, is_disk_full
from dschat.models.lora import ADAPTER_DIR, adapter_state_dict, lora_args_of, merged_state_dict, save_adapter_folder
from dschat.models.reward_model import hf_model
from dschat.utils import atomic_dir


def save_hf(model: Any, tokenizer: Any, out_dir: str | Path, config_updates: dict[str, Any] | None = None,
            state_dict: dict[str, Any] | None = None, save_adapter: bool | None = None) -> None:
    """Write ``model`` (engine or module) as a HF folder: config.json, safetensors, tokenizer files.

    Call on every rank (ZeRO-3 gathers shards collectively); rank 0 writes. The folder appears in one rename,
    so a killed run leaves the previous folder or none, never a half-written one. ``state_dict`` (full, keys
    of the module) replaces the module's own weights, e.g. an EMA copy.

    A LoRA model (``dschat.models.lora.apply_lora``) is saved merged, under the plain model's names and config, so
    transformers loads it without peft. ``save_adapter`` (None: the model's ``LoraArgs.save_adapter``) also
    writes the unmerged PEFT adapter to ``out_dir/adapter/`` (``dschat.models.lora.ADAPTER_DIR``).
    """
    module = E.unwrap(model)
    failed = False
    state = state_dict if state_dict is not None else E.full_state_dict(model)
    if E.is_main():
        # Non-persistent buffers (rotary inv_freq) are not weights; the ZeRO-3 gather returns them too.
        transient = {f"{n}.{b}" if n else b for n, m in module.named_modules() for b in m._non_persistent_buffers_set}
        state = {k: v for k, v in state.items() if k not in transient}
        lora = lora_args_of(module)
        want_adapter = lora is not None and (lora.save_adapter if save_adapter is None else save_adapter)
        adapter = adapter_state_dict(module, state) if want_adapter else None
        state = merged_state_dict(module, state)
        target, prefix = hf_model(module)
        state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        try:
            with atomic_dir(out_dir) as tmp:
                for key, value in (config_updates or {}).items():
                    setattr(target.config, key, value)
                target.save_pretrained(tmp, state_dict=state, safe_serialization=True)
                tokenizer.save_pretrained(tmp)
                if adapter is not None:
                    save_adapter_folder(module, adapter, Path(tmp) / ADAPTER_DIR)
        except Exception as e:  # noqa: BLE001 - a full disk is one line (atomic_dir removed the partial folder)
            if not is_disk_full(e, out_dir):
                raise
            failed = True
    # Every rank learns whether rank 0 could write (this is the closing barrier), so all stop together.
    if any(E.gather_objects(failed)):
        raise DiskFull(E.broadcast_object(str(disk_full_error("a model folder", out_dir, _kept(out_dir)))
                                          if E.is_main() else None))


def _kept(out_dir: str | Path) -> str:
    from dschat.training.resume import latest_state

    latest = latest_state(Path(out_dir).parent)
    return f"the last complete training state {latest} is kept" if latest else "no partial folder is left"
