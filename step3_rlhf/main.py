"""Stage 3: RLHF with PPO over four DeepSpeed engines (actor, reference, critic, reward).

    python step3_rlhf/main.py --actor-model out/step1/model --reward-model out/step2/model --output-dir out/step3
    deepspeed --num_gpus 8 step3_rlhf/main.py --actor-zero-stage 3 --enable-hybrid-engine ...
    dschat train --step 3 ...        (the same flags)

Reads top to bottom: set up the four models, evaluate, loop (generate experience -> PPO epochs), evaluate, save.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from itertools import cycle
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from dschat import engine as E
from dschat import losses as L
from dschat.checkpoint import save_hf
from dschat.cli import run_command, stage_command
from dschat.config import DataArgs, EngineArgs, OptimArgs, RunArgs, arg
from dschat.data import DataCollatorRLHF, DataCollatorSFT, load_phase
from dschat.errors import UserError
from dschat.hybrid_engine import GenerationConfig, make_hybrid_engine
from dschat.models import create_causal_lm, create_reward_model, load_tokenizer, resolve_model
from dschat.rlhf import (
    Retokenizer,
    Rollout,
    answer_logprobs,
    answer_values,
    make_rollout,
    reward_scores,
    same_tokenizer,
)
from dschat.stage import begin_stage, eval_loader, to_device, train_loader
from dschat.tracking import RunTracker, write_eval

TINY_PARAMS = 50_000_000  # below this, a model is a from-scratch toy and takes toy-sized learning rates


@dataclass
class RLModelArgs:
    actor_model: str = arg("", "Actor initialisation: a step-1 output (…/model) or any --model value.")
    reward_model: str = arg("", "Reward model: a step-2 output (…/model).")
    critic_model: str = arg("", "Critic initialisation (default: the reward model).")
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
    algo: str = arg("ppo", "RL algorithm.", choices=("ppo",))
    per_device_generation_batch_size: int = arg(8, "Prompts per device per generation batch.")
    per_device_training_batch_size: int = arg(8, "Experience rows per device per PPO micro-batch.")
    per_device_eval_batch_size: int = arg(16, "Prompts per device per evaluation batch.")
    generation_batches: int = arg(1, "Generation batches collected before each PPO update.")
    ppo_epochs: int = arg(1, "Passes over each batch of experience.")
    num_train_epochs: int = arg(1, "Passes over the prompts.")
    max_steps: int = arg(-1, "Stop after this many PPO updates (-1: run all epochs).")
    gradient_accumulation_steps: int = arg(1, "PPO micro-batches per optimizer step.")
    actor_learning_rate: float | None = arg(None, "Actor learning rate (default 1e-4 for tiny models, else 1e-6).")
    critic_learning_rate: float | None = arg(None, "Critic learning rate (default 5e-4 for tiny models, else 5e-6).")
    actor_weight_decay: float = arg(0.0, "Actor AdamW weight decay.")
    critic_weight_decay: float = arg(0.0, "Critic AdamW weight decay.")
    lr_scheduler_type: str = arg("cosine", "Schedule after warmup.", choices=("cosine", "linear", "constant"))
    num_warmup_steps: int = arg(0, "Warmup optimizer steps.")
    max_grad_norm: float = arg(1.0, "Gradient clipping norm (0 disables).")
    max_answer_seq_len: int = arg(256, "Longest generated answer in tokens.")
    temperature: float = arg(1.0, "Sampling temperature.")
    top_p: float = arg(1.0, "Nucleus sampling threshold.")
    top_k: int = arg(0, "Top-k sampling (0 disables).")
    kl_ctl: float = arg(0.1, "KL penalty coefficient in the per-token reward.")
    kl_target: float | None = arg(None, "Target KL for the adaptive controller (Ziegler et al. 2019); "
                                        "unset keeps kl_ctl fixed.")
    kl_horizon: int = arg(10000, "Horizon of the adaptive KL controller.")
    clip_reward_value: float = arg(5.0, "Reward scores are clipped to [-c, c].")
    cliprange: float = arg(0.2, "PPO policy ratio clip.")
    cliprange_value: float = arg(0.2, "Critic value clip.")
    gamma: float = arg(1.0, "Discount.")
    lam: float = arg(0.95, "GAE lambda.")
    whiten_advantages: bool = arg(True, "Whiten advantages over the answer tokens of each experience batch.")
    normalize_reward: bool = arg(False, "Normalise scores by the reward model's eval mean/std (from its config).")
    missing_eos_penalty: float | None = arg(None, "Subtracted from the score of answers that never reached EOS.")
    unsup_data: list[str] = arg(help="SFT-format data for the mixed pretraining loss (repeatable).", factory=list)
    unsup_coef: float = arg(27.8, "Weight of the mixed pretraining loss.")


@dataclass
class RLHFConfig:
    models: RLModelArgs = field(default_factory=RLModelArgs)
    engines: RLEngineArgs = field(default_factory=RLEngineArgs)
    ppo: PPOArgs = field(default_factory=PPOArgs)
    data: DataArgs = field(default_factory=DataArgs)
    run: RunArgs = field(default_factory=RunArgs)


# ------------------------------------------------------------------------------------------------- models
@dataclass
class Models:
    actor: Any  # training engine
    ref: Any  # frozen (engine under ZeRO-3, else module)
    critic: Any  # training engine
    reward: Any  # frozen
    tokenizer: Any
    reward_tokenizer: Any
    reward_stats: tuple[float, float] | None


def _lr(given: float | None, n_params: int, tiny: float, real: float) -> float:
    if given is not None:
        return given
    return tiny if n_params < TINY_PARAMS else real


def build_models(cfg: RLHFConfig, total_steps: int) -> Models:
    m, e, p = cfg.models, cfg.engines, cfg.ppo
    actor_path, reward_path = resolve_model(m.actor_model), resolve_model(m.reward_model)
    critic_path = resolve_model(m.critic_model) if m.critic_model else reward_path
    tok = load_tokenizer(actor_path, m.trust_remote_code)
    rm_tok = load_tokenizer(reward_path, m.trust_remote_code)
    if not same_tokenizer(tok, load_tokenizer(critic_path, m.trust_remote_code)):
        raise UserError(f"the critic ({critic_path}) must share the actor's tokenizer; pass --critic-model with a "
                        "reward model (or the actor) trained on the actor's tokenizer")
    dtype = E.resolve_dtype(m.dtype)

    actor = create_causal_lm(actor_path, dtype, m.actor_dropout, m.actor_gradient_checkpointing, m.trust_remote_code)
    n_actor = sum(t.numel() for t in actor.parameters())
    actor_optim = OptimArgs(learning_rate=_lr(p.actor_learning_rate, n_actor, 1e-4, 1e-6),
                            weight_decay=p.actor_weight_decay, lr_scheduler_type=p.lr_scheduler_type,
                            num_warmup_steps=p.num_warmup_steps, max_grad_norm=p.max_grad_norm,
                            per_device_train_batch_size=p.per_device_training_batch_size,
                            gradient_accumulation_steps=p.gradient_accumulation_steps)
    hybrid = {"max_out_tokens": cfg.data.max_prompt_seq_len + p.max_answer_seq_len} if m.enable_hybrid_engine \
        and torch.cuda.is_available() else None
    actor_engine = E.build_train_engine(actor, engine=EngineArgs(e.actor_zero_stage, e.offload), optim=actor_optim,
                                        dtype=dtype, total_steps=total_steps, hybrid_engine=hybrid)
    ref = create_causal_lm(actor_path, dtype, m.actor_dropout, False, m.trust_remote_code)
    ref_stage = e.reference_zero_stage if e.reference_zero_stage is not None else e.actor_zero_stage
    ref_engine = E.build_eval_engine(ref, zero_stage=ref_stage, offload=e.offload_reference_model, dtype=dtype)

    critic = create_reward_model(critic_path, dtype, m.critic_dropout, m.critic_gradient_checkpointing,
                                 tok.pad_token_id, m.trust_remote_code)
    n_critic = sum(t.numel() for t in critic.parameters())
    critic_optim = OptimArgs(learning_rate=_lr(p.critic_learning_rate, n_critic, 5e-4, 5e-6),
                             weight_decay=p.critic_weight_decay, lr_scheduler_type=p.lr_scheduler_type,
                             num_warmup_steps=p.num_warmup_steps, max_grad_norm=p.max_grad_norm,
                             per_device_train_batch_size=p.per_device_training_batch_size,
                             gradient_accumulation_steps=p.gradient_accumulation_steps)
    critic_engine = E.build_train_engine(critic, engine=EngineArgs(e.critic_zero_stage, e.offload),
                                         optim=critic_optim, dtype=dtype, total_steps=total_steps)
    reward = create_reward_model(reward_path, dtype, 0.0, False, rm_tok.pad_token_id, m.trust_remote_code)
    stats = None
    if getattr(reward.config, "reward_mean", None) is not None:
        stats = (float(reward.config.reward_mean), float(getattr(reward.config, "reward_std", 1.0) or 1.0))
    rw_stage = e.reward_zero_stage if e.reward_zero_stage is not None else e.critic_zero_stage
    reward_engine = E.build_eval_engine(reward, zero_stage=rw_stage, offload=e.offload_reward_model, dtype=dtype)
    return Models(actor_engine, ref_engine, critic_engine, reward_engine, tok, rm_tok, stats)


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


def score_rollout(models: Models, rollout: Rollout, p: PPOArgs, retok: Retokenizer | None) -> tuple[torch.Tensor,
                                                                                                     torch.Tensor]:
    raw = reward_scores(models.reward, rollout, retok)
    score = raw.clone()
    if p.normalize_reward and models.reward_stats is not None:
        mean, std = models.reward_stats
        score = (score - mean) / max(std, 1e-6)
    if p.missing_eos_penalty:
        score = score - p.missing_eos_penalty * (~rollout.reached_eos).float()
    return raw, score


@torch.no_grad()
def make_experience(models: Models, hybrid: Any, batch: dict[str, Any], p: PPOArgs, gen: GenerationConfig,
                    kl_ctl: float, retok: Retokenizer | None) -> tuple[Experience, int]:
    seqs = hybrid.generate(batch["prompt"], batch["prompt_att_mask"], gen)
    rollout, dropped = make_rollout(batch["prompt"], batch["prompt_att_mask"], seqs, models.tokenizer.eos_token_id,
                                    models.tokenizer.pad_token_id)
    # Old log-probs, reference log-probs and values in eval mode (no dropout), once per experience batch.
    models.actor.eval()
    models.critic.eval()
    old_logprobs = answer_logprobs(models.actor, rollout, p.temperature)
    ref_logprobs = answer_logprobs(models.ref, rollout, p.temperature)
    old_values = answer_values(models.critic, rollout).float()
    raw, score = score_rollout(models, rollout, p, retok)
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
    P = max(x.rollout.prompt_len for x in parts)
    A = max(x.rollout.action_mask.shape[1] for x in parts)

    def pad(t: torch.Tensor, left: int, right: int, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(t, (left, right), value=value)

    fields: dict[str, list[torch.Tensor]] = {k: [] for k in ("seq", "mask", "amask", "old", "ref", "val", "rew",
                                                             "adv", "ret")}
    for x in parts:
        r = x.rollout
        lp, ra = P - r.prompt_len, A - r.action_mask.shape[1]
        fields["seq"].append(pad(r.sequences, lp, ra, pad_token_id))
        fields["mask"].append(pad(r.attention_mask, lp, ra, 0))
        fields["amask"].append(pad(r.action_mask, 0, ra, 0))
        for key, t in (("old", x.old_logprobs), ("ref", x.ref_logprobs), ("val", x.old_values), ("rew", x.rewards),
                       ("adv", x.advantages), ("ret", x.returns)):
            fields[key].append(pad(t, 0, ra, 0.0))
    cat = {k: torch.cat(v) for k, v in fields.items()}
    rollout = Rollout(cat["seq"], cat["mask"], cat["amask"], P, torch.cat([x.rollout.reached_eos for x in parts]))
    return Experience(rollout, cat["old"], cat["ref"], cat["val"], torch.cat([x.scores for x in parts]),
                      torch.cat([x.raw_scores for x in parts]), cat["rew"], cat["adv"], cat["ret"])


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
             retok: Retokenizer | None) -> dict[str, float]:
    """Mean reward (with its standard error), KL to the reference and answer length on held-out prompts.

    Sampling uses a fixed seed per batch, so before/after evaluations draw the same random numbers.
    """
    scores, kls, lengths, eos = [], [], [], []
    models.actor.eval()
    for i, batch in enumerate(loader):
        batch = to_device(batch, E.device())
        seqs = hybrid.generate(batch["prompt"], batch["prompt_att_mask"], gen, generator_seed=seed + i)
        rollout, _ = make_rollout(batch["prompt"], batch["prompt_att_mask"], seqs, models.tokenizer.eos_token_id,
                                  models.tokenizer.pad_token_id, min_answer_len=1)
        logp = answer_logprobs(models.actor, rollout, p.temperature)
        ref = answer_logprobs(models.ref, rollout, p.temperature)
        mask = rollout.action_mask.float()
        kls.append(((logp - ref) * mask).sum(-1).cpu())  # per-sequence KL estimate (k1 summed over tokens)
        scores.append(reward_scores(models.reward, rollout, retok).float().cpu())
        lengths.append(mask.sum(-1).cpu())
        eos.append(rollout.reached_eos.float().cpu())
    models.actor.train()
    cat = [torch.cat(x) if x else torch.zeros(0) for x in (scores, kls, lengths, eos)]
    gathered = E.gather_objects([t.tolist() for t in cat])
    s, k, n, d = (torch.tensor([v for g in gathered for v in g[i]]) for i in range(4))
    count = max(len(s), 1)
    std = s.std().item() if len(s) > 1 else 0.0
    return {"scores": s.tolist(), "reward": s.mean().item() if len(s) else float("nan"),
            "reward_se": std / math.sqrt(count),
            "reward_std": std, "kl": k.mean().item() if len(k) else float("nan"),
            "answer_length": n.mean().item() if len(n) else float("nan"),
            "eos_rate": d.mean().item() if len(d) else float("nan"), "eval_prompts": len(s)}


# ---------------------------------------------------------------------------------------------------- run
def run(cfg: RLHFConfig) -> dict[str, Any]:
    p, d = cfg.ppo, cfg.data
    if not cfg.models.actor_model or not cfg.models.reward_model:
        raise UserError("stage 3 needs --actor-model (a step-1 output) and --reward-model (a step-2 output)")
    stage = begin_stage(cfg, "step3_rlhf", "output/step3_rlhf")
    tok = load_tokenizer(resolve_model(cfg.models.actor_model), cfg.models.trust_remote_code)
    quiet = stage.log if E.is_main() else (lambda _: None)
    with E.main_process_first():
        data = load_phase(d, 3, tok, cfg.run.seed, log=quiet)
    collator = DataCollatorRLHF(tok.pad_token_id)
    prompts = train_loader(data.train, p.per_device_generation_batch_size, collator, cfg.run.seed)
    evals = eval_loader(data.eval, p.per_device_eval_batch_size, collator)
    updates_per_epoch = max(1, len(prompts) // p.generation_batches)
    total_updates = updates_per_epoch * p.num_train_epochs
    if p.max_steps > 0:
        total_updates = min(total_updates, p.max_steps)
    rows_per_update = p.per_device_generation_batch_size * p.generation_batches
    micro_per_update = p.ppo_epochs * math.ceil(rows_per_update / p.per_device_training_batch_size)
    # The mixed pretraining loss takes its own actor step after each PPO micro-batch (as DeepSpeed-Chat does).
    optimizer_steps = max(1, total_updates * micro_per_update * (2 if p.unsup_data else 1)
                          // p.gradient_accumulation_steps)

    models = build_models(cfg, optimizer_steps)
    hybrid = make_hybrid_engine(models.actor, tok, cfg.models.enable_hybrid_engine)
    retok = None if same_tokenizer(tok, models.reward_tokenizer) else \
        Retokenizer(tok, models.reward_tokenizer, d.max_prompt_seq_len + p.max_answer_seq_len)
    gen = GenerationConfig(max_new_tokens=p.max_answer_seq_len, do_sample=True, temperature=p.temperature,
                           top_p=p.top_p, top_k=p.top_k)
    kl_ctl = L.AdaptiveKLController(p.kl_ctl, p.kl_target, p.kl_horizon) if p.kl_target is not None \
        else L.FixedKLController(p.kl_ctl)
    ema = ActorEMA(models.actor, cfg.engines.ema_decay) if cfg.engines.enable_ema else None
    unsup = None
    if p.unsup_data:
        unsup_args = DataArgs(data=p.unsup_data, data_split="1,0,0", max_seq_len=d.max_seq_len, eval_fraction=0.0,
                              mask_prompt=False, data_cache_dir=d.data_cache_dir)
        with E.main_process_first():
            unsup_rows = load_phase(unsup_args, 1, tok, cfg.run.seed, log=quiet).train
        unsup = cycle(train_loader(unsup_rows, p.per_device_training_batch_size, DataCollatorSFT(tok.pad_token_id),
                                   cfg.run.seed))
    stage.log(f"actor {cfg.models.actor_model} | reward {cfg.models.reward_model} | prompts {len(data.train)} "
              f"(eval {len(data.eval)}) | {total_updates} PPO updates, {optimizer_steps} optimizer steps | "
              f"ZeRO actor {cfg.engines.actor_zero_stage} critic {cfg.engines.critic_zero_stage} | "
              f"world {E.world_size()}")

    before = evaluate(models, hybrid, evals, p, gen, cfg.run.seed, retok) if data.eval else {}
    tracker = RunTracker(stage.output_dir, E.is_main(), total_updates, cfg.run.progress, desc="ppo")
    if before:
        tracker.log(0, _eval_scalars(before))

    dev = E.device()
    shuffle = torch.Generator().manual_seed(cfg.run.seed)
    step, dropped_total, pending = 0, 0, []
    for epoch in range(p.num_train_epochs):
        prompts.sampler.set_epoch(epoch)
        for batch in prompts:
            t0 = time.time()
            batch = to_device(batch, dev)
            exp, dropped = make_experience(models, hybrid, batch, p, gen, kl_ctl.value, retok)
            dropped_total += dropped
            pending.append((exp, hybrid.last_generate_seconds, time.time() - t0))
            if len(pending) < p.generation_batches:
                continue
            exp = concat_experience([x[0] for x in pending], tok.pad_token_id)
            gen_time = sum(x[1] for x in pending)
            exp_time = sum(x[2] for x in pending)
            pending = []
            t1 = time.time()
            stats = ppo_update(models, exp, p, shuffle, unsup, ema)
            train_time = time.time() - t1
            step += 1
            mask = exp.rollout.action_mask.float()
            seq_kl = ((exp.old_logprobs - exp.ref_logprobs) * mask).sum(-1)
            local = torch.stack([exp.raw_scores.float().mean(), seq_kl.mean(), L.masked_mean(exp.returns, mask),
                                 mask.sum(-1).mean(), exp.rollout.reached_eos.float().mean()]).cpu()
            reward, kl, ret, length, eos_rate = E.all_reduce_mean(local).tolist()
            tokens = E.all_reduce_sum(mask.sum().cpu()).item()
            kl_ctl.update(kl, rows_per_update * E.world_size())
            metrics = {"train/reward": reward, "train/kl": kl, "train/kl_ctl": kl_ctl.value, "train/return": ret,
                       "train/answer_length": length, "train/eos_rate": eos_rate, **stats,
                       "time/generation_s": gen_time, "time/experience_s": exp_time - gen_time,
                       "time/training_s": train_time,
                       "time/tokens_per_s": tokens / max(exp_time + train_time, 1e-9),
                       "train/dropped_short_answers": dropped_total}
            for name, value in metrics.items():
                if name.endswith("loss"):
                    _check_finite(value, step, name)
            if step % cfg.run.log_interval == 0 or step == total_updates:
                tracker.log(step, metrics)
            tracker.advance(1, reward=reward, kl=kl)
            if cfg.run.eval_interval and step % cfg.run.eval_interval == 0 and data.eval:
                mid = evaluate(models, hybrid, evals, p, gen, cfg.run.seed, retok)
                tracker.log(step, _eval_scalars(mid))
            if step >= total_updates:
                break
        if step >= total_updates:
            break

    after = evaluate(models, hybrid, evals, p, gen, cfg.run.seed, retok) if data.eval else {}
    if after:
        tracker.log(step, _eval_scalars(after))
    tracker.close()
    save_hf(models.actor, tok, stage.output_dir / "actor")
    save_hf(models.critic, tok, stage.output_dir / "critic")
    if ema is not None:
        save_hf(models.actor, tok, stage.output_dir / "actor_ema", state_dict=ema.state)
    metrics = {
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
    if E.is_main():
        write_eval(stage.output_dir, metrics)
        if before and after:
            stage.log(f"reward {before['reward']:.3f} ± {before['reward_se']:.3f} -> {after['reward']:.3f} ± "
                      f"{after['reward_se']:.3f} | KL {after['kl']:.3f} | saved {stage.output_dir}")
    return metrics


def _eval_scalars(result: dict[str, Any]) -> dict[str, Any]:
    return {f"eval/{k}": v for k, v in result.items() if k != "scores"}


def paired_se(before: list[float], after: list[float]) -> float:
    """Standard error of the mean reward gain: both evaluations answer the same prompts (with the same sampling
    seeds), so the per-prompt differences are paired."""
    diff = torch.tensor(after) - torch.tensor(before)
    return diff.std().item() / math.sqrt(len(diff)) if len(diff) > 1 else float("nan")


def _check_finite(value: float, step: int, name: str) -> None:
    if not math.isfinite(value):
        raise UserError(f"{name} became {value} at PPO step {step}; stopping (lower the learning rates)")


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


command = stage_command("step3_rlhf", RLHFConfig, run, help="Stage 3: RLHF with PPO (SPEC section 5, 8).")

if __name__ == "__main__":
    run_command(command)
