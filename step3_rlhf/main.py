"""Stage 3: RLHF with PPO over four DeepSpeed engines (actor, reference, critic, reward), or the GRPO family.

    python step3_rlhf/main.py --actor-model out/step1/model --reward-model out/step2/model --output-dir out/step3
    deepspeed --num_gpus 8 step3_rlhf/main.py --actor-zero-stage 3 --enable-hybrid-engine ...
    python step3_rlhf/main.py --algo grpo --actor-model out/step1/model --data prompts.jsonl \\
        --reward-funcs format --reward-funcs accuracy --loss-type dapo
    dschat train --step 3 ...        (the same flags)

Reads top to bottom: set up the models, evaluate, loop, evaluate, save. One step of the loop is PPO's (generate
experience -> PPO epochs over it) or GRPO's (G completions per prompt -> group advantages -> policy steps); both
share generation (the hybrid engine), rollouts, log-probs, scoring and evaluation.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from dschat import engine as E
from dschat import losses as L
from dschat.checkpoint import save_hf
from dschat.cli import run_command, stage_command
from dschat.config import DataArgs, EngineArgs, LoraArgs, OptimArgs, RunArgs, arg
from dschat.data import DataCollatorRLHF, DataCollatorSFT, load_phase
from dschat.data.phases import demo_files
from dschat.errors import UserError
from dschat.hybrid_engine import GenerationConfig, make_hybrid_engine
from dschat.judge import JUDGE, load_judge_reward
from dschat.lora import lora_param_groups
from dschat.models import create_causal_lm, create_reward_model, load_tokenizer, resolve_model
from dschat.resume import Checkpointer
from dschat.rewards import RM, MixedRewards, RewardMixer, get_reward_func, parse_weights
from dschat.rlhf import (
    Retokenizer,
    Rollout,
    answer_logprobs,
    answer_values,
    make_rollout,
    reward_scores,
    same_tokenizer,
)
from dschat.stage import (
    EpochStream,
    Interrupted,
    begin_stage,
    check_finite,
    eval_loader,
    lockstep_batches,
    stop_after_step,
    to_device,
    train_loader,
)
from dschat.tracking import RunTracker, write_eval

TINY_PARAMS = 50_000_000  # below this, a model is a from-scratch toy and takes toy-sized learning rates
DAPO_EPS_HIGH = 0.28  # DAPO's clip-higher (Yu et al. 2025, sec. 3.1)


@dataclass
class RLModelArgs:
    actor_model: str = arg("", "Actor initialisation: a step-1 output (…/model) or any model name ('--model' "
                               "works too, as in the other stages).", aliases=("model",))
    reward_model: str = arg("", "Reward model: a step-2 output (…/model). Required for PPO; optional for GRPO "
                                "(the reward function 'rm').")
    critic_model: str = arg("", "Critic initialisation (default: the reward model). PPO only.")
    judge_model: str = arg("", "Generative judge (RM-R1) of the reward function 'judge' (GRPO only): a causal LM, "
                               "e.g. a `dschat pipeline judge` output. It compares each completion with the row's "
                               "reference answer in both orders (+1 better, -1 worse, 0 unparseable; averaged).")
    judge_max_new_tokens: int = arg(128, "Longest completion of the judge of the reward function 'judge'.")
    dtype: str = arg("auto", "Parameter dtype; auto = fp32 on CPU, bf16 (else fp16) on CUDA.",
                     choices=("auto", "fp32", "bf16", "fp16"))
    trust_remote_code: bool = arg(False, "Allow model code shipped with the checkpoints.")
    actor_gradient_checkpointing: bool = arg(False, "Gradient checkpointing for the actor.")
    critic_gradient_checkpointing: bool = arg(False, "Gradient checkpointing for the critic.")
    actor_dropout: float | None = arg(0.0, "Actor dropout (0 keeps train-mode and eval-mode log-probs equal).")
    critic_dropout: float | None = arg(0.0, "Critic dropout.")
    enable_hybrid_engine: bool = arg(False, "Use DeepSpeed's hybrid engine for generation where it is supported "
                                            "(CUDA); otherwise the eval-mode KV-cache fallback is used.")


@dataclass
class RLEngineArgs:
    actor_zero_stage: int = arg(0, "ZeRO stage of the actor (the reference follows unless set).")
    critic_zero_stage: int = arg(0, "ZeRO stage of the critic (the reward model follows unless set).")
    reference_zero_stage: int | None = arg(None, "ZeRO stage of the frozen reference (default: the actor's).")
    reward_zero_stage: int | None = arg(None, "ZeRO stage of the frozen reward model (default: the critic's).")
    offload: bool = arg(False, "Offload actor and critic optimizer state (ZeRO >= 1) to CPU memory.")
    offload_reference_model: bool = arg(False, "Keep the reference model in CPU memory.")
    offload_reward_model: bool = arg(False, "Keep the reward model in CPU memory.")
    enable_ema: bool = arg(False, "Keep an exponential moving average of the actor's weights (saved to actor_ema/).")
    ema_decay: float = arg(0.992, "EMA decay per actor optimizer step.")


@dataclass
class PPOArgs:
    algo: str = arg("ppo", "RL algorithm: ppo (actor, critic, reference and reward model; SPEC 5) or grpo (the "
                           "GRPO family: G completions per prompt, group-relative advantages, no critic; SPEC 6).",
                    choices=("ppo", "grpo"))
    per_device_generation_batch_size: int = arg(8, "Prompts per device per generation batch (GRPO: prompts per "
                                                   "step, each with --num-generations completions).")
    per_device_training_batch_size: int = arg(8, "Experience rows (GRPO: completions) per device per micro-batch.")
    per_device_eval_batch_size: int = arg(16, "Prompts per device per evaluation batch.")
    generation_batches: int = arg(1, "Generation batches collected before each PPO update (PPO only).")
    ppo_epochs: int = arg(1, "Passes over each batch of experience (PPO; GRPO uses --num-iterations).")
    num_train_epochs: int = arg(1, "Passes over the prompts.")
    max_steps: int = arg(-1, "PPO/GRPO updates to run; overrides --num-train-epochs, as in the other stages (-1: "
                             "run all epochs).")
    gradient_accumulation_steps: int = arg(1, "Micro-batches per optimizer step.")
    actor_learning_rate: float | None = arg(None, "Actor learning rate (default 1e-4 for tiny models, else 1e-6).")
    critic_learning_rate: float | None = arg(None, "Critic learning rate (default 5e-4 for tiny models, else 5e-6).")
    actor_weight_decay: float = arg(0.0, "Actor AdamW weight decay.")
    critic_weight_decay: float = arg(0.0, "Critic AdamW weight decay.")
    lr_scheduler_type: str = arg("cosine", "Schedule after warmup.", choices=("cosine", "linear", "constant"))
    num_warmup_steps: int = arg(0, "Warmup optimizer steps.")
    max_grad_norm: float = arg(1.0, "Gradient clipping norm (0 disables).")
    max_answer_seq_len: int = arg(256, "Longest generated answer in tokens.")
    min_answer_len: int = arg(2, "Answers shorter than this many tokens (EOS included) get no gradient and are "
                                 "counted as dropped (SPEC 5.1).")
    temperature: float = arg(1.0, "Sampling temperature.")
    top_p: float = arg(1.0, "Nucleus sampling threshold.")
    top_k: int = arg(0, "Top-k sampling (0 disables).")
    kl_ctl: float = arg(0.1, "KL penalty coefficient in the per-token reward (PPO; GRPO uses --beta).")
    kl_target: float | None = arg(None, "Target KL for the adaptive controller (Ziegler et al. 2019); "
                                        "unset keeps kl_ctl fixed.")
    kl_horizon: int = arg(10000, "Horizon of the adaptive KL controller.")
    clip_reward_value: float = arg(5.0, "Reward scores are clipped to [-c, c].")
    cliprange: float = arg(0.2, "PPO policy ratio clip (GRPO: --epsilon, --epsilon-high).")
    cliprange_value: float = arg(0.2, "Critic value clip.")
    gamma: float = arg(1.0, "Discount.")
    lam: float = arg(0.95, "GAE lambda.")
    whiten_advantages: bool = arg(True, "Whiten advantages over the answer tokens of each experience batch.")
    normalize_reward: bool = arg(False, "Normalise scores by the reward model's eval mean/std (from its config).")
    missing_eos_penalty: float | None = arg(None, "Subtracted from the score of answers that never reached EOS.")
    unsup_data: list[str] = arg(help="SFT-format data for the mixed pretraining loss (repeatable; PPO only).",
                                factory=list)
    unsup_coef: float = arg(27.8, "Weight of the mixed pretraining loss.")


@dataclass
class GRPOArgs:
    num_generations: int = arg(4, "Completions per prompt (G, one group) with --algo grpo.")
    num_iterations: int = arg(1, "Policy passes over each generation (mu); > 1 caches the old log-probs.")
    beta: float = arg(0.04, "KL coefficient to the reference; 0 loads no reference model.")
    kl_estimator: str = arg("k3", "Estimator of KL(policy || reference) in the loss (Schulman 2020).",
                            choices=("k1", "k2", "k3"))
    epsilon: float = arg(0.2, "Lower ratio clip: clip(ratio, 1 - epsilon, 1 + epsilon_high).")
    epsilon_high: float | None = arg(None, f"Upper ratio clip (default: --epsilon; {DAPO_EPS_HIGH} with "
                                           "--loss-type dapo, DAPO's clip-higher).")
    scale_rewards: str = arg("group", "Advantage scale: reward minus group mean, divided by the group's std, the "
                                      "batch's std, or nothing (Dr. GRPO).", choices=("group", "batch", "none"))
    loss_type: str = arg("grpo", "Loss aggregation: grpo (per-sequence token mean), dr_grpo (sum / (batch * max "
                                 "length)), dapo (token mean over the batch; clip-higher, dynamic sampling), gspo "
                                 "(sequence-level ratio).", choices=("grpo", "dr_grpo", "dapo", "gspo"))
    dynamic_sampling: bool | None = arg(None, "Drop groups whose rewards are all equal and generate more prompts to "
                                              "refill the batch (DAPO). Default: on with --loss-type dapo only.")
    max_resample_rounds: int = arg(3, "Extra generation rounds per step to refill dropped groups (dynamic "
                                      "sampling); the step trains on what it has after them.")
    mask_truncated_completions: bool = arg(False, "Completions that never reached EOS get a zero action mask.")
    overlong_buffer: int | None = arg(None, "Reward 'overlong': the penalty falls from 0 at max_answer_seq_len - "
                                            "buffer to -overlong_factor at max_answer_seq_len (default: a quarter "
                                            "of --max-answer-seq-len).")
    overlong_factor: float = arg(1.0, "Reward 'overlong': the penalty at max_answer_seq_len.")
    overlong_penalty: bool | None = arg(None, "Add the reward 'overlong' (DAPO's soft overlong punishment, weight "
                                              "1) to the reward functions. Default: on with --loss-type dapo only.")
    reward_funcs: list[str] = arg(help="Reward source (repeatable): rm (the reward model's end score), format, "
                                       "accuracy, judge_match, overlong, judge (a generative judge, --judge-model), "
                                       "or path/to/file.py:function. Default: rm "
                                       "with --reward-model, else format and accuracy.", factory=list)
    reward_weights: list[str] = arg(help="Weight of each --reward-funcs entry, in order (repeatable floats; "
                                         "default 1 each).", factory=list)


@dataclass
class RLLoraArgs:
    """LoRA per trained model (SPEC: ``--actor-lora-dim``, ``--critic-lora-dim``, ...); ``LoraArgs`` of one model
    comes from ``lora_of``. The frozen reference and reward models never get adapters."""

    actor_lora_dim: int = arg(0, "Actor LoRA rank (0: train the full actor).")
    actor_lora_alpha: float = arg(16.0, "Actor LoRA scaling numerator (update = B @ A * alpha / r).")
    actor_lora_dropout: float = arg(0.0, "Dropout on the actor's LoRA branch input.")
    actor_lora_module_name: str = arg("all-linear", "Actor layers that get adapters: 'all-linear' or "
                                                    "comma-separated module-name substrings, e.g. 'q_proj,v_proj'.")
    actor_only_optimize_lora: bool = arg(True, "Train only the actor's adapters (false: the base weights too).")
    actor_lora_learning_rate: float | None = arg(None, "Learning rate of the actor's adapters (default: "
                                                       "--actor-learning-rate).")
    critic_lora_dim: int = arg(0, "Critic LoRA rank (0: train the full critic). PPO only.")
    critic_lora_alpha: float = arg(16.0, "Critic LoRA scaling numerator.")
    critic_lora_dropout: float = arg(0.0, "Dropout on the critic's LoRA branch input.")
    critic_lora_module_name: str = arg("all-linear", "Critic layers that get adapters (as for the actor; never "
                                                     "the v_head, which always trains).")
    critic_only_optimize_lora: bool = arg(True, "Train only the critic's adapters and v_head.")
    critic_lora_learning_rate: float | None = arg(None, "Learning rate of the critic's adapters (default: "
                                                        "--critic-learning-rate).")
    save_adapter: bool = arg(False, "Also save each LoRA model's unmerged PEFT adapter in its folder's adapter/.")


def lora_of(la: RLLoraArgs, who: str) -> LoraArgs:
    """The ``LoraArgs`` of ``who`` ('actor' or 'critic') from its prefixed flags."""
    return LoraArgs(**{f.name: getattr(la, f"{who}_{f.name}") for f in fields(LoraArgs) if f.name != "save_adapter"},
                    save_adapter=la.save_adapter)


@dataclass
class RLHFConfig:
    models: RLModelArgs = field(default_factory=RLModelArgs)
    engines: RLEngineArgs = field(default_factory=RLEngineArgs)
    lora: RLLoraArgs = field(default_factory=RLLoraArgs)
    ppo: PPOArgs = field(default_factory=PPOArgs)
    grpo: GRPOArgs = field(default_factory=GRPOArgs)
    data: DataArgs = field(default_factory=DataArgs)
    run: RunArgs = field(default_factory=RunArgs)


def reward_func_names(cfg: RLHFConfig) -> list[str]:
    """The reward sources of a GRPO run: --reward-funcs, else rm with a reward model, else format + accuracy;
    plus 'overlong' with --overlong-penalty (default with dapo, whose recipe includes it; SPEC 6)."""
    g = cfg.grpo
    if cfg.ppo.algo == "ppo":  # PPO scores with its reward model unless told otherwise
        return list(g.reward_funcs) or [RM]
    names = list(g.reward_funcs) or ([RM] if cfg.models.reward_model else ["format", "accuracy"])
    if overlong_penalty_of(g) and "overlong" not in names:
        names.append("overlong")
    return names


def overlong_penalty_of(g: GRPOArgs) -> bool:
    return g.overlong_penalty if g.overlong_penalty is not None else g.loss_type == "dapo"


def reward_weights_of(g: GRPOArgs, names: list[str]) -> list[float]:
    """--reward-weights, with weight 1 for an 'overlong' that --overlong-penalty added after them."""
    weights = parse_weights(g.reward_weights)
    if weights and len(weights) == len(names) - 1 and names[-1] == "overlong" and "overlong" not in g.reward_funcs:
        weights.append(1.0)
    return weights


def eps_high_of(g: GRPOArgs) -> float:
    if g.epsilon_high is not None:
        return g.epsilon_high
    return DAPO_EPS_HIGH if g.loss_type == "dapo" else g.epsilon


def dynamic_sampling_of(g: GRPOArgs) -> bool:
    return g.dynamic_sampling if g.dynamic_sampling is not None else g.loss_type == "dapo"


def check_config(cfg: RLHFConfig) -> None:
    """Stop before any model loads on flag combinations that cannot work."""
    p, g = cfg.ppo, cfg.grpo
    if not cfg.models.actor_model:
        raise UserError("stage 3 needs --actor-model (a step-1 output)")
    if JUDGE in reward_func_names(cfg) and not cfg.models.judge_model:
        raise UserError("reward function 'judge' needs --judge-model (a trained generative judge)")
    if p.algo == "ppo":
        if not cfg.models.reward_model and not (g.reward_funcs and cfg.models.critic_model):
            raise UserError("stage 3 with --algo ppo needs --actor-model (a step-1 output) and --reward-model (a "
                            "step-2 output), or --reward-funcs without 'rm' and a --critic-model")
        if RM in reward_func_names(cfg) and not cfg.models.reward_model:
            raise UserError("reward function 'rm' needs --reward-model (a step-2 output)")
        return
    if g.num_generations < 2:
        raise UserError("--num-generations must be >= 2: GRPO's advantage compares completions of one prompt")
    if g.num_iterations < 1 or g.max_resample_rounds < 0:
        raise UserError("--num-iterations must be >= 1 and --max-resample-rounds >= 0")
    if RM in reward_func_names(cfg) and not cfg.models.reward_model:
        raise UserError("reward function 'rm' needs --reward-model (a step-2 output)")
    if p.unsup_data:
        raise UserError("--unsup-data (the mixed pretraining loss) is PPO-only")
    if p.generation_batches != 1:
        raise UserError("--generation-batches is PPO-only; with --algo grpo raise --per-device-generation-batch-size")


def check_reward_data(names: list[str], rows: list[dict[str, Any]]) -> None:
    """Rules that compare with a ground truth stop before any model loads when prompts have none."""
    missing = sum(r.get("answer") is None for r in rows)
    for name in ("accuracy", "judge_match", JUDGE):
        if name in names and missing:
            raise UserError(f"reward '{name}' needs a ground truth, but {missing} of {len(rows)} prompts have none; "
                            "pass prompt-only rows with an 'answer' (or judge rows with a 'winner') via --data")


# ------------------------------------------------------------------------------------------------- models
@dataclass
class Models:
    actor: Any  # training engine
    ref: Any | None  # frozen (engine under ZeRO-3, else module); None for GRPO with beta 0
    critic: Any | None  # training engine; PPO only
    reward: Any | None  # frozen; None when no reward source needs it
    tokenizer: Any
    reward_tokenizer: Any | None
    reward_stats: tuple[float, float] | None


def _lr(given: float | None, n_params: int, tiny: float, real: float) -> float:
    if given is not None:
        return given
    return tiny if n_params < TINY_PARAMS else real


def _optim(p: PPOArgs, who: str, lr: float) -> OptimArgs:
    """The optimizer settings of ``who`` ('actor' or 'critic'): its own rate and weight decay, shared rest."""
    return OptimArgs(learning_rate=lr, weight_decay=getattr(p, f"{who}_weight_decay"),
                     lr_scheduler_type=p.lr_scheduler_type, num_warmup_steps=p.num_warmup_steps,
                     max_grad_norm=p.max_grad_norm, per_device_train_batch_size=p.per_device_training_batch_size,
                     gradient_accumulation_steps=p.gradient_accumulation_steps)


def build_models(cfg: RLHFConfig, total_steps: int) -> Models:
    """The engines the algorithm needs: PPO all four; GRPO the actor, the reference only when beta > 0 and the
    reward model only when 'rm' is a reward source (no critic)."""
    m, e, p = cfg.models, cfg.engines, cfg.ppo
    ppo = p.algo == "ppo"
    need_ref = ppo or cfg.grpo.beta != 0.0
    need_reward = RM in reward_func_names(cfg)
    actor_path = resolve_model(m.actor_model)
    reward_path = resolve_model(m.reward_model) if need_reward else ""
    tok = load_tokenizer(actor_path, m.trust_remote_code)
    rm_tok = load_tokenizer(reward_path, m.trust_remote_code) if need_reward else None
    critic_path = (resolve_model(m.critic_model) if m.critic_model else reward_path) if ppo else ""
    if ppo and not same_tokenizer(tok, load_tokenizer(critic_path, m.trust_remote_code)):
        raise UserError(f"the critic ({critic_path}) must share the actor's tokenizer; pass --critic-model with a "
                        "reward model (or the actor) trained on the actor's tokenizer")
    dtype = E.resolve_dtype(m.dtype)

    actor_lora = lora_of(cfg.lora, "actor")
    actor = create_causal_lm(actor_path, dtype, m.actor_dropout, m.actor_gradient_checkpointing, m.trust_remote_code,
                             lora=actor_lora)
    actor_lr = _lr(p.actor_learning_rate, sum(t.numel() for t in actor.parameters()), 1e-4, 1e-6)
    # DeepSpeed's hybrid engine fuses its own LoRA layers, not PEFT's: with actor LoRA the fallback generates.
    hybrid = {"max_out_tokens": cfg.data.max_prompt_seq_len + p.max_answer_seq_len} if m.enable_hybrid_engine \
        and torch.cuda.is_available() and not actor_lora.lora_dim else None
    actor_engine = E.build_train_engine(actor, engine=EngineArgs(e.actor_zero_stage, e.offload),
                                        optim=_optim(p, "actor", actor_lr), dtype=dtype, total_steps=total_steps,
                                        hybrid_engine=hybrid, param_groups=lora_param_groups(
                                            actor, p.actor_weight_decay, actor_lr, actor_lora.lora_learning_rate))
    ref_engine = None
    if need_ref:
        ref = create_causal_lm(actor_path, dtype, m.actor_dropout, False, m.trust_remote_code)
        ref_stage = e.reference_zero_stage if e.reference_zero_stage is not None else e.actor_zero_stage
        ref_engine = E.build_eval_engine(ref, zero_stage=ref_stage, offload=e.offload_reference_model, dtype=dtype)

    critic_engine = None
    if ppo:
        critic_lora = lora_of(cfg.lora, "critic")
        critic = create_reward_model(critic_path, dtype, m.critic_dropout, m.critic_gradient_checkpointing,
                                     tok.pad_token_id, m.trust_remote_code, lora=critic_lora)
        critic_lr = _lr(p.critic_learning_rate, sum(t.numel() for t in critic.parameters()), 5e-4, 5e-6)
        critic_engine = E.build_train_engine(critic, engine=EngineArgs(e.critic_zero_stage, e.offload),
                                             optim=_optim(p, "critic", critic_lr), dtype=dtype,
                                             total_steps=total_steps, param_groups=lora_param_groups(
                                                 critic, p.critic_weight_decay, critic_lr,
                                                 critic_lora.lora_learning_rate))
    reward_engine, stats = None, None
    if need_reward:
        assert rm_tok is not None
        reward = create_reward_model(reward_path, dtype, 0.0, False, rm_tok.pad_token_id, m.trust_remote_code)
        if getattr(reward.config, "reward_mean", None) is not None:
            stats = (float(reward.config.reward_mean), float(getattr(reward.config, "reward_std", 1.0) or 1.0))
        rw_stage = e.reward_zero_stage if e.reward_zero_stage is not None else e.critic_zero_stage
        reward_engine = E.build_eval_engine(reward, zero_stage=rw_stage, offload=e.offload_reward_model,
                                            dtype=dtype)
    return Models(actor_engine, ref_engine, critic_engine, reward_engine, tok, rm_tok, stats)


# ------------------------------------------------------------------------------------------ shared machinery
def generate_rollout(models: Models, hybrid: Any, batch: dict[str, Any], gen: GenerationConfig,
                     seed: int | None = None, min_answer_len: int = 2) -> tuple[Rollout, int]:
    """Sample answers for a batch of left-padded prompts and mask them (SPEC 5.1); every algorithm's rollouts
    and evaluation come from here."""
    seqs = hybrid.generate(batch["prompt"], batch["prompt_att_mask"], gen, generator_seed=seed)
    return make_rollout(batch["prompt"], batch["prompt_att_mask"], seqs, models.tokenizer.eos_token_id,
                        models.tokenizer.pad_token_id, min_answer_len=min_answer_len)


def completion_texts(tokenizer: Any, rollout: Rollout, prompt_mask: torch.Tensor) -> tuple[list[str], list[str],
                                                                                           list[int]]:
    """Decoded prompts and completions (special tokens dropped) and completion lengths in tokens, EOS included.

    Read from the sequences, not the action mask: a short or truncated answer whose mask was zeroed still has
    text for the rule rewards.
    """
    P = rollout.prompt_len
    answers = rollout.sequences[:, P:].cpu()
    is_eos = answers == tokenizer.eos_token_id
    first_eos = torch.where(is_eos.any(-1), is_eos.long().argmax(-1), torch.full_like(answers[:, 0],
                                                                                      answers.shape[1]))
    lengths = torch.where(is_eos.any(-1), first_eos + 1, first_eos).tolist()
    prompts = tokenizer.batch_decode([row[m.bool()] for row, m in zip(rollout.sequences[:, :P].cpu(),
                                                                       prompt_mask.cpu(), strict=True)],
                                     skip_special_tokens=True)
    completions = tokenizer.batch_decode([row[:n] for row, n in zip(answers, first_eos.tolist(), strict=True)],
                                         skip_special_tokens=True)
    return prompts, completions, lengths


def row_fields(batch: dict[str, Any]) -> dict[str, list[Any]]:
    """The reward functions' ``row_fields`` (dschat.rewards): ``answer`` plus every other field of the rows."""
    extras: list[dict[str, Any]] = batch.get("extra") or [{} for _ in batch["answer"]]
    reserved = {"answer", "prompts", "completions", "completion_lengths", "external"}
    names = sorted({k for e in extras for k in e} - reserved)
    fields = {k: [e.get(k) for e in extras] for k in names}
    fields["answer"] = list(batch["answer"])
    return fields


