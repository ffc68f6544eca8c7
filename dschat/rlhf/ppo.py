"""PPO (docs/algorithms.md, PPO; Ouyang et al. 2022, DeepSpeed-Chat step 3): experience from the actor,
reference, critic and reward model, KL-penalised per-token rewards, GAE, then ``ppo_epochs`` passes of clipped
actor and critic steps.

One ``PPO.step()``: ``generation_batches`` experience batches -> ``update``. The losses and GAE are pure
functions in ``dschat.losses``; the KL controller is the only state the algorithm carries between steps. Its flags
(``PPOArgs``) and what it is before anything loads (``PPOSpec``) are in ``specs.py``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from dschat import engine as E
from dschat import losses as L
from dschat.config import DataArgs
from dschat.data import DataCollatorSFT, load_phase
from dschat.rlhf.ema import ActorEMA
from dschat.rlhf.onpolicy import OnPolicy
from dschat.rlhf.rollout import (
    Rollout,
    answer_logprobs,
    answer_values,
    behaviour_logprobs,
    concat_rollouts,
    generate_rollout,
    importance_weights,
    pad_right,
)
from dschat.rlhf.scoring import Scorer
from dschat.rlhf.specs import PPOSpec
from dschat.training import memory
from dschat.training.stage import EpochStream, ResumableLoop, to_device, train_loader


@dataclass
class Experience:
    rollout: Rollout
    old_logprobs: torch.Tensor  # (B, A)
    ref_logprobs: torch.Tensor  # (B, A)
    old_values: torch.Tensor  # (B, A)
    scores: torch.Tensor  # (B,) after penalties / normalisation, before clipping
    raw_scores: torch.Tensor  # (B,) the reward sources' own end scores
    rewards: torch.Tensor  # (B, A)
    advantages: torch.Tensor  # (B, A)
    returns: torch.Tensor  # (B, A)

    TOKEN_FIELDS: ClassVar = ("old_logprobs", "ref_logprobs", "old_values", "rewards", "advantages", "returns")

    def minibatches(self, size: int, generator: torch.Generator) -> list[Experience]:
        order = torch.randperm(self.rollout.sequences.shape[0], generator=generator)
        return [Experience(self.rollout.select(idx), *(getattr(self, f)[idx] for f in (
            "old_logprobs", "ref_logprobs", "old_values", "scores", "raw_scores", "rewards", "advantages",
            "returns"))) for idx in order.split(size)]

    @staticmethod
    def concat(parts: list[Experience], pad_token_id: int) -> Experience:
        """Stack experience batches whose prompt/answer widths differ (pad prompts left, answers right)."""
        if len(parts) == 1:
            return parts[0]
        rollout = concat_rollouts([x.rollout for x in parts], pad_token_id)
        A = rollout.action_mask.shape[1]
        tok = {f: torch.cat([pad_right(getattr(x, f), A) for x in parts]) for f in Experience.TOKEN_FIELDS}
        return Experience(rollout, scores=torch.cat([x.scores for x in parts]),
                          raw_scores=torch.cat([x.raw_scores for x in parts]), **tok)


class PPO(OnPolicy, PPOSpec):
    def __init__(self, cfg: Any, models: Any, hybrid: Any, scorer: Scorer, gen: Any, shuffle: torch.Generator,
                 ema: ActorEMA | None, loop: ResumableLoop):
        self.cfg, self.p, self.models, self.hybrid, self.scorer = cfg, cfg.ppo, models, hybrid, scorer
        self.gen = replace(gen, logprobs=True)  # the sampling pass's log-probs are PPO's old log-probs
        self.shuffle, self.ema, self.loop = shuffle, ema, loop
        p = self.p
        state = loop.state
        self.kl_ctl = L.AdaptiveKLController(p.kl_ctl, p.kl_target, p.kl_horizon) if p.kl_target is not None \
            else L.FixedKLController(p.kl_ctl)
        if "kl_ctl" in state:
            self.kl_ctl.value = state["kl_ctl"]
        self.unsup = None
        if p.unsup_data:
            d = cfg.data
            unsup_args = DataArgs(data=p.unsup_data, data_split="1,0,0", max_seq_len=d.max_seq_len,
                                  eval_fraction=0.0, mask_prompt=False, data_cache_dir=d.data_cache_dir)
            with E.main_process_first():
                rows = load_phase(unsup_args, 1, models.tokenizer, cfg.run.seed,
                                  log=(lambda _: None)).train
            loader = train_loader(rows, cfg.optim.per_device_train_batch_size,
                                  DataCollatorSFT(models.tokenizer.pad_token_id), cfg.run.seed)
            self.unsup = EpochStream(loader, state.get("unsup_batches", 0), what="--unsup-data batches")

    def describe(self) -> str:
        rm = f" (reward model {self.cfg.rewards.reward_model})" if self.cfg.rewards.reward_model else ""
        return f"PPO, rewards {self.scorer.describe()}{rm}, ZeRO critic {self.cfg.critic_engine.zero_stage}"

    def state(self) -> dict[str, Any]:
        return {"kl_ctl": self.kl_ctl.value, "unsup_batches": self.unsup.consumed if self.unsup is not None else 0}

    def scores(self, rollout: Rollout, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """The end score of each answer: the reward sources' weighted sum (the reward model alone by default),
        then optionally normalised by the reward model's statistics and penalised when EOS was never reached."""
        raw = self.scorer(rollout, batch).total.to(rollout.sequences.device)
        score = raw.clone()
        if self.p.normalize_reward and self.models.reward_stats is not None:
            mean, std = self.models.reward_stats
            score = (score - mean) / max(std, 1e-6)
        if self.p.missing_eos_penalty:
            score = score - self.p.missing_eos_penalty * (~rollout.reached_eos).float()
        return raw, score

    @torch.no_grad()
    @memory.phase("experience")
    def make_experience(self, batch: dict[str, Any]) -> tuple[Experience, int]:
        m, p, temp = self.models, self.p, self.cfg.rl.temperature
        rollout, dropped = generate_rollout(self.hybrid, m.tokenizer, batch, self.gen,
                                            min_answer_len=self.cfg.rl.min_answer_len)
        self.hybrid.release()  # the generate phase ends: its memory goes back before the forwards and training
        # Old log-probs (from the sampling pass when it computed them), reference log-probs and values in eval
        # mode (no dropout), once per experience batch.
        m.actor.eval()
        m.critic.eval()
        old_logprobs = behaviour_logprobs(m.actor, rollout, temp)
        ref_logprobs = answer_logprobs(m.ref, rollout, temp)
        old_values = answer_values(m.critic, rollout).float()
        raw, score = self.scores(rollout, batch)
        m.actor.train()
        m.critic.train()
        mask = rollout.action_mask
        rewards = L.kl_penalized_rewards(old_logprobs, ref_logprobs, score, mask, self.kl_ctl.value,
                                         p.clip_reward_value)
        adv, returns = L.gae(old_values, rewards, mask, p.gamma, p.lam)
        if p.whiten_advantages and mask.sum() > 1:
            adv = L.whiten(adv, mask)
        return Experience(rollout, old_logprobs, ref_logprobs, old_values, score, raw, rewards, adv, returns), dropped

    def step(self, stream: EpochStream) -> tuple[dict[str, float], int]:
        """One PPO update. Returns the step's metrics and the short answers dropped."""
        pending, dropped = [], 0
        for _ in range(self.p.generation_batches):
            t0 = time.time()
            exp, d = self.make_experience(to_device(next(stream), E.device()))
            dropped += d
            pending.append((exp, self.hybrid.last_generate_seconds, time.time() - t0))
        exp = Experience.concat([x[0] for x in pending], self.models.tokenizer.pad_token_id)
        gen_time, exp_time = sum(x[1] for x in pending), sum(x[2] for x in pending)
        t1 = time.time()
        stats = self.update(exp)
        train_time = time.time() - t1
        mask = exp.rollout.action_mask.float()
        seq_kl = ((exp.old_logprobs - exp.ref_logprobs) * mask).sum(-1)
        tokens_kl = ((exp.old_logprobs - exp.ref_logprobs) * mask).sum() / mask.sum().clamp(min=1)
        entropy = -(exp.old_logprobs * mask).sum() / mask.sum().clamp(min=1)  # the sampled tokens' NLL
        local = torch.stack([exp.raw_scores.float().mean(), seq_kl.mean(), L.masked_mean(exp.returns, mask),
                             mask.sum(-1).mean(), exp.rollout.reached_eos.float().mean(), tokens_kl, entropy]).cpu()
        reward, kl, ret, length, eos_rate, kl_per_token, entropy_mean = E.all_reduce_mean(local.float()).tolist()
        tokens = E.all_reduce_sum(mask.sum().cpu()).item()
        rows = self.cfg.rl.per_device_generation_batch_size * self.p.generation_batches
        self.kl_ctl.update(kl, rows * E.world_size())
        return {"train/reward": reward, "train/kl": kl, "train/kl_per_token": kl_per_token,
                "train/entropy": entropy_mean, "train/kl_ctl": self.kl_ctl.value, "train/return": ret,
                "train/answer_length": length, "train/eos_rate": eos_rate, **stats,
                "time/generation_s": gen_time, "time/experience_s": exp_time - gen_time,
                "time/training_s": train_time,
                "time/tokens_per_s": tokens / max(exp_time + train_time, 1e-9), **memory.take()}, dropped

    def update(self, exp: Experience) -> dict[str, float]:
        """``ppo_epochs`` passes of clipped-surrogate actor steps and clipped-value critic steps over ``exp``."""
        m, p = self.models, self.p
        sums: dict[str, float] = {}
        n = 0
        for _ in range(p.ppo_epochs):
            for i, mb in enumerate(exp.minibatches(self.cfg.optim.per_device_train_batch_size, self.shuffle), 1):
                mask = mb.rollout.action_mask
                with self.loop.micro_batch("train_actor", i):
                    logprobs = answer_logprobs(m.actor, mb.rollout, self.cfg.rl.temperature)
                    weights, gap = importance_weights(mb.rollout, mb.old_logprobs,
                                                      self.cfg.rl.vllm_importance_sampling,
                                                      self.cfg.rl.vllm_importance_sampling_cap)
                    actor = L.ppo_policy_loss(logprobs, mb.old_logprobs, mb.advantages, mask, p.cliprange, weights)
                    for key, value in gap.items():
                        sums[key] = sums.get(key, 0.0) + value
                    steps_before = m.actor.global_steps
                    m.actor.backward(actor.loss)
                    E.optimizer_step(m.actor)
                    if self.unsup is not None:
                        batch = to_device(next(self.unsup), E.device())
                        lm_loss = m.actor(**batch, use_cache=False).loss
                        m.actor.backward(p.unsup_coef * lm_loss)
                        E.optimizer_step(m.actor)
                        sums["train/unsup_loss"] = sums.get("train/unsup_loss", 0.0) + lm_loss.item()
                    if self.ema is not None and m.actor.global_steps != steps_before:
                        self.ema.update(m.actor)
                with self.loop.micro_batch("train_critic", i):
                    values = answer_values(m.critic, mb.rollout)
                    critic = L.ppo_value_loss(values, mb.old_values, mb.returns, mask, p.cliprange_value)
                    m.critic.backward(critic.loss)
                    E.optimizer_step(m.critic)
                for key, value in (("train/actor_loss", actor.loss), ("train/critic_loss", critic.loss),
                                   ("train/actor_clip_frac", actor.clip_frac),
                                   ("train/critic_clip_frac", critic.clip_frac),
                                   ("train/approx_kl_old_new", actor.approx_kl)):
                    sums[key] = sums.get(key, 0.0) + float(value.item())
                n += 1
        local = torch.tensor([sums[k] / max(n, 1) for k in sorted(sums)])
        return dict(zip(sorted(sums), E.all_reduce_mean(local).tolist(), strict=True))
