"""Typed run configuration: every flag is declared once, here, as a dataclass field.

A stage's configuration is a dataclass whose fields are the shared pieces (``ModelArgs``, ``DataArgs``,
``OptimArgs``, ``EngineArgs``, ``RunArgs``) plus a piece of its own. The click options of ``dschat train`` and of
each ``stepN/main.py`` and the keys of ``--config FILE`` are generated from these definitions (see
``dschat.cli.main``), so the help text, the default and the type live in exactly one place.

Field names are unique across the pieces of a stage: the command line is flat (``--learning-rate``), the
configuration is nested (``cfg.optim.learning_rate``), and functions take only the piece they need.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dschat.errors import UserError

# --generation-backend: what samples (dschat.generation.backends)
BACKENDS = ("auto", "vllm", "dschat", "graph", "compiled", "hf")

# --report-to: where the metrics go (dschat.training.run_tracker, dschat.training.sinks)
REPORT_TO = ("tensorboard", "jsonl", "wandb", "mlflow", "trackio")


def backend_help(fallback: str) -> str:
    """``--generation-backend``'s help, one text for every command that samples: what each name runs, and what
    ``auto`` picks (``dschat.generation.backends.resolve_backend``); ``fallback`` is the command's pick where
    neither vLLM nor the captured step runs the model (stage 3: dschat; ``dschat chat`` and the judge: hf)."""
    return ("What samples: vllm (a vLLM engine beside the model, its weights pushed and checked after every update "
            "of a trained one; pip install -r requirements-vllm.txt), dschat (our loop: a preallocated KV cache, a "
            "lean per-token forward for Llama-architecture models; in stage 3 the sampling pass's log-probs reused "
            "as PPO's old log-probs in fp32), graph (the same loop with its token step captured as a CUDA graph per "
            "batch and cache-width bucket; CUDA, Llama-architecture models), compiled (the step compiled by "
            "torch.compile; tens of seconds to compile on first use), hf (transformers' generate); auto = vllm on a "
            "GPU where it is installed and runs the model, else graph on a GPU for a Llama-architecture model "
            f"(without LoRA-wrapped layers), else {fallback}.")


def arg(default: Any = dataclasses.MISSING, help: str = "", *, factory: Any = None, hidden: bool = False,
        choices: tuple[str, ...] | None = None, aliases: tuple[str, ...] = (), low: float | None = None,
        above: float | None = None, high: float | None = None) -> Any:
    """A dataclass field carrying its CLI help text, optional choices, other spellings of the flag, and its range
    (``low`` and ``high`` inclusive, ``above`` exclusive): a value out of range stops before any data or model
    loads."""
    meta = {"help": help, "hidden": hidden, "choices": choices, "aliases": aliases, "low": low, "above": above,
            "high": high}
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
    max_seq_len: int = arg(256, "Longest prompt + answer in tokens; longer rows are dropped and counted.", low=2)
    max_prompt_seq_len: int = arg(128, "Longest prompt in tokens for phase 3 (left-truncated beyond).", low=1)
    eval_fraction: float = arg(0.05, "Held-out fraction for evaluation when a dataset has no test split.", low=0)
    max_eval_rows: int = arg(400, "Cap on evaluation rows per stage (0 = no cap).", low=0)
    mask_prompt: bool = arg(True, "Mask prompt tokens out of the SFT loss.")
    packing: bool = arg(False, "Pack several training rows into each sequence (SFT rows up to --max-seq-len tokens; "
                               "the reward model and DPO pack whole pairs, up to twice that), position ids "
                               "restarting and attention kept within each row: no padding, the same per-row "
                               "losses. --per-device-train-batch-size then counts packed sequences (DPO: "
                               "--per-device-generation-batch-size too). Evaluation keeps one row per sequence.")
    group_by_length: bool = arg(False, "Batch training rows of similar length together, so little padding is left "
                                       "(one row per sequence; the cheap alternative to --packing).")
    judge_system_prompt: str = arg("", "File whose text opens every judge-pairwise row (context_messages + winner) "
                                       "that has no system message, as its system message (an RM-R1 rubric); "
                                       "rows with their own keep it.")

    def inert_fields(self) -> dict[str, str]:
        return {"group_by_length": "with {packing} (packed sequences are filled to the same length)"} \
            if self.packing else {}


@dataclass
class OptimArgs:
    learning_rate: float | None = arg(None, "Peak learning rate (default: 1e-3 for models under 50M parameters, "
                                            "such as the tiny preset; else 1e-5).", above=0)
    weight_decay: float = arg(0.0, "AdamW weight decay (not applied to biases and norms).", low=0)
    lr_scheduler_type: str = arg("cosine", "Learning-rate schedule after warmup.",
                                 choices=("cosine", "linear", "constant"))
    warmup_ratio: float = arg(0.05, "Fraction of the optimizer steps spent in linear warmup.", low=0)
    num_warmup_steps: int | None = arg(None, "Warmup steps (overrides --warmup-ratio).", low=0)
    per_device_train_batch_size: int = arg(8, "Micro-batch size per device.", low=1)
    per_device_eval_batch_size: int = arg(16, "Evaluation batch size per device.", low=1)
    gradient_accumulation_steps: int = arg(1, "Micro-batches per optimizer step.", low=1)
    num_train_epochs: int = arg(1, "Passes over the training data.", low=1)
    max_steps: int = arg(-1, "Train for exactly this many optimizer steps, overriding --num-train-epochs "
                             "(-1: run the epochs).")
    max_grad_norm: float = arg(1.0, "Gradient clipping norm (0 disables).", low=0)
    adam_beta1: float = arg(0.9, "AdamW beta1.")
    adam_beta2: float = arg(0.95, "AdamW beta2.")


@dataclass
class EngineArgs:
    zero_stage: int = arg(0, "DeepSpeed ZeRO stage (0-3).", low=0)
    offload: bool = arg(False, "Offload optimizer state (and ZeRO-3 parameters) to CPU memory.")


@dataclass
class LoraArgs:
    """LoRA through PEFT (Hu et al. 2021, arXiv:2106.09685), DeepSpeed-Chat's flags.

    Stages 1 and 2 compose this piece as it is; stage 3 composes it once per trained model under a prefix
    (``--actor-lora-dim``, ``--critic-lora-dim``, ...; see ``piece``).
    """

    lora_dim: int = arg(0, "LoRA rank r (0: no LoRA, train the full model).", low=0)
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

    def inert_fields(self) -> dict[str, str]:
        if self.lora_dim > 0:
            return {}
        return {f.name: "without {lora_dim} > 0 (no LoRA)" for f in dataclasses.fields(self) if f.name != "lora_dim"}


@dataclass
class RunArgs:
    output_dir: str = arg("", "Output folder (model/, eval.json, metrics.jsonl, tensorboard/, args.json).")
    seed: int = arg(1234, "Random seed for data order, splits and initialisation.")
    eval_interval: int = arg(0, "Evaluate every N optimizer steps (0: only before and after training).", low=0)
    log_interval: int = arg(1, "Log metrics every N optimizer steps.", low=1)
    save_interval: int = arg(0, "Write a resumable training state every N steps (0: only the final one; Ctrl-C "
                                "also saves).")
    save_final_state: bool = arg(True, "Write a resumable training state when training ends, so --resume with a "
                                       "larger --max-steps or --num-train-epochs trains on (and `dschat export` "
                                       "can read it).")
    keep_checkpoints: int = arg(2, "How many resumable states to keep.", low=1)
    resume: bool = arg(False, "Continue from the latest complete training state in the output folder (also a "
                              "finished run's final state).")
    force: bool = arg(False, "Overwrite an output folder that already holds a finished run or training states.")
    progress: bool = arg(True, "Show a progress bar.")
    report_to: str = arg("tensorboard,jsonl", "Where metrics go: a comma-separated list of tensorboard, jsonl, "
                                              "wandb, mlflow, trackio. metrics.jsonl is always written; wandb, "
                                              "mlflow and trackio need their package (pip install \"dschat[wandb]\", "
                                              "...) and log offline into the output folder unless their own "
                                              "environment variables name a server (docs/tracking.md).")
    local_rank: int = arg(-1, "Set by the deepspeed launcher.", hidden=True)

    def __post_init__(self) -> None:
        report_sinks(self.report_to)  # an unknown name stops before anything loads


def report_sinks(value: str) -> tuple[str, ...]:
    """The trackers a ``--report-to`` value names, in order, each once; anything else is a one-line error."""
    names = tuple(dict.fromkeys(n.strip() for n in value.split(",") if n.strip()))
    unknown = [n for n in names if n not in REPORT_TO]
    if unknown or not names:
        raise UserError(f"--report-to takes a comma-separated list of {', '.join(REPORT_TO)}; got {value!r}")
    return names


@dataclass
class RewardArgs:
    rm_loss: str = arg("pairwise", "Reward loss: 'pairwise' compares the diverging tails token by token "
                                   "(DeepSpeed-Chat, pad-safe; docs/algorithms.md, Reward-model loss); 'last-token' "
                                   "compares end scores, minus each row's optional 'margin'.",
                       choices=("pairwise", "last-token"))
    rm_center_coef: float = arg(0.0, "Weight of the centring term coef * (score_c + score_x)^2 that keeps scores "
                                     "near zero (--rm-loss last-token only).", low=0)

    def inert_fields(self) -> dict[str, str]:
        return {"rm_center_coef": f"with --rm-loss {self.rm_loss}"} if self.rm_loss != "last-token" else {}


@dataclass
class KDArgs:
    """Knowledge distillation in stage 1 (Hinton et al. 2015, arXiv:1503.02531; docs/algorithms.md, Distillation):
    the loss is ``(1 - kd_coef) * CE + kd_coef * T^2 * KL(teacher_T || student_T)`` over the answer tokens."""

    teacher_model: str = arg("", "Teacher for knowledge distillation: a causal LM with the student's tokenizer (a "
                                 "stage output folder stands for its actor/ or model/), frozen, at the student's "
                                 "ZeRO stage. Empty: plain SFT.")
    kd_coef: float = arg(0.5, "Weight a of the distillation term: loss = (1 - a) * CE + a * T^2 * KL(teacher || "
                              "student) over answer tokens (1: distillation only).", low=0, high=1)
    kd_temperature: float = arg(1.0, "Temperature T of both softmaxes in the distillation term (the T^2 factor "
                                     "keeps its gradients comparable across T).", above=0)

    def inert_fields(self) -> dict[str, str]:
        return {} if self.teacher_model else {n: "without {teacher_model}" for n in ("kd_coef", "kd_temperature")}


@dataclass
class AgentArgs:
    """Tool use and multi-turn environments (docs/tools.md): the sampler lets the policy call tools and answer an
    environment's turns; only the policy's tokens are trained on."""

    tools: list[str] = arg(help="Tool the policy may call (repeatable): a built-in (calculator) or "
                                "path/to/file.py:function (its signature and docstring are the schema; NAME=... names "
                                "it). A call is <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> or, for "
                                "a tool with one parameter, <tool_call>name(value)</tool_call>.", factory=list)
    env: list[str] = arg(help="Environment (repeatable): path/to/file.py:Class with reset(row) and step(text) -> "
                              "(observation, reward, done); NAME=... names it, and with several, the data column "
                              "--env-column picks each row's. Its reward is the source 'env' (the default reward "
                              "with --env).", factory=list)
    env_column: str = arg("env", "Data column naming each row's environment when --env is given more than once.")
    max_turns: int = arg(4, "Most assistant turns in an episode (each tool call closes one); an episode still going "
                            "then is cut.", low=1)
    tool_timeout: float = arg(10.0, "Seconds a tool call, or an environment's reset or step, may take; past it "
                                    "the call gets an error turn (the episode an error) and the run goes on.",
                              above=0)
    tool_max_output: int = arg(2000, "Characters of a tool's result (its return value, or what it printed), or of an "
                                     "environment's observation, kept; the rest is cut.", low=1)

    def inert_fields(self) -> dict[str, str]:
        out = {} if self.tools or self.env else {
            n: "without --tools or --env" for n in ("max_turns", "tool_timeout", "tool_max_output")}
        if len(self.env) < 2:
            out["env_column"] = "without two or more --env"
        return out


def piece(cls: type, prefix: str = "", *, only: tuple[str, ...] = (), exclude: tuple[str, ...] = (),
          defaults: dict[str, Any] | None = None, help: dict[str, str] | None = None,
          aliases: dict[str, tuple[str, ...]] | None = None) -> Any:
    """A stage-config field holding one piece (a dataclass of flags), optionally projected and prefixed.

    The flags of a piece are declared once, in its dataclass. A stage that needs the same idea for two models
    composes the piece twice under prefixes: ``piece(LoraArgs, "actor")`` gives ``--actor-lora-dim``, ...,
    ``piece(LoraArgs, "critic")`` gives ``--critic-lora-dim``, .... ``only``/``exclude`` choose which of the
    piece's fields become flags (the others keep their dataclass defaults and are assembled from other pieces,
    see ``merged``); ``defaults``, ``help`` and ``aliases`` specialise a field for this stage (e.g. stage 3 starts
    without warmup and takes ``--model`` for ``--actor-model``).
    """
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = (set(only) | set(exclude) | set(defaults or {}) | set(help or {}) | set(aliases or {})) - names
    if unknown:
        raise TypeError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    flags = tuple(n for n in (only or [f.name for f in dataclasses.fields(cls)]) if n not in exclude)
    meta = {"piece": True, "prefix": prefix, "flags": flags, "defaults": dict(defaults or {}),
            "help": dict(help or {}), "aliases": dict(aliases or {})}
    return field(default_factory=lambda: _make_piece(cls, meta, {}), metadata=meta)


def _make_piece(cls: type, meta: Any, values: dict[str, Any]) -> Any:
    """An instance of a piece with the stage's defaults, remembering which of its fields are flags here."""
    obj = cls(**{**meta.get("defaults", {}), **values})
    object.__setattr__(obj, "_flags", tuple(meta.get("flags") or (f.name for f in dataclasses.fields(cls))))
    return obj


