"""LoRA through PEFT: adapters go in after loading, plain merged weights come out on save.

LoRA (Hu et al. 2021, arXiv:2106.09685) replaces a frozen ``W`` by ``W + B @ A * alpha / r``. dschat injects PEFT's
LoRA layers in place (``peft.inject_adapter_in_model``) into the Hugging Face model itself, the causal LM or the
``*ForSequenceClassification`` inside a ``RewardModel``, instead of wrapping it in a ``PeftModel``: the model keeps
its class, ``config``, ``generate`` and ``RewardModel.backbone``, and its parameter names change only inside the
adapted layers::

    model.layers.0.self_attn.q_proj.weight  ->  model.layers.0.self_attn.q_proj.base_layer.weight
                                                model.layers.0.self_attn.q_proj.lora_A.default.weight   (r, in)
                                                model.layers.0.self_attn.q_proj.lora_B.default.weight   (out, r)

Saving maps those names back. ``merged_state_dict`` turns a full state dict (``dschat.engine.full_state_dict``,
gathered under ZeRO-3 by name) into the plain model's, ``W + B @ A * scaling`` under the original names, so the
folder that ``dschat.training.checkpoint.save_hf`` writes loads with plain transformers and no peft. With
``save_adapter`` the unmerged adapter is saved too, as PEFT saves it, in ``<model folder>/adapter/``;
``PeftModel.from_pretrained(base, folder / "adapter")`` on the base model reproduces the trained model. A reward
model's adapter lists its v_head in ``modules_to_save``, because the v_head is trained in full, not adapted.

peft and dschat.engine (deepspeed) are imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dschat.config import LoraArgs
from dschat.errors import UserError
from dschat.models.reward_model import RewardModel, hf_model

ADAPTER = "default"  # PEFT's adapter name; dschat attaches one adapter per model
ADAPTER_DIR = "adapter"  # subfolder of a saved model folder holding the unmerged adapter
_ARGS_ATTR = "_dschat_lora"  # where apply_lora leaves its LoraArgs on the HF model, for save_hf


# ------------------------------------------------------------------------------------------------- apply
def apply_lora(model: nn.Module, lora: LoraArgs) -> nn.Module:
    """Inject LoRA adapters (rank ``lora.lora_dim``) into ``model`` in place and return it.

    ``model`` is a HF causal LM or a ``RewardModel``; a reward model's backbone gets the adapters and its v_head
    stays a plain trainable ``Linear``. With ``only_optimize_lora`` every base weight is frozen (requires_grad
    False) except the v_head; without it the base weights keep training next to the adapters. ``lora_dim`` 0
    returns the model untouched. Call before ``dschat.engine.build_train_engine``.
    """
    if lora.lora_dim <= 0:
        if lora.lora_dim < 0:
            raise UserError(f"--lora-dim must be >= 0, got {lora.lora_dim}")
        return model
    if lora.lora_alpha <= 0:
        raise UserError(f"--lora-alpha must be > 0, got {lora.lora_alpha}")
    if not 0.0 <= lora.lora_dropout < 1.0:
        raise UserError(f"--lora-dropout must be in [0, 1), got {lora.lora_dropout}")
    from peft import LoraConfig, inject_adapter_in_model

    hf, _ = hf_model(model)
    if getattr(hf, "peft_config", None):
        raise UserError("the model already carries PEFT adapters; load a merged folder instead")
    names = target_module_names(hf, lora.lora_module_name)
    trainable = {id(p): p.requires_grad for p in model.parameters()}
    config = LoraConfig(r=lora.lora_dim, lora_alpha=lora.lora_alpha, lora_dropout=lora.lora_dropout,
                        target_modules=_compact_targets(hf, names), bias="none")
    inject_adapter_in_model(config, hf, adapter_name=ADAPTER)
    adapted = [n for n, _ in _lora_layers(hf)]
    if sorted(adapted) != sorted(names):  # PEFT matched names differently from dschat's selection
        raise RuntimeError(f"LoRA targeted {sorted(set(adapted) ^ set(names))[:5]} unexpectedly")

    # PEFT froze every parameter but the adapters. Base weights are the same Parameter objects as before.
    keep = _v_head_param_ids(model)
    for p in model.parameters():
        if id(p) in trainable:
            p.requires_grad_(trainable[id(p)] and (not lora.only_optimize_lora or id(p) in keep))
    if lora.only_optimize_lora and not getattr(hf, "_require_grads_hooks", None):
        # Frozen embeddings give activations without grad; reentrant gradient checkpointing then drops the
        # adapters' gradients (peft/transformers do the same for PEFT models).
        hf.enable_input_require_grads()
    setattr(hf, _ARGS_ATTR, copy.deepcopy(lora))
    return model


def lora_args_of(model: nn.Module) -> LoraArgs | None:
    """The ``LoraArgs`` that ``apply_lora`` used on ``model`` (a module, not an engine), or None."""
    return getattr(hf_model(model)[0], _ARGS_ATTR, None)


def target_module_names(hf: nn.Module, spec: str) -> list[str]:
    """Names of the linear layers that get adapters: every ``Linear``/``Conv1D`` outside the output heads for
    ``all-linear``, else those whose name contains one of the comma-separated substrings (DeepSpeed-Chat's
    ``--lora_module_name``). The LM head and the v_head (``score``) never get adapters."""
    from transformers.pytorch_utils import Conv1D

    heads = [hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None,
             getattr(hf, "score", None), getattr(hf, "classifier", None)]
    head_ids = {id(m) for h in heads if isinstance(h, nn.Module) for m in h.modules()}
    linear = [n for n, m in hf.named_modules() if isinstance(m, nn.Linear | Conv1D) and id(m) not in head_ids]
    parts = [s.strip() for s in spec.split(",") if s.strip()]
    if not parts or parts == ["all-linear"]:
        names = linear
    else:
        names = [n for n in linear if any(s in n for s in parts)]
    if not names:
        raise UserError(f"--lora-module-name {spec!r} matches no linear layer of the model; its linear layers "
                        f"are named like {', '.join(linear[:3])}")
    return names


def _compact_targets(hf: nn.Module, names: list[str]) -> list[str]:
    """PEFT ``target_modules`` selecting exactly ``names``: their leaf names when those select nothing else
    (readable in adapter_config.json: ``["q_proj", "v_proj"]``), else the full names."""
    leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
    selected = [n for n, _ in hf.named_modules() if any(n == s or n.endswith("." + s) for s in leaves)]
    return leaves if sorted(selected) == sorted(names) else sorted(names)


def _lora_layers(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    if "peft" not in sys.modules:  # no adapter can exist before peft is imported; keep plain saves peft-free
        return
    from peft.tuners.lora import LoraLayer

    for name, m in module.named_modules():
        if isinstance(m, LoraLayer):
            yield name, m


def _v_head_param_ids(model: nn.Module) -> set[int]:
    return {id(p) for p in model.v_head.parameters()} if isinstance(model, RewardModel) else set()


# --------------------------------------------------------------------------------------------- optimizer
def lora_param_groups(model: nn.Module, weight_decay: float, lr: float,
                      lora_lr: float | None = None) -> list[dict[str, Any]]:
    """AdamW groups for ``dschat.engine.build_train_engine(param_groups=...)``: the usual decay split
    (``dschat.engine.optimizer_groups``: frozen parameters skipped), with the adapters in their own groups at
    ``lora_lr`` (None: ``lr``). Base groups come first, so ``engine.get_lr()[0]`` is the main rate whenever
    base weights (or a v_head) train. Works on a model without LoRA too (then it is the usual split)."""
    from dschat.engine import optimizer_groups  # here, not above: dschat.engine imports deepspeed (start-up cost)

    adapter_ids = {id(p) for _, m in _lora_layers(model) for name, p in m.named_parameters()
                   if not name.startswith("base_layer.")}
    base, adapters = [], []
    for g in optimizer_groups(model, weight_decay):
        plain = [p for p in g["params"] if id(p) not in adapter_ids]
        ours = [p for p in g["params"] if id(p) in adapter_ids]
        if plain:
            base.append({**g, "params": plain, "lr": lr})
        if ours:
            adapters.append({**g, "params": ours, "lr": lr if lora_lr is None else lora_lr})
    return base + adapters


# -------------------------------------------------------------------------------------------------- save
def merged_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain model's state dict from ``state``, a full state dict of ``model`` (same keys as
    ``model.state_dict()``, e.g. gathered by ``dschat.engine.full_state_dict`` or an EMA copy).

    Every adapted layer ``name`` becomes ``name.weight = base + (B @ A) * alpha / r`` (transposed for GPT-2's
    ``Conv1D``), computed in fp32 and cast back, with its bias under ``name.bias``; every other key is kept as
    is. A model without LoRA gets ``state`` back unchanged (a shallow copy).
    """
    out = dict(state)
    for name, m in _lora_layers(model):
        _check_plain_lora(name, m)
        p = f"{name}." if name else ""
        out[f"{p}weight"] = merged_weight(m, out.pop(f"{p}base_layer.weight"), out.pop(f"{p}lora_A.{ADAPTER}.weight"),
                                          out.pop(f"{p}lora_B.{ADAPTER}.weight"))
        for key in [k for k in out if k.startswith(f"{p}base_layer.")]:
            out[p + key[len(p) + len("base_layer."):]] = out.pop(key)
    leftover = [k for k in out if ".lora_" in k or "base_layer." in k]
    if leftover:
        raise RuntimeError(f"LoRA keys left after merging: {leftover[:5]}")
    return out