class Scorer:
    """What a rollout earns under the run's reward sources: the mixer over rule functions and, for ``rm``, the
    reward model's end score (re-tokenized for it when its tokenizer differs; SPEC 5)."""

    def __init__(self, mixer: RewardMixer, models: Models, retok: Retokenizer | None):
        self.mixer, self.models, self.retok = mixer, models, retok
        self.needs_text = any(n != RM for n in mixer.names)

    @torch.no_grad()
    def __call__(self, rollout: Rollout, batch: dict[str, Any]) -> MixedRewards:
        external: dict[str, torch.Tensor] = {}
        if RM in self.mixer.names:
            external[RM] = reward_scores(self.models.reward, rollout, self.retok).float().cpu()
        if not self.needs_text:  # rm only (PPO): no decoding
            n = rollout.sequences.shape[0]
            return self.mixer([""] * n, [""] * n, external=external)
        prompts, completions, lengths = completion_texts(self.models.tokenizer, rollout, batch["prompt_att_mask"])
        return self.mixer(prompts, completions, external=external, completion_lengths=lengths, **row_fields(batch))


def build_scorer(cfg: RLHFConfig, models: Models, retok: Retokenizer | None) -> Scorer:
    g = cfg.grpo
    names = reward_func_names(cfg)
    funcs = {n: get_reward_func(n, cfg.ppo.max_answer_seq_len, g.overlong_buffer, g.overlong_factor) for n in names
             if n != JUDGE}
    if JUDGE in names:  # a model, not a rule: loaded here, on this rank's device, with the run's rubric
        m = cfg.models
        funcs[JUDGE] = load_judge_reward(m.judge_model, m.judge_max_new_tokens, cfg.data.judge_system_prompt, m.dtype,
                                         m.trust_remote_code)
    return Scorer(RewardMixer(names, reward_weights_of(g, names), funcs), models, retok)