ON_ALARM = ("warn", "save", "stop", "rollback")


@dataclass
class HealthArgs:
    """The training health monitor's checks (``dschat.training.health``; docs/health.md). A threshold of 0 turns
    its check off. Trend checks compare the mean of the last ``window/2`` steps with the ``window/2`` before them
    (or with the run's first ``window/2`` steps, its baseline)."""

    on_alarm: str = arg("warn", "What an alarm does: 'warn' logs one line; 'save' also writes a training state; "
                                "'stop' saves and exits with code 4; 'rollback' restores the last state saved "
                                "before the alarm's window and trains on at a lower learning rate "
                                "(--rollback-lr-scale), stopping if an alarm fires again (--max-rollbacks).",
                        choices=ON_ALARM)
    alarm_window: int = arg(20, "Steps of history the trend checks look at (at least 4).", low=4)
    alarm_grad_spike: float = arg(10.0, "Gradient norm above this multiple of its running median over the window.",
                                  low=0)
    rollback_lr_scale: float = arg(0.5, "Learning rates are multiplied by this after each rollback.", above=0,
                                   high=1)
    max_rollbacks: int = arg(1, "Rollbacks allowed in one run; an alarm after the last one stops the run.", low=1)
    # stage 2
    alarm_overfit: float = arg(0.05, "Stage 2: held-out pair accuracy this far below its best evaluation while "
                                     "the training accuracy rose.", low=0)
    alarm_score_drift: float = arg(20.0, "Stage 2: the mean of the chosen and rejected scores (their common level, "
                                         "which the pairwise loss leaves free) drifting past +-this.", low=0)
    # stage 3
    alarm_kl_ceiling: float = arg(1.0, "KL to the reference per answer token (nats) above this.", low=0)
    alarm_kl_growth: float = arg(20.0, "KL per token growing by this factor between the two halves of the window "
                                       "(checked once it exceeds 0.05 nats).", low=0)
    alarm_entropy_floor: float = arg(0.02, "Policy entropy per answer token (nats; the sampled tokens' negative "
                                         "log-probability) below this.", low=0)
    alarm_entropy_drop: float = arg(0.9, "Policy entropy fallen by this fraction of its baseline.", low=0, high=1)
    alarm_length_pinned: float = arg(0.95, "Answer length pinned at this fraction of --max-answer-seq-len (from a "
                                           "baseline below 0.8 of it).", low=0, high=1)
    alarm_eos_drop: float = arg(0.5, "EOS rate fallen by this fraction of its baseline (a baseline of at least "
                                     "0.2).", low=0, high=1)
    alarm_hacking_z: float = arg(2.0, "Reward hacking: the held-out reward falling this many standard errors below "
                                      "its best evaluation while the training reward rose; or, with several reward "
                                      "sources, one rising and another falling by this many standard errors.",
                                 low=0)
    alarm_rm_sigma: float = arg(4.0, "The reward model's mean score outside its stage-2 mean +- this many of its "
                                     "stage-2 standard deviations.", low=0)
    alarm_value_growth: float = arg(10.0, "PPO: the critic's loss above this multiple of its running median.",
                                    low=0)
    alarm_clip_frac: float = arg(0.6, "The policy's clipped fraction at or above this over half the window.",
                                 low=0, high=1)
    alarm_async_kl: float = arg(0.1, "Asynchronous rollouts: the KL from the sampler's policy to the trainer's "
                                     "before its update (nats per answer token, async/kl_behaviour_prox) above "
                                     "this over half the window.", low=0)

    def inert_fields(self) -> dict[str, str]:
        if self.on_alarm == "rollback":
            return {}
        return {"rollback_lr_scale": "without --on-alarm rollback", "max_rollbacks": "without --on-alarm rollback"}


