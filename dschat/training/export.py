"""Exporting a saved training state (any ZeRO stage, LoRA too) as a plain HF folder (``dschat export``).

The state's DeepSpeed shards are merged offline (no process group, no GPU), the module that trained is rebuilt
from the config saved beside them (with its LoRA adapters, if any), and ``save_hf`` writes it merged, with
safetensors, exactly as a stage writes its final model. torch, deepspeed and transformers are imported when an
export runs.
"""

from __future__ import annotations

import json
from pathlib import Path

from dschat.config import LoraArgs
from dschat.errors import UserError


def find_state(path: Path) -> Path:
    """A state folder (holding trainer.json), or the latest complete state under an output folder."""
    from dschat.training.resume import latest_state  # deepspeed: imported when an export runs

    if (path / "trainer.json").exists():
        return path
    state = latest_state(path)
    if state is None:
        raise UserError(f"{path}: no saved training state (run with --save-interval N, or give a "
                        "checkpoints/step-N folder)")
    return state


def rebuild_module(meta_dir: Path) -> object:
    """An untrained module shaped like the one that wrote the state (weights are loaded afterwards)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from dschat.models.lora import apply_lora  # torch: imported when an export runs
    from dschat.models.reward_model import RewardModel

    meta = json.loads((meta_dir / "dschat.json").read_text())
    config = AutoConfig.from_pretrained(meta_dir)
    if meta["kind"] == "reward":
        module: object = RewardModel(AutoModelForSequenceClassification.from_config(config))
    else:
        module = AutoModelForCausalLM.from_config(config)
    if meta.get("lora"):
        apply_lora(module, LoraArgs(**meta["lora"]))  # type: ignore[arg-type]
    return module


def export_state(checkpoint: Path, output: Path, engine: str | None = None, save_adapter: bool = False) -> Path:
    # deepspeed, torch, transformers: imported when an export runs
    from dschat import engine as E
    from dschat.integrity import verify_state
    from dschat.models.loading import load_tokenizer
    from dschat.training.checkpoint import save_hf
    from dschat.training.resume import META, TAG

    state_dir = find_state(checkpoint)
    verify_state(state_dir)  # before anything unpickles: only a state exactly as dschat wrote it is loaded
    engines = sorted(p.name for p in state_dir.iterdir() if (p / TAG).is_dir())
    name = engine or next((n for n in ("model", "actor") if n in engines), None)
    if name not in engines:
        raise UserError(f"{state_dir}: no engine {name!r} (has: {', '.join(engines) or 'none'})")
    meta = state_dir / name / META
    if not (meta / "dschat.json").exists():
        raise UserError(f"{state_dir / name}: no saved model description ({META}/dschat.json)")
    module = rebuild_module(meta)
    weights = E.consolidated_checkpoint_state(state_dir / name, TAG)
    missing = set(dict(module.state_dict()).keys()) - set(weights)  # type: ignore[attr-defined]
    missing = {k for k in missing if "rotary" not in k}
    if missing:
        raise UserError(f"{state_dir / name}: the shards lack {len(missing)} weights, e.g. {sorted(missing)[0]}")
    save_hf(module, load_tokenizer(str(meta)), output, state_dict=weights, save_adapter=save_adapter)
    return state_dir / name