def merged_weight(layer: nn.Module, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One adapted layer's plain weight ``base + (B @ A) * alpha / r`` from its base weight, ``a`` (r, in) and
    ``b`` (out, r), computed in fp32 and cast back (transposed for GPT-2's ``Conv1D``, which stores (in, out))."""
    return merge(base, a, b, layer.scaling[ADAPTER], bool(getattr(layer, "fan_in_fan_out", False)))


def merge(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, fan_in_fan_out: bool = False
          ) -> torch.Tensor:
    """``base + (B @ A) * scaling`` in fp32, cast back to ``base``'s dtype (the delta transposed where the layer
    stores (in, out)): the one merge, on the trainer's saves and on a sampler that receives adapters."""
    delta = (b.float() @ a.float()) * scaling  # (out, in)
    if fan_in_fan_out:
        delta = delta.T
    return (base.float() + delta).to(base.dtype)


def _check_plain_lora(name: str, m: nn.Module) -> None:
    from peft.tuners.lora import Linear

    if not isinstance(m, Linear) or m.use_dora.get(ADAPTER) or m.lora_bias.get(ADAPTER):
        raise NotImplementedError(f"{name}: only plain LoRA on linear layers can be merged ({type(m).__name__})")


def adapter_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter weights as ``PeftModel.save_pretrained`` stores them (``base_model.model.<name>.lora_A.weight``,
    names relative to the HF model), taken from ``state``, a full state dict of ``model``. A reward model's
    v_head is included as ``base_model.model.score.weight`` (its ``modules_to_save`` entry)."""
    from peft import get_peft_model_state_dict

    hf, prefix = hf_model(model)
    rel = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    adapter = get_peft_model_state_dict(hf, state_dict=rel, adapter_name=ADAPTER, save_embedding_layers=False)
    for head in _v_head_names(model):
        adapter.update({k: v for k, v in rel.items() if k.startswith(f"{head}.")})
    return {f"base_model.model.{k}": v.contiguous() for k, v in adapter.items()}


def _v_head_names(model: nn.Module) -> list[str]:
    if not isinstance(model, RewardModel):
        return []
    hf, _ = hf_model(model)
    return [n for n, m in hf.named_modules() if m is model.v_head]


def save_adapter_folder(model: nn.Module, adapter: dict[str, torch.Tensor], out_dir: str | Path) -> None:
    """Write ``adapter`` (from ``adapter_state_dict``) as a PEFT adapter folder: adapter_config.json and
    adapter_model.safetensors. Its ``base_model_name_or_path`` is the folder the model was loaded from.

    Load it onto that base with ``PeftModel.from_pretrained(base, folder)``, where ``base`` is
    ``AutoModelForCausalLM.from_pretrained(path)`` for a causal LM, or for a reward model
    ``AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, pad_token_id=...)`` (its fresh
    ``score`` is replaced by the saved v_head).
    """
    from safetensors.torch import save_file

    hf, _ = hf_model(model)
    config = copy.deepcopy(hf.peft_config[ADAPTER])
    config.base_model_name_or_path = getattr(hf, "name_or_path", None) or None
    config.inference_mode = True
    is_reward = isinstance(model, RewardModel)
    config.task_type = "SEQ_CLS" if is_reward else "CAUSAL_LM"
    config.modules_to_save = _v_head_names(model) or None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    save_file(adapter, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