HEALTH_COMMON = ("on_alarm", "alarm_window", "alarm_grad_spike", "rollback_lr_scale", "max_rollbacks")
HEALTH_STAGE2 = ("alarm_overfit", "alarm_score_drift")
# the stage-3 checks that watch sampled answers (offline DPO has none)
SAMPLING_ALARMS = ("alarm_kl_ceiling", "alarm_kl_growth", "alarm_entropy_floor", "alarm_entropy_drop",
                   "alarm_length_pinned", "alarm_eos_drop", "alarm_hacking_z", "alarm_clip_frac", "alarm_async_kl")


@dataclass
class OneModelConfig:
    """The pieces stages 1 and 2 share (stage 3's ``RLHFConfig`` lives in ``dschat.rlhf.config``)."""

    model: ModelArgs = field(default_factory=ModelArgs)
    data: DataArgs = field(default_factory=DataArgs)
    optim: OptimArgs = field(default_factory=OptimArgs)
    engine: EngineArgs = field(default_factory=EngineArgs)
    lora: LoraArgs = field(default_factory=LoraArgs)
    run: RunArgs = field(default_factory=RunArgs)


@dataclass
class SFTConfig(OneModelConfig):
    """Stage 1's flags: the shared ones and knowledge distillation from a teacher."""

    kd: KDArgs = field(default_factory=KDArgs)
    health: HealthArgs = piece(HealthArgs, only=HEALTH_COMMON)