def _pad_right(t: torch.Tensor, width: int, value: float = 0.0) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)


def concat_rollouts(parts: list[Rollout], pad_token_id: int) -> Rollout:
    """Stack rollouts whose prompt/answer widths differ (prompts padded left, answers right)."""
    if len(parts) == 1:
        return parts[0]
    P = max(r.prompt_len for r in parts)
    A = max(r.action_mask.shape[1] for r in parts)
    seq, mask, amask = [], [], []
    for r in parts:
        lp, ra = P - r.prompt_len, A - r.action_mask.shape[1]
        seq.append(torch.nn.functional.pad(r.sequences, (lp, ra), value=pad_token_id))
        mask.append(torch.nn.functional.pad(r.attention_mask, (lp, ra), value=0))
        amask.append(_pad_right(r.action_mask, A, 0))
    return Rollout(torch.cat(seq), torch.cat(mask), torch.cat(amask), P, torch.cat([r.reached_eos for r in parts]))


# --------------------------------------------------------------------------------------------- experience
@dataclass
class Experience:
    rollout: Rollout
    old_logprobs: torch.Tensor  # (B, A)
    ref_logprobs: torch.Tensor  # (B, A)
    old_values: torch.Tensor  # (B, A)
    scores: torch.Tensor  # (B,) after penalties / normalisation, before clipping
    raw_scores: torch.Tensor  # (B,) the reward model's own end scores
    rewards: torch.Tensor  # (B, A)
    advantages: torch.Tensor  # (B, A)
    returns: torch.Tensor  # (B, A)

    def minibatches(self, size: int, generator: torch.Generator) -> list[Experience]:
        order = torch.randperm(self.rollout.sequences.shape[0], generator=generator)
        out = []
        for i in range(0, len(order), size):
            idx = order[i: i + size]
            out.append(Experience(self.rollout.select(idx), *(getattr(self, f)[idx] for f in (
                "old_logprobs", "ref_logprobs", "old_values", "scores", "raw_scores", "rewards", "advantages",
                "returns"))))
        return out


