"""Typed run configuration: every flag is declared once, here, as a dataclass field.

A stage's configuration is a dataclass whose fields are the shared pieces (``ModelArgs``, ``DataArgs``,
``OptimArgs``, ``EngineArgs``, ``RunArgs``) plus a piece of its own. The click options of ``dschat train`` and of
each ``stepN/main.py`` and the keys of ``--config FILE`` are generated from these definitions (see
``dschat.cli``), so the help text, the default and the type live in exactly one place.

Field names are unique across the pieces of a stage: the command line is flat (``--learning-rate``), the
configuration is nested (``cfg.optim.learning_rate``), and functions take only the piece they need.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dschat.errors import UserError


def arg(default: Any = dataclasses.MISSING, help: str = "", *, factory: Any = None, hidden: bool = False,
        choices: tuple[str, ...] | None = None, aliases: tuple[str, ...] = ()) -> Any:
    """A dataclass field carrying its CLI help text (optional choices, and other flag names for it, e.g. stage 3
    takes ``--model`` for ``--actor-model`` as every stage takes ``--model``)."""
    meta = {"help": help, "hidden": hidden, "choices": choices, "aliases": aliases}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelArgs:
    model: str = arg("tiny", "Model: local folder, HF id in the cache, alias (chinese-llama-2-7b, opt-1.3b, "
                             "qwen2.5-0.5b, ...) or the preset 'tiny'.")
    dtype: str = arg("auto", "Parameter dtype; auto = fp32 on CPU, bf16 (else fp16) on CUDA.",
                     choices=("auto", "fp32", "bf16", "fp16"))
    gradient_checkpointing: bool = arg(False, "Recompute activations in the backward pass to save memory.")
    dropout: float | None = arg(None, "Override every dropout probability of the model (0 disables it).")
    trust_remote_code: bool = arg(False, "Allow model code shipped with the checkpoint.")


@dataclass
class DataArgs:
    data: list[str] = arg(help="Dataset (repeatable), each optionally 'path:weight': a .jsonl/.json/.parquet file, "
                               "a save_to_disk folder, or a registered name from the HF cache. Default: the "
                               "embedded demo corpus.", factory=list)
    data_split: str = arg("2,4,4", "Proportions of every dataset given to train phases 1, 2 and 3.")
    data_cache_dir: str = arg("", "Where tokenized datasets are cached (default ~/.cache/dschat/data).")
    max_seq_len: int = arg(256, "Longest prompt + answer in tokens; longer rows are dropped and counted.")
    max_prompt_seq_len: int = arg(128, "Longest prompt in tokens for phase 3 (left-truncated beyond).")
    eval_fraction: float = arg(0.05, "Held-out fraction for evaluation when a dataset has no test split.")
    max_eval_rows: int = arg(400, "Cap on evaluation rows per stage (0 = no cap).")
    mask_prompt: bool = arg(True, "Mask prompt tokens out of the SFT loss.")
    judge_system_prompt: str = arg("", "File whose text opens every judge-pairwise row (context_messages + winner) "
                                       "that has no system message, as its system message (an RM-R1 rubric); "
                                       "rows with their own keep it.")


@dataclass
class OptimArgs:
    learning_rate: float | None = arg(None, "Peak learning rate (default: 1e-3 for models under 50M parameters, "
                                            "such as the tiny preset; else 1e-5).")
    weight_decay: float = arg(0.0, "AdamW weight decay (not applied to biases and norms).")
    lr_scheduler_type: str = arg("cosine", "Learning-rate schedule after warmup.",
                                 choices=("cosine", "linear", "constant"))
    warmup_ratio: float = arg(0.05, "Fraction of the optimizer steps spent in linear warmup.")
    num_warmup_steps: int | None = arg(None, "Warmup steps (overrides --warmup-ratio).")
    per_device_train_batch_size: int = arg(8, "Micro-batch size per device.")
    per_device_eval_batch_size: int = arg(16, "Evaluation batch size per device.")
    gradient_accumulation_steps: int = arg(1, "Micro-batches per optimizer step.")
    num_train_epochs: int = arg(1, "Passes over the training data.")
    max_steps: int = arg(-1, "Train for exactly this many optimizer steps, overriding --num-train-epochs "
                             "(-1: run the epochs).")
    max_grad_norm: float = arg(1.0, "Gradient clipping norm (0 disables).")
    adam_beta1: float = arg(0.9, "AdamW beta1.")
    adam_beta2: float = arg(0.95, "AdamW beta2.")


@dataclass
class EngineArgs:
    zero_stage: int = arg(0, "DeepSpeed ZeRO stage (0-3).")
    offload: bool = arg(False, "Offload optimizer state (and ZeRO-3 parameters) to CPU memory.")


@dataclass
class LoraArgs:
    """LoRA through PEFT (Hu et al. 2021, arXiv:2106.09685), DeepSpeed-Chat's flags.

    Stages 1 and 2 compose this piece as it is. Stage 3 trains two models, and flag names must be unique across
    a stage's pieces, so it declares ``actor_lora_dim``, ``critic_lora_dim``, ``actor_lora_module_name``, ... in
    its own dataclass and builds one ``LoraArgs(lora_dim=..., ...)`` per model from them.
    """

    lora_dim: int = arg(0, "LoRA rank r (0: no LoRA, train the full model).")
    lora_alpha: float = arg(16.0, "LoRA scaling numerator: the update is B @ A * alpha / r.")
    lora_dropout: float = arg(0.0, "Dropout on the LoRA branch input.")
    lora_module_name: str = arg("all-linear", "Which linear layers get adapters: 'all-linear' (every attention "
                                              "and MLP projection of the backbone, never the LM head or v_head) "
                                              "or a comma-separated list of module-name substrings, e.g. "
                                              "'q_proj,v_proj' or 'decoder.layers.'.")
    only_optimize_lora: bool = arg(True, "Freeze the base weights and train only the adapters (and the v_head of "
                                         "a reward/critic model); false trains the base weights too.")
    lora_learning_rate: float | None = arg(None, "Learning rate of the LoRA weights (default: the main one).")
    save_adapter: bool = arg(False, "Also save the unmerged PEFT adapter (adapter_config.json + "
                                    "adapter_model.safetensors) in the model folder's adapter/ subfolder.")


@dataclass
class RunArgs:
    output_dir: str = arg("", "Output folder (model/, eval.json, metrics.jsonl, tensorboard/, args.json).")
    seed: int = arg(1234, "Random seed for data order, splits and initialisation.")
    eval_interval: int = arg(0, "Evaluate every N optimizer steps (0: only before and after training).")
    log_interval: int = arg(1, "Log metrics every N optimizer steps.")
    save_interval: int = arg(0, "Write a resumable training state every N steps (0: only the final one; Ctrl-C "
                                "also saves).")
    save_final_state: bool = arg(True, "Write a resumable training state when training ends, so --resume with a "
                                       "larger --max-steps or --num-train-epochs trains on (and `dschat export` "
                                       "can read it).")
    keep_checkpoints: int = arg(2, "How many resumable states to keep.")
    resume: bool = arg(False, "Continue from the latest complete training state in the output folder (also a "
                              "finished run's final state).")
    force: bool = arg(False, "Overwrite an output folder that already holds a finished run or training states.")
    progress: bool = arg(True, "Show a progress bar.")
    local_rank: int = arg(-1, "Set by the deepspeed launcher.", hidden=True)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (tp, False)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


@dataclass(frozen=True)
class FlagSpec:
    """One command-line flag, derived from a dataclass field."""

    name: str  # field name, e.g. learning_rate
    group: str  # attribute of the stage config holding the piece, e.g. optim
    type: Any  # int, float, str, bool or list
    optional: bool
    default: Any
    help: str
    hidden: bool
    choices: tuple[str, ...] | None
    aliases: tuple[str, ...] = ()


def flag_specs(config_cls: type) -> list[FlagSpec]:
    """Flatten a stage config (a dataclass of dataclass pieces) into flags; names must be unique."""
    specs: list[FlagSpec] = []
    seen: dict[str, str] = {}
    hints = typing.get_type_hints(config_cls)
    for group in dataclasses.fields(config_cls):
        piece = hints[group.name]
        piece_hints = typing.get_type_hints(piece)
        for f in dataclasses.fields(piece):
            if f.name in seen:
                raise TypeError(f"flag --{f.name} declared twice ({seen[f.name]} and {group.name})")
            seen[f.name] = group.name
            tp, optional = _unwrap_optional(piece_hints[f.name])
            if typing.get_origin(tp) is list:
                tp = list
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            specs.append(FlagSpec(f.name, group.name, tp, optional, default, f.metadata.get("help", ""),
                                  f.metadata.get("hidden", False), f.metadata.get("choices"),
                                  f.metadata.get("aliases", ())))
    return specs


def build_config(config_cls: type, values: dict[str, Any]) -> Any:
    """Build a nested stage config from flat ``{flag_name: value}``; unknown names are an error."""
    specs = {s.name: s for s in flag_specs(config_cls)}
    unknown = sorted(set(values) - set(specs))
    if unknown:
        raise UserError(f"unknown option(s): {', '.join('--' + u.replace('_', '-') for u in unknown)}")
    pieces: dict[str, dict[str, Any]] = {}
    for name, value in values.items():
        pieces.setdefault(specs[name].group, {})[name] = _coerce(specs[name], value)
    hints = typing.get_type_hints(config_cls)
    kwargs = {g.name: hints[g.name](**pieces.get(g.name, {})) for g in dataclasses.fields(config_cls)}
    cfg = config_cls(**kwargs)
    for s in specs.values():
        if s.choices and getattr(getattr(cfg, s.group), s.name) not in s.choices:
            raise UserError(f"--{s.name.replace('_', '-')} must be one of {', '.join(s.choices)}")
    return cfg


def _coerce(spec: FlagSpec, value: Any) -> Any:
    """Values from a config file arrive as JSON/YAML scalars; check and convert them to the flag's type."""
    flag = "--" + spec.name.replace("_", "-")
    if value is None:
        if spec.optional:
            return None
        raise UserError(f"{flag} cannot be null")
    if spec.type is list:
        return [str(v) for v in value] if isinstance(value, list | tuple) else [str(value)]
    if spec.type is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise UserError(f"{flag} expects true or false, got {value!r}")
    try:
        return spec.type(value)
    except (TypeError, ValueError):
        raise UserError(f"{flag} expects {spec.type.__name__}, got {value!r}") from None


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read ``--config FILE`` (YAML or JSON) into flat ``{flag_name: value}`` (dashes or underscores)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: config file not found")
    text = p.read_text(encoding="utf-8")
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
    except Exception as e:  # noqa: BLE001 - any parse error is a user error here
        raise UserError(f"{p}: cannot parse config: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UserError(f"{p}: config must be a mapping of flag names to values")
    flat: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, dict):  # allow the nested form {optim: {learning_rate: ...}}
            flat.update({kk.replace("-", "_"): vv for kk, vv in v.items()})
        else:
            flat[k.replace("-", "_")] = v
    return flat


def to_flat_dict(cfg: Any) -> dict[str, Any]:
    """The flat ``{flag_name: value}`` view of a stage config (what ``args.json`` holds)."""
    out: dict[str, Any] = {}
    for g in dataclasses.fields(cfg):
        out.update(dataclasses.asdict(getattr(cfg, g.name)))
    out.pop("local_rank", None)
    return out