@dataclass
class RewardConfig(OneModelConfig):
    """Stage 2's flags: the shared ones and the reward loss."""

    reward: RewardArgs = field(default_factory=RewardArgs)
    health: HealthArgs = piece(HealthArgs, only=HEALTH_COMMON + HEALTH_STAGE2)


def merged(*pieces: Any) -> Any:
    """One full piece from projections of it: each field from the first piece that declares it as a flag.

    ``merged(cfg.actor_optim, cfg.optim)`` is the actor's ``OptimArgs``: its own learning rate and weight decay,
    the stage's shared schedule. A piece made outside a stage config counts as declaring every field.
    """
    cls = type(pieces[0])
    values: dict[str, Any] = {}
    for p in pieces:
        for name in getattr(p, "_flags", [f.name for f in dataclasses.fields(cls)]):
            values.setdefault(name, getattr(p, name))
    return cls(**values)


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

    name: str  # flag name, e.g. learning_rate or actor_learning_rate
    group: str  # attribute of the stage config holding the piece, e.g. optim
    type: Any  # int, float, str, bool or list
    optional: bool
    default: Any
    help: str
    hidden: bool
    choices: tuple[str, ...] | None
    aliases: tuple[str, ...] = ()
    field: str = ""  # the piece's field name (name without the prefix)
    low: float | None = None  # inclusive lower bound
    above: float | None = None  # exclusive lower bound
    high: float | None = None  # inclusive upper bound