def score_rollout(models: Models, rollout: Rollout, p: PPOArgs, scorer: Scorer,
                  batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's end score of each answer: the reward sources' weighted sum (the reward model alone by default), then
    optionally normalised by the reward model's statistics and penalised when EOS was never reached."""
    raw = scorer(rollout, batch).total.to(rollout.sequences.device)
    score = raw.clone()
    if p.normalize_reward and models.reward_stats is not None:
        mean, std = models.reward_stats
        score = (score - mean) / max(std, 1e-6)
    if p.missing_eos_penalty:
        score = score - p.missing_eos_penalty * (~rollout.reached_eos).float()
    return raw, score


@torch.no_grad()
def make_experience(models: Models, hybrid: Any, batch: dict[str, Any], p: PPOArgs, gen: GenerationConfig,
                    kl_ctl: float, scorer: Scorer) -> tuple[Experience, int]:
    rollout, dropped = generate_rollout(models, hybrid, batch, gen, min_answer_len=p.min_answer_len)
    # Old log-probs, reference log-probs and values in eval mode (no dropout), once per experience batch.
    models.actor.eval()
    models.critic.eval()
    old_logprobs = answer_logprobs(models.actor, rollout, p.temperature)
    ref_logprobs = answer_logprobs(models.ref, rollout, p.temperature)
    old_values = answer_values(models.critic, rollout).float()
    raw, score = score_rollout(models, rollout, p, scorer, batch)
    models.actor.train()
    models.critic.train()
    mask = rollout.action_mask
    rewards = L.kl_penalized_rewards(old_logprobs, ref_logprobs, score, mask, kl_ctl, p.clip_reward_value)
    adv, returns = L.gae(old_values, rewards, mask, p.gamma, p.lam)
    if p.whiten_advantages and mask.sum() > 1:
        adv = L.whiten(adv, mask)
    return Experience(rollout, old_logprobs, ref_logprobs, old_values, score, raw, rewards, adv, returns), dropped


def concat_experience(parts: list[Experience], pad_token_id: int) -> Experience:
    """Stack experience batches whose prompt/answer widths differ (pad prompts left, answers right)."""
    if len(parts) == 1:
        return parts[0]
    rollout = concat_rollouts([x.rollout for x in parts], pad_token_id)
    A = rollout.action_mask.shape[1]

    def cat(name: str) -> torch.Tensor:
        return torch.cat([_pad_right(getattr(x, name), A) for x in parts])

    return Experience(rollout, cat("old_logprobs"), cat("ref_logprobs"), cat("old_values"),
                      torch.cat([x.scores for x in parts]), torch.cat([x.raw_scores for x in parts]), cat("rewards"),
                      cat("advantages"), cat("returns"))



def ppo_step(models: Models, hybrid: Any, stream: Iterator[dict[str, Any]], p: PPOArgs, gen: GenerationConfig,
             kl_ctl: Any, scorer: Scorer, shuffle: torch.Generator, unsup: Any, ema: ActorEMA | None,
             rows_per_update: int) -> tuple[dict[str, float], int]:
    """One PPO update: ``generation_batches`` experience batches -> ``ppo_update``. Returns the step's metrics and
    the short answers dropped."""
    pending, dropped = [], 0
    for _ in range(p.generation_batches):
        t0 = time.time()
        batch = to_device(next(stream), E.device())
        exp, d = make_experience(models, hybrid, batch, p, gen, kl_ctl.value, scorer)
        dropped += d
        pending.append((exp, hybrid.last_generate_seconds, time.time() - t0))
    exp = concat_experience([x[0] for x in pending], models.tokenizer.pad_token_id)
    gen_time = sum(x[1] for x in pending)
    exp_time = sum(x[2] for x in pending)
    t1 = time.time()
    stats = ppo_update(models, exp, p, shuffle, unsup, ema)
    train_time = time.time() - t1
    mask = exp.rollout.action_mask.float()
    seq_kl = ((exp.old_logprobs - exp.ref_logprobs) * mask).sum(-1)
    local = torch.stack([exp.raw_scores.float().mean(), seq_kl.mean(), L.masked_mean(exp.returns, mask),
                         mask.sum(-1).mean(), exp.rollout.reached_eos.float().mean()]).cpu()
    reward, kl, ret, length, eos_rate = E.all_reduce_mean(local).tolist()
    tokens = E.all_reduce_sum(mask.sum().cpu()).item()
    kl_ctl.update(kl, rows_per_update * E.world_size())
    return {"train/reward": reward, "train/kl": kl, "train/kl_ctl": kl_ctl.value, "train/return": ret,
            "train/answer_length": length, "train/eos_rate": eos_rate, **stats,
            "time/generation_s": gen_time, "time/experience_s": exp_time - gen_time,
            "time/training_s": train_time,
            "time/tokens_per_s": tokens / max(exp_time + train_time, 1e-9)}, dropped


def ppo_update(models: Models, exp: Experience, p: PPOArgs, shuffle: torch.Generator, unsup: Any,
               ema: ActorEMA | None) -> dict[str, float]:
    """``ppo_epochs`` passes of clipped-surrogate actor steps and clipped-value critic steps over ``exp``."""
    sums: dict[str, float] = {}
    n = 0
    for _ in range(p.ppo_epochs):
        for mb in exp.minibatches(p.per_device_training_batch_size, shuffle):
            mask = mb.rollout.action_mask
            logprobs = answer_logprobs(models.actor, mb.rollout, p.temperature)
            actor = L.ppo_policy_loss(logprobs, mb.old_logprobs, mb.advantages, mask, p.cliprange)
            steps_before = models.actor.global_steps
            models.actor.backward(actor.loss)
            models.actor.step()
            if unsup is not None:
                batch = to_device(next(unsup), E.device())
                lm_loss = models.actor(**batch, use_cache=False).loss
                models.actor.backward(p.unsup_coef * lm_loss)
                models.actor.step()
                sums["train/unsup_loss"] = sums.get("train/unsup_loss", 0.0) + lm_loss.item()
            if ema is not None and models.actor.global_steps != steps_before:
                ema.update(models.actor)
            values = answer_values(models.critic, mb.rollout)
            critic = L.ppo_value_loss(values, mb.old_values, mb.returns, mask, p.cliprange_value)
            models.critic.backward(critic.loss)
            models.critic.step()
            for key, value in (("train/actor_loss", actor.loss), ("train/critic_loss", critic.loss),
                               ("train/actor_clip_frac", actor.clip_frac), ("train/critic_clip_frac",
                                                                            critic.clip_frac),
                               ("train/approx_kl_old_new", actor.approx_kl)):
                sums[key] = sums.get(key, 0.0) + float(value.item())
            n += 1
    local = torch.tensor([sums[k] / max(n, 1) for k in sorted(sums)])
    return dict(zip(sorted(sums), E.all_reduce_mean(local).tolist(), strict=True))


# ------------------------------------------------------------------------------------------------ GRPO groups
@dataclass
class GroupBatch:
    """One GRPO step's completions, ``num_generations`` consecutive ones per prompt (SPEC 6)."""

    rollout: Rollout
    rewards: torch.Tensor  # (N,) mixed rewards
    advantages: torch.Tensor  # (N,) group-relative, one per completion
    old_logprobs: torch.Tensor | None  # (N, A); None: no optimizer step since generation, old = logprobs.detach()
    ref_logprobs: torch.Tensor | None  # (N, A); None without a reference model (beta 0)

    def minibatches(self, size: int, generator: torch.Generator) -> list[GroupBatch]:
        order = torch.randperm(self.rewards.shape[0], generator=generator)
        out = []
        for i in range(0, len(order), size):
            idx = order[i: i + size]
            out.append(GroupBatch(self.rollout.select(idx), self.rewards[idx], self.advantages[idx],
                                  None if self.old_logprobs is None else self.old_logprobs[idx],
                                  None if self.ref_logprobs is None else self.ref_logprobs[idx]))
        return out


def repeat_prompts(batch: dict[str, Any], n: int) -> dict[str, Any]:
    """Every prompt (and its row fields) ``n`` times in a row, so the completions of a prompt are consecutive:
    the layout ``L.group_advantages`` and ``L.dynamic_sampling_mask`` expect."""
    out = {"prompt": batch["prompt"].repeat_interleave(n, 0),
           "prompt_att_mask": batch["prompt_att_mask"].repeat_interleave(n, 0)}
    for key in ("answer", "extra"):
        if key in batch:
            out[key] = [x for x in batch[key] for _ in range(n)]
    return out


def select_groups(rewards: torch.Tensor, num_generations: int, dynamic: bool, room: int) -> torch.Tensor:
    """Row indices of the groups to train on, whole groups in order: with dynamic sampling only the groups whose
    rewards are not all equal (DAPO, Yu et al. 2025: an all-equal group has zero advantage, so no gradient),
    and at most ``room`` groups.

    Args:
        rewards: ``(N,)``, ``num_generations`` consecutive completions per prompt.

    Returns:
        ``(M,)`` int64 row indices, ``M`` a multiple of ``num_generations``.
    """
    keep = L.dynamic_sampling_mask(rewards, num_generations) if dynamic else torch.ones_like(rewards, dtype=torch.bool)
    groups = keep.view(-1, num_generations)[:, 0].nonzero().squeeze(1)[: max(room, 0)]  # (M / G,)
    return (groups.unsqueeze(1) * num_generations + torch.arange(num_generations)).flatten()


def mask_truncated(rollout: Rollout) -> Rollout:
    """Zero the action mask of answers that never reached EOS: a cut-off answer is not wrong for being cut off,
    so it leaves the loss instead of being pushed down (DAPO, Yu et al. 2025). Its reward still counts in its
    group's statistics."""
    keep = rollout.reached_eos.unsqueeze(1).to(rollout.action_mask)  # (B, 1)
    return Rollout(rollout.sequences, rollout.attention_mask, rollout.action_mask * keep, rollout.prompt_len,
                   rollout.reached_eos)


def needs_old_logprobs(num_iterations: int, n_micro: int, grad_accum: int, micro_offset: int) -> bool:
    """Whether an optimizer step falls between a generation and the last micro-batch that trains on it.

    If none does, the policy that generated is the policy being trained, so ``old = logprobs.detach()`` is exact
    and saves a forward pass (SPEC 6, mu = 1). Otherwise (mu > 1, or the generation spans several optimizer
    steps) the old log-probs are computed once after generation. ``micro_offset``: micro-batches already
    accumulated towards the next optimizer step.
    """
    return micro_offset + num_iterations * n_micro > grad_accum


@torch.no_grad()
def make_groups(models: Models, hybrid: Any, scorer: Scorer, stream: Iterator[dict[str, Any]], g: GRPOArgs,
                p: PPOArgs, gen: GenerationConfig) -> tuple[GroupBatch | None, dict[str, float], int]:
    """Generate ``num_generations`` completions per prompt of the next batch, score them and compute group
    advantages. With dynamic sampling, groups whose rewards are all equal (no gradient) are dropped and further
    prompt batches are generated to refill, at most ``max_resample_rounds`` extra rounds; then every rank keeps
    the same number of groups, so all ranks run the same number of micro-batches (ZeRO collectives).

    Returns the batch (None when no group is left), stats over every generated completion, and the number of
    answers dropped as too short.
    """
    G, dev, target = g.num_generations, E.device(), p.per_device_generation_batch_size
    dynamic = dynamic_sampling_of(g)
    kept: list[tuple[Rollout, torch.Tensor]] = []
    seen: dict[str, list[torch.Tensor]] = {"reward": [], "length": [], "eos": [], "group_std": [],
                                           **{f"reward/{n}": [] for n in scorer.mixer.names}}
    n_kept, rounds, dropped, gen_time = 0, 0, 0, 0.0
    while True:
        batch = repeat_prompts(to_device(next(stream), dev), G)
        rollout, d = generate_rollout(models, hybrid, batch, gen, min_answer_len=p.min_answer_len)
        gen_time += hybrid.last_generate_seconds
        dropped += d
        seen["length"].append(rollout.answer_lengths.float().cpu())
        seen["eos"].append(rollout.reached_eos.float().cpu())
        if g.mask_truncated_completions:
            rollout = mask_truncated(rollout)
        mixed = scorer(rollout, batch)
        seen["reward"].append(mixed.total)
        seen["group_std"].append(mixed.total.view(-1, G).std(dim=1))
        for name, values in mixed.per_func.items():
            seen[f"reward/{name}"].append(values)
        idx = select_groups(mixed.total, G, dynamic, target - n_kept)
        if idx.numel():
            kept.append((rollout.select(idx.to(rollout.sequences.device)), mixed.total[idx]))
        n_kept += idx.numel() // G
        rounds += 1
        if not dynamic or rounds > g.max_resample_rounds:
            break
        # One decision for all ranks: generation under ZeRO-3 is a collective.
        if E.all_reduce_max(torch.tensor(float(target - n_kept))).item() <= 0:
            break
    n_groups = int(-E.all_reduce_max(torch.tensor(-float(n_kept))).item())  # the fewest on any rank

    cat = {k: torch.cat(v) for k, v in seen.items()}
    # reward_std is the mean within-group std (the spread GRPO learns from); a zero-std group gives no gradient.
    stats = {"train/reward": cat["reward"].mean().item(), "train/reward_std": cat["group_std"].mean().item(),
             "train/frac_reward_zero_std": (cat["group_std"] == 0).float().mean().item(),
             "train/answer_length": cat["length"].mean().item(), "train/eos_rate": cat["eos"].mean().item(),
             "train/groups_kept": float(n_groups), "train/resample_rounds": float(rounds - 1),
             "time/generation_s": gen_time, "tokens": cat["length"].sum().item(),
             **{f"train/{k}": cat[k].mean().item() for k in seen if k.startswith("reward/")}}
    if n_groups == 0:
        return None, stats, dropped

    rollout = concat_rollouts([r for r, _ in kept], models.tokenizer.pad_token_id)
    rewards = torch.cat([t for _, t in kept])
    rows = torch.arange(n_groups * G)
    rollout, rewards = rollout.select(rows.to(rollout.sequences.device)), rewards[rows]
    advantages = L.group_advantages(rewards, G, g.scale_rewards).to(dev)  # type: ignore[arg-type]
    n_micro = math.ceil(rows.numel() / p.per_device_training_batch_size)
    offset = getattr(models.actor, "micro_steps", 0) % p.gradient_accumulation_steps
    # Old and reference log-probs in eval mode (no dropout), once per generation.
    models.actor.eval()
    old = answer_logprobs(models.actor, rollout, p.temperature) \
        if needs_old_logprobs(g.num_iterations, n_micro, p.gradient_accumulation_steps, offset) else None
    ref = answer_logprobs(models.ref, rollout, p.temperature) if models.ref is not None else None
    models.actor.train()
    return GroupBatch(rollout, rewards.to(dev), advantages, old, ref), stats, dropped


def optimizer_step_normalizers(mbs: list[GroupBatch], loss_type: str, max_len: int, micro_steps: int,
                               grad_accum: int) -> list[float]:
    """Per micro-batch, the ``normalizer`` of ``L.grpo_policy_loss`` that makes each optimizer step's gradient the
    gradient of one loss over all of its micro-batches on all ranks (a token mean over the whole batch for dapo,
    Dr. GRPO's constant, a mean over every sequence for grpo/gspo) instead of a mean of micro-batch means.

    DeepSpeed divides each micro-batch loss by ``grad_accum`` and averages gradients over ranks, so the
    normaliser is the step's units (all-reduced) divided by ``grad_accum * world``. ``micro_steps``: micro-batches
    the engine has run, which places each micro-batch in its optimizer step; every rank runs the same number.
    (Micro-batches accumulated before this generation were normalised with their own generation's units.)
    """
    offset = micro_steps % grad_accum
    window = [(offset + i) // grad_accum for i in range(len(mbs))]
    units = torch.zeros(max(window, default=0) + 1)
    for mb, w in zip(mbs, window, strict=True):
        units[w] += float(L.grpo_loss_units(mb.rollout.action_mask, loss_type, max_len))  # type: ignore[arg-type]
    units = E.all_reduce_sum(units)
    scale = grad_accum * E.world_size()
    return [max(units[w].item(), 1.0) / scale for w in window]


def grpo_update(models: Models, batch: GroupBatch, g: GRPOArgs, p: PPOArgs, shuffle: torch.Generator,
                ema: ActorEMA | None) -> dict[str, float]:
    """``num_iterations`` passes of GRPO-family policy steps (``L.grpo_policy_loss``) over one generation."""
    eps_high = eps_high_of(g)
    sums: dict[str, float] = {}
    n = 0
    for _ in range(g.num_iterations):
        mbs = batch.minibatches(p.per_device_training_batch_size, shuffle)
        normalizers = optimizer_step_normalizers(mbs, g.loss_type, p.max_answer_seq_len,
                                                 models.actor.micro_steps, p.gradient_accumulation_steps)
        for mb, normalizer in zip(mbs, normalizers, strict=True):
            logprobs = answer_logprobs(models.actor, mb.rollout, p.temperature)
            old = mb.old_logprobs if mb.old_logprobs is not None else logprobs.detach()
            out = L.grpo_policy_loss(logprobs, old, mb.advantages, mb.rollout.action_mask, g.epsilon, eps_high,
                                     g.loss_type, ref_logprobs=mb.ref_logprobs,  # type: ignore[arg-type]
                                     beta=g.beta if mb.ref_logprobs is not None else 0.0,
                                     kl_estimator=g.kl_estimator,  # type: ignore[arg-type]
                                     max_completion_length=p.max_answer_seq_len, normalizer=normalizer)
            steps_before = models.actor.global_steps
            models.actor.backward(out.loss)
            models.actor.step()
            if ema is not None and models.actor.global_steps != steps_before:
                ema.update(models.actor)
            stats = {"train/actor_loss": out.loss, "train/clip_ratio_low": out.clip_ratio_low,
                     "train/clip_ratio_high": out.clip_ratio_high, "train/clip_ratio": out.clip_ratio}
            if mb.ref_logprobs is not None:
                stats["train/kl"] = out.kl
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + float(value.item())
            n += 1
    local = torch.tensor([sums[k] / max(n, 1) for k in sorted(sums)])
    return dict(zip(sorted(sums), E.all_reduce_mean(local).tolist(), strict=True))


def grpo_step(models: Models, hybrid: Any, scorer: Scorer, stream: Iterator[dict[str, Any]], g: GRPOArgs,
              p: PPOArgs, gen: GenerationConfig, shuffle: torch.Generator,
              ema: ActorEMA | None) -> tuple[dict[str, float], int]:
    """One GRPO update: groups -> policy steps. Returns the step's metrics and the short answers dropped."""
    t0 = time.time()
    batch, stats, dropped = make_groups(models, hybrid, scorer, stream, g, p, gen)
    exp_time = time.time() - t0
    t1 = time.time()
    train = grpo_update(models, batch, g, p, shuffle, ema) if batch is not None else {}
    train_time = time.time() - t1
    tokens = E.all_reduce_sum(torch.tensor(stats.pop("tokens"))).item()
    gen_time = stats.pop("time/generation_s")
    names = sorted(stats)
    reduced = dict(zip(names, E.all_reduce_mean(torch.tensor([stats[k] for k in names])).tolist(), strict=True))
    return {**reduced, **train, "time/generation_s": gen_time, "time/experience_s": exp_time - gen_time,
            "time/training_s": train_time, "time/tokens_per_s": tokens / max(exp_time + train_time, 1e-9)}, dropped


# ---------------------------------------------------------------------------------------------------- EMA
class ActorEMA:
    """An exponential moving average of the actor's full weights, kept on CPU (gathered under ZeRO-3)."""

    def __init__(self, actor: Any, decay: float):
        self.decay = decay
        self.state = E.full_state_dict(actor)

    @torch.no_grad()
    def update(self, actor: Any) -> None:
        current = E.full_state_dict(actor)
        for k, v in current.items():
            if v.is_floating_point():
                self.state[k].mul_(self.decay).add_(v, alpha=1.0 - self.decay)


# ------------------------------------------------------------------------------------------------- eval
@torch.no_grad()
def evaluate(models: Models, hybrid: Any, loader: Any, p: PPOArgs, gen: GenerationConfig, seed: int,
             scorer: Scorer) -> dict[str, Any]:
    """Mean reward (with its standard error) and the mean of each reward source, KL to the reference (when there
    is one) and answer length on held-out prompts, one completion per prompt.

    Sampling uses a fixed seed per batch, so before/after evaluations draw the same random numbers.
    """
    names = scorer.mixer.names
    cols: dict[str, list[float]] = {"scores": [], "kl": [], "length": [], "eos": [], **{n: [] for n in names}}
    models.actor.eval()
    # Lockstep: under ZeRO-3 the gather around generate and every forward are collectives on all ranks.
    for i, (batch, real) in enumerate(lockstep_batches(loader)):
        batch = to_device(batch, E.device())
        rollout, _ = generate_rollout(models, hybrid, batch, gen, seed=seed + i, min_answer_len=1)
        mask = rollout.action_mask.float()
        kl = None
        if models.ref is not None:
            logp = answer_logprobs(models.actor, rollout, p.temperature)
            ref = answer_logprobs(models.ref, rollout, p.temperature)
            kl = ((logp - ref) * mask).sum(-1)  # per-sequence KL estimate (k1 summed over tokens)
        mixed = scorer(rollout, batch)
        if not real:
            continue
        if kl is not None:
            cols["kl"] += kl.tolist()
        cols["scores"] += mixed.total.tolist()
        for name in names:
            cols[name] += mixed.per_func[name].tolist()
        cols["length"] += mask.sum(-1).tolist()
        cols["eos"] += rollout.reached_eos.float().tolist()
    models.actor.train()
    gathered = E.gather_objects(cols)
    t = {k: torch.tensor([v for part in gathered for v in part[k]]) for k in cols}

    def mean(x: torch.Tensor) -> float | None:
        return x.mean().item() if len(x) else None

    s = t["scores"]
    std = s.std().item() if len(s) > 1 else 0.0
    out: dict[str, Any] = {"scores": s.tolist(), "reward": mean(s), "reward_se": std / math.sqrt(max(len(s), 1)),
                           "reward_std": std, "kl": mean(t["kl"]), "answer_length": mean(t["length"]),
                           "eos_rate": mean(t["eos"]), "eval_prompts": len(s)}
    if names != [RM]:
        out.update({f"reward/{n}": mean(t[n]) for n in names})
    return out


# ---------------------------------------------------------------------------------------------------- run
def run(cfg: RLHFConfig) -> dict[str, Any]:
    p, d, g = cfg.ppo, cfg.data, cfg.grpo
    check_config(cfg)
    grpo = p.algo == "grpo"
    stage = begin_stage(cfg, "step3_rlhf", "output/step3_grpo" if grpo else "output/step3_rlhf")
    tok = load_tokenizer(resolve_model(cfg.models.actor_model), cfg.models.trust_remote_code)
    quiet = stage.log if E.is_main() else (lambda _: None)
    if grpo and not d.data:  # the embedded demo's GRPO data: arithmetic prompts with checkable answers
        d = replace(d, data=[str(demo_files()["prompts"])])
    with E.main_process_first():
        data = load_phase(d, 3, tok, cfg.run.seed, log=quiet)
    check_reward_data(reward_func_names(cfg), data.train + data.eval)
    collator = DataCollatorRLHF(tok.pad_token_id)
    prompts = train_loader(data.train, p.per_device_generation_batch_size, collator, cfg.run.seed)
    evals = eval_loader(data.eval, p.per_device_eval_batch_size, collator)
    if grpo:  # one prompt batch per update, each prompt with G completions, mu passes
        total_updates = len(prompts) * p.num_train_epochs
        rows_per_update = p.per_device_generation_batch_size * g.num_generations
        micro_per_update = g.num_iterations * math.ceil(rows_per_update / p.per_device_training_batch_size)
    else:
        total_updates = max(1, len(prompts) // p.generation_batches) * p.num_train_epochs
        rows_per_update = p.per_device_generation_batch_size * p.generation_batches
        micro_per_update = p.ppo_epochs * math.ceil(rows_per_update / p.per_device_training_batch_size)
    if p.max_steps > 0:  # the prompt stream cycles epochs, so any number of updates can run
        total_updates = p.max_steps
    # The mixed pretraining loss takes its own actor step after each PPO micro-batch (as DeepSpeed-Chat does).
    optimizer_steps = max(1, total_updates * micro_per_update * (2 if p.unsup_data else 1)
                          // p.gradient_accumulation_steps)

    models = build_models(cfg, optimizer_steps)
    hybrid = make_hybrid_engine(models.actor, tok, cfg.models.enable_hybrid_engine)
    retok = None if models.reward_tokenizer is None or same_tokenizer(tok, models.reward_tokenizer) else \
        Retokenizer(tok, models.reward_tokenizer, d.max_prompt_seq_len + p.max_answer_seq_len)
    scorer = build_scorer(cfg, models, retok)
    gen = GenerationConfig(max_new_tokens=p.max_answer_seq_len, do_sample=True, temperature=p.temperature,
                           top_p=p.top_p, top_k=p.top_k)
    kl_ctl = L.AdaptiveKLController(p.kl_ctl, p.kl_target, p.kl_horizon) if p.kl_target is not None \
        else L.FixedKLController(p.kl_ctl)
    ema = ActorEMA(models.actor, cfg.engines.ema_decay) if cfg.engines.enable_ema else None
    unsup_loader = None
    if p.unsup_data:
        unsup_args = DataArgs(data=p.unsup_data, data_split="1,0,0", max_seq_len=d.max_seq_len, eval_fraction=0.0,
                              mask_prompt=False, data_cache_dir=d.data_cache_dir)
        with E.main_process_first():
            unsup_rows = load_phase(unsup_args, 1, tok, cfg.run.seed, log=quiet).train
        unsup_loader = train_loader(unsup_rows, p.per_device_training_batch_size, DataCollatorSFT(tok.pad_token_id),
                                    cfg.run.seed)
    if grpo:
        algo = (f"GRPO loss {g.loss_type}, G {g.num_generations}, mu {g.num_iterations}, beta {g.beta}, rewards "
                + " + ".join(f"{w:g}*{n}" for n, w in zip(scorer.mixer.names, scorer.mixer.weights, strict=True))
                + (", dynamic sampling" if dynamic_sampling_of(g) else ""))
    else:
        algo = ("PPO, rewards " + " + ".join(f"{w:g}*{n}" for n, w in zip(scorer.mixer.names, scorer.mixer.weights,
                                                                           strict=True))
                + (f" (reward model {cfg.models.reward_model})" if cfg.models.reward_model else "")
                + f", ZeRO critic {cfg.engines.critic_zero_stage}")
    stage.log(f"actor {cfg.models.actor_model} | {algo} | prompts {len(data.train)} (eval {len(data.eval)}) | "
              f"{total_updates} updates, {optimizer_steps} optimizer steps | ZeRO actor "
              f"{cfg.engines.actor_zero_stage} | world {E.world_size()}")

    # Actor and critic train; the reference and reward models are frozen and reload from their paths.
    trained = {"actor": models.actor, **({"critic": models.critic} if models.critic is not None else {})}
    ckpt = Checkpointer(stage.output_dir, trained, cfg.run.keep_checkpoints, tok)
    resume_from, state, tensors = ckpt.resume_latest(stage.log) if cfg.run.resume else (None, {}, {})
    if resume_from is not None:
        kl_ctl.value = state["kl_ctl"]
        if ema is not None:
            if "ema" not in tensors:
                raise UserError(f"{resume_from}: saved without --enable-ema; resume without it or start over")
            ema.state = tensors["ema"]
    shuffle = torch.Generator().manual_seed(cfg.run.seed)
    if "shuffle" in tensors:
        shuffle.set_state(tensors["shuffle"])
    stream = EpochStream(prompts, state.get("prompt_batches", 0), what="prompt batches")
    unsup = None if unsup_loader is None else \
        EpochStream(unsup_loader, state.get("unsup_batches", 0), what="--unsup-data batches")

    before = state.get("before") or (evaluate(models, hybrid, evals, p, gen, cfg.run.seed, scorer)
                                     if data.eval else {})
    tracker = RunTracker(stage.output_dir, E.is_main(), total_updates, cfg.run.progress, desc=p.algo)
    if before and resume_from is None:
        tracker.log(0, _eval_scalars(before))
    step, dropped_total = state.get("step", 0), state.get("dropped_short_answers", 0)
    tracker.advance(step)

    def save_state() -> Any:
        if any(eng.micro_steps % p.gradient_accumulation_steps for eng in trained.values()):
            # DeepSpeed checkpoints hold no partial gradients: a state is only exact at an optimizer step.
            stage.log(f"no state at update {step}: it ends inside a gradient-accumulation window")
            return None
        extra = {"shuffle": shuffle.get_state(), **({"ema": ema.state} if ema is not None else {})}
        position = {"prompt_batches": stream.consumed, "unsup_batches": unsup.consumed if unsup is not None else 0}
        return ckpt.save(step, {**position, "kl_ctl": kl_ctl.value, "dropped_short_answers": dropped_total,
                                "before": before}, tensors=extra)

    with stop_after_step(stage.log) as stop:
        while step < total_updates:
            if grpo:
                metrics, dropped = grpo_step(models, hybrid, scorer, stream, g, p, gen, shuffle, ema)
            else:
                metrics, dropped = ppo_step(models, hybrid, stream, p, gen, kl_ctl, scorer, shuffle, unsup, ema,
                                            rows_per_update)
            step += 1
            dropped_total += dropped
            metrics["train/dropped_short_answers"] = dropped_total
            for name, value in metrics.items():
                if name.endswith("loss"):
                    check_finite(value, step, name)
            if step % cfg.run.log_interval == 0 or step == total_updates:
                tracker.log(step, metrics)
            tracker.advance(1, **{k: metrics[f"train/{k}"] for k in ("reward", "kl") if f"train/{k}" in metrics})
            if cfg.run.eval_interval and step % cfg.run.eval_interval == 0 and data.eval:
                mid = evaluate(models, hybrid, evals, p, gen, cfg.run.seed, scorer)
                tracker.log(step, _eval_scalars(mid))
            if stop.requested() and step < total_updates and (saved := save_state()) is not None:
                raise Interrupted(f"interrupted: saved {saved}; continue with --resume")
            if cfg.run.save_interval and step % cfg.run.save_interval == 0 and step < total_updates:
                save_state()
        if cfg.run.save_final_state:
            save_state()

    after = evaluate(models, hybrid, evals, p, gen, cfg.run.seed, scorer) if data.eval else {}
    if after:
        tracker.log(step, _eval_scalars(after))
    tracker.close()
    save_hf(models.actor, tok, stage.output_dir / "actor")
    if models.critic is not None:
        save_hf(models.critic, tok, stage.output_dir / "critic")
    if ema is not None:
        save_hf(models.actor, tok, stage.output_dir / "actor_ema", state_dict=ema.state)
    metrics = {
        "algo": p.algo,
        "reward_before": before.get("reward"), "reward_after": after.get("reward"),
        "reward_before_se": before.get("reward_se"), "reward_after_se": after.get("reward_se"),
        "reward_gain": (after["reward"] - before["reward"]) if before and after else None,
        "reward_gain_se": paired_se(before["scores"], after["scores"]) if before and after else None,
        "kl_before": before.get("kl"), "kl_after": after.get("kl"),
        "answer_length_before": before.get("answer_length"), "answer_length_after": after.get("answer_length"),
        "eos_rate_before": before.get("eos_rate"), "eos_rate_after": after.get("eos_rate"),
        "eval_prompts": after.get("eval_prompts"), "steps": step, "dropped_short_answers": dropped_total,
        **data.counts, "sources": data.sources,
    }
    if grpo:
        metrics["loss_type"] = g.loss_type
    if grpo or scorer.mixer.names != [RM]:
        metrics.update({"reward_funcs": scorer.mixer.names, "reward_weights": scorer.mixer.weights})
        for name in scorer.mixer.names:
            if f"reward/{name}" in after:  # per-source means when there is more than the reward model
                metrics[f"reward_{name}_before"] = before.get(f"reward/{name}")
                metrics[f"reward_{name}_after"] = after[f"reward/{name}"]
    if E.is_main():
        write_eval(stage.output_dir, metrics)
        if before and after:
            kl = f" | KL {after['kl']:.3f}" if after["kl"] is not None else ""
            stage.log(f"reward {before['reward']:.3f} ± {before['reward_se']:.3f} -> {after['reward']:.3f} ± "
                      f"{after['reward_se']:.3f} (gain {metrics['reward_gain']:.3f} ± {metrics['reward_gain_se']:.3f})"
                      f"{kl} | saved {stage.output_dir}")
    return metrics


def _eval_scalars(result: dict[str, Any]) -> dict[str, Any]:
    return {f"eval/{k}": v for k, v in result.items() if k != "scores"}


def paired_se(before: list[float], after: list[float]) -> float:
    """Standard error of the mean reward gain: both evaluations answer the same prompts (with the same sampling
    seeds), so the per-prompt differences are paired."""
    diff = torch.tensor(after) - torch.tensor(before)
    return diff.std().item() / math.sqrt(len(diff)) if len(diff) > 1 else float("nan")


command = stage_command("step3_rlhf", RLHFConfig, run,
                        help="Stage 3: RLHF with PPO (SPEC section 5) or the GRPO family (--algo grpo, SPEC 6).")

if __name__ == "__main__":
    run_command(command)