def flag_specs(config_cls: type) -> list[FlagSpec]:
    """Flatten a stage config (a dataclass of dataclass pieces) into flags; names must be unique."""
    specs: list[FlagSpec] = []
    seen: dict[str, str] = {}
    hints = typing.get_type_hints(config_cls)
    for group in dataclasses.fields(config_cls):
        piece_cls = hints[group.name]
        piece_hints = typing.get_type_hints(piece_cls)
        meta = group.metadata if group.metadata.get("piece") else {}
        prefix = meta.get("prefix", "")
        flags = meta.get("flags") or tuple(f.name for f in dataclasses.fields(piece_cls))
        by_name = {f.name: f for f in dataclasses.fields(piece_cls)}
        for fname in flags:
            f = by_name[fname]
            name = f"{prefix}_{fname}" if prefix else fname
            if name in seen:
                raise TypeError(f"flag --{name} declared twice ({seen[name]} and {group.name})")
            seen[name] = group.name
            tp, optional = _unwrap_optional(piece_hints[fname])
            if typing.get_origin(tp) is list:
                tp = list
            if fname in meta.get("defaults", {}):
                default = meta["defaults"][fname]
            else:
                default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            help_text = meta.get("help", {}).get(fname) or f.metadata.get("help", "")
            if prefix and fname not in meta.get("help", {}):
                help_text = f"{prefix.capitalize()}: {help_text}"
            aliases = tuple(f.metadata.get("aliases", ())) if not prefix else ()
            aliases += tuple(meta.get("aliases", {}).get(fname, ()))
            specs.append(FlagSpec(name, group.name, tp, optional, default, help_text, f.metadata.get("hidden", False),
                                  f.metadata.get("choices"), aliases, fname, f.metadata.get("low"),
                                  f.metadata.get("above"), f.metadata.get("high")))
    return specs


def canonical_names(config_cls: type) -> dict[str, str]:
    """Every accepted spelling of a flag (name and aliases, underscores) -> its flag name."""
    out: dict[str, str] = {}
    for s in flag_specs(config_cls):
        out[s.name] = s.name
        for a in s.aliases:
            out[a] = s.name
    return out


def build_config(config_cls: type, values: dict[str, Any]) -> Any:
    """Build a nested stage config from flat ``{flag_name: value}`` (aliases accepted); unknown names are an
    error. Each piece remembers which of its fields are flags (``merged`` reads that)."""
    specs = {s.name: s for s in flag_specs(config_cls)}
    names = canonical_names(config_cls)
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise UserError(f"unknown option(s): {', '.join('--' + u.replace('_', '-') for u in unknown)}")
    pieces: dict[str, dict[str, Any]] = {}
    for given, value in values.items():
        s = specs[names[given]]
        pieces.setdefault(s.group, {})[s.field] = _coerce(s, value)
    hints = typing.get_type_hints(config_cls)
    kwargs = {}
    for g in dataclasses.fields(config_cls):
        kwargs[g.name] = _make_piece(hints[g.name], g.metadata, pieces.get(g.name, {}))
    cfg = config_cls(**kwargs)
    for s in specs.values():
        value = getattr(getattr(cfg, s.group), s.field)
        if s.choices and value not in s.choices and not (value is None and s.optional):
            raise UserError(f"--{s.name.replace('_', '-')} must be one of {', '.join(s.choices)}")
    return cfg


def refuse_inert(cfg: Any, given: set[str]) -> None:
    """Stop on a flag the user gave that has no effect in the chosen mode (defaults do not count).

    A stage config may define ``inert_flags() -> dict[flag name, reason]``; each piece may define
    ``inert_fields() -> dict[field name, reason]`` (e.g. LoRA settings without a LoRA rank, the reason naming
    the rank's field as ``{lora_dim}``), reported under its prefixed flag name.
    """
    specs = flag_specs(type(cfg))
    inert: dict[str, str] = {}
    for s in specs:
        fields_of = getattr(getattr(cfg, s.group), "inert_fields", None)
        if fields_of is None or s.field not in (why := fields_of()):
            continue
        # A reason names other fields of the piece as {field}; it applies only where they are flags too.
        flag_of = {t.field: "--" + t.name.replace("_", "-") for t in specs if t.group == s.group}
        with contextlib.suppress(KeyError):
            inert[s.name] = why[s.field].format(**flag_of)
    if hasattr(cfg, "inert_flags"):
        inert.update(cfg.inert_flags())
    for name in sorted(given & set(inert)):
        raise UserError(f"--{name.replace('_', '-')} has no effect {inert[name]}")


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
        out = spec.type(value)
    except (TypeError, ValueError):
        raise UserError(f"{flag} expects {spec.type.__name__}, got {value!r}") from None
    if spec.type in (int, float) and not math.isfinite(out):
        raise UserError(f"{flag} must be a finite number, got {value!r}")
    if spec.low is not None and out < spec.low:
        raise UserError(f"{flag} must be >= {spec.low:g}, got {value!r}")
    if spec.above is not None and out <= spec.above:
        raise UserError(f"{flag} must be > {spec.above:g}, got {value!r}")
    if spec.high is not None and out > spec.high:
        raise UserError(f"{flag} must be <= {spec.high:g}, got {value!r}")
    return out


def load_config_file(path: str | Path, sections: set[str] | None = None) -> dict[str, Any]:
    """Read ``--config FILE`` (YAML or JSON) into flat ``{flag_name: value}`` (dashes or underscores).

    Flags may sit at the top level or under their section's name (``optim: {learning_rate: ...}``); with
    ``sections`` (the stage config's piece names) any other mapping is an error naming the key.
    """
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
        if not isinstance(v, dict):
            flat[str(k).replace("-", "_")] = v
            continue
        if sections is not None and k not in sections:
            raise UserError(f"{p}: '{k}' holds a mapping, but only a section ({', '.join(sorted(sections))}) may; "
                            "give each flag a plain value")
        for kk, vv in v.items():
            if isinstance(vv, dict):
                raise UserError(f"{p}: '{k}.{kk}' holds a mapping; give each flag a plain value")
            flat[str(kk).replace("-", "_")] = vv
    return flat


def to_flat_dict(cfg: Any) -> dict[str, Any]:
    """The flat ``{flag_name: value}`` view of a stage config (what ``args.json`` holds)."""
    out = {s.name: getattr(getattr(cfg, s.group), s.field) for s in flag_specs(type(cfg))}
    out.pop("local_rank", None)
    return out


# The log-prob gap between a vLLM engine and the actor allowed on the sync probe, by precision (VLLMArgs).
HALF_TOLERANCE, FULL_TOLERANCE = 0.5, 1e-3


@dataclass
class VLLMArgs:
    """The vLLM engine's settings (``--generation-backend vllm``, or ``auto`` where it picks vLLM)."""

    vllm_gpu_memory_utilization: float | None = arg(None, "GPU: share of each GPU's memory vLLM may take (weights "
                                                          "and KV cache); default 0.3 beside training engines "
                                                          "(colocated, or a sampler sharing a trainer's GPU), "
                                                          "vLLM's own on a GPU of its own.", above=0, high=1)
    vllm_kv_cache_memory: int = arg(0, "CPU: vLLM's KV-cache budget in MiB (0: enough for one generation batch, "
                                       "at least 64).", low=0)
    vllm_tensor_parallel_size: int = arg(1, "GPU: GPUs per vLLM engine (tensor parallel); the data-parallel "
                                            "ranks of a group share one engine's answers.", low=1)
    vllm_enable_sleep: bool | None = arg(None, "GPU: put the engine to sleep (weights offloaded, KV cache freed) "
                                               "while the actor trains, so training gets the memory back; default "
                                               "on beside training engines, off on a GPU of its own.")
    sync_tolerance: float | None = arg(None, "Largest log-prob difference allowed between the engine and the actor "
                                             f"on the probe after a weight sync (default: {FULL_TOLERANCE} in "
                                             f"float32, {HALF_TOLERANCE} in bf16/fp16).", above=0)
    sync_timeout: float = arg(600.0, "Seconds a weight sync may take before the run stops with one line.", above=0)


VLLM_FLAGS = tuple(f.name for f in dataclasses.fields(VLLMArgs))
# the engine's own settings, which a sampler process takes too (the weight sync's belong to a colocated engine)
VLLM_ENGINE_FLAGS = ("vllm_gpu_memory_utilization", "vllm_kv_cache_memory", "vllm_tensor_parallel_size",
                     "vllm_enable_sleep")


@dataclass
class ServeArgs:
    """``dschat serve``: the reward/judge server's address, batching and limits (docs/serving.md)."""

    host: str = arg("127.0.0.1", "Address to listen on (0.0.0.0: every interface; then set --token-file).")
    port: int = arg(8000, "Port to listen on.", low=1, high=65535)
    max_batch_tokens: int = arg(16384, "Padded tokens per reward-model forward: concurrent requests are packed "
                                       "into one forward up to this budget.", low=1)
    max_queue: int = arg(64, "Requests waiting for the model at most; more are answered 429.", low=1)
    max_request_rows: int = arg(1024, "Completions per request at most (more: 413).", low=1)
    max_request_tokens: int = arg(131072, "Padded reward-model tokens per request at most (more: 413), so one "
                                          "request's cost is bounded; a request over --max-batch-tokens is scored "
                                          "over several forwards, shared with the small requests that arrive "
                                          "meanwhile.", low=1)
    max_body_bytes: int = arg(8_000_000, "Request body size in bytes at most (more: 413).", low=1)
    max_connections: int = arg(64, "Open connections at most: a new one past it closes the oldest that has no "
                                   "request in progress, else gets 503.", low=1)
    header_timeout: float = arg(10.0, "Seconds a connection may take to send a request's line and headers (from "
                                      "its opening or its last answer); then it is closed.", above=0)
    body_timeout: float = arg(30.0, "Seconds a request may take to send its body once its headers are in; then "
                                    "408.", above=0)
    max_seq_len: int = arg(512, "Longest prompt + answer the reward model reads, in its tokens; a longer text loses "
                                "the start of its prompt, as in stage 3 (the stage's --max-prompt-seq-len + "
                                "--max-answer-seq-len); token ids sent longer than this are refused (422).", low=2)
    token_file: str = arg("", "File holding a bearer token that every request but GET /health must carry "
                              "(Authorization: Bearer ...; 401 otherwise). Never logged.")
