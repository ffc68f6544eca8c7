"""The GRPO family (docs/algorithms.md, GRPO family): G completions per prompt, group-relative advantages, no critic.

``--loss-type`` picks the member: grpo (Shao et al. 2024), dr_grpo (Liu et al. 2025), dapo (Yu et al. 2025:
clip-higher, dynamic sampling, soft overlong penalty), gspo (Zheng et al. 2025: sequence-level ratio). One
``GRPO.step()``: groups (``make_groups``) -> ``num_iterations`` passes of policy steps (``update``). The loss and
its aggregation are pure functions in ``dschat.losses``.

The critic-free estimators (``rloo.py``, ``reinforce_pp.py``, ``remax.py``) are this machinery with another
advantage: they subclass ``GRPO`` and override ``advantages`` (and ``prompt_baselines``, ``needs_old``), and
read the GRPO flags they list in ``uses`` (``specs.grpo_flags``). The flags (``GRPOArgs``) and what each member is
before anything loads (``GRPOSpec`` and its subclasses) are in ``specs.py``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from dschat import engine as E
from dschat import losses as L
from dschat.rlhf.ema import ActorEMA, step_actor
from dschat.rlhf.onpolicy import OnPolicy
from dschat.rlhf.rollout import (
    Rollout,
    answer_logprobs,
    behaviour_logprobs,
    concat_rollouts,
    generate_rollout,
    importance_weights,
    repeat_prompts,
)
from dschat.rlhf.scoring import Scorer
from dschat.rlhf.specs import GRPOSpec
from dschat.training import memory
from dschat.training.stage import EpochStream, ResumableLoop, to_device


@dataclass
class GroupBatch:
    """One GRPO step's completions, ``num_generations`` consecutive ones per prompt."""

    rollout: Rollout
    rewards: torch.Tensor  # (N,) mixed rewards
    advantages: torch.Tensor  # (N,) one per completion (group-relative), or (N, A) per token (REINFORCE++)
    old_logprobs: torch.Tensor | None  # (N, A); None: no optimizer step since generation, old = logprobs.detach()
    ref_logprobs: torch.Tensor | None  # (N, A); None without a reference model (beta 0)

    def minibatches(self, size: int, generator: torch.Generator) -> list[GroupBatch]:
        order = torch.randperm(self.rewards.shape[0], generator=generator)
        return [GroupBatch(self.rollout.select(idx), self.rewards[idx], self.advantages[idx],
                           None if self.old_logprobs is None else self.old_logprobs[idx],
                           None if self.ref_logprobs is None else self.ref_logprobs[idx])
                for idx in order.split(size)]


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
    return replace(rollout, action_mask=rollout.action_mask * keep)


def needs_old_logprobs(num_iterations: int, n_micro: int, grad_accum: int, micro_offset: int) -> bool:
    """Whether an optimizer step falls between a generation and the last micro-batch that trains on it.

    If none does, the policy that generated is the policy being trained, so ``old = logprobs.detach()`` is exact
    and saves a forward pass (mu = 1). Otherwise (mu > 1, or the generation spans several optimizer
    steps) the old log-probs are computed once after generation. ``micro_offset``: micro-batches already
    accumulated towards the next optimizer step.
    """
    return micro_offset + num_iterations * n_micro > grad_accum


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


class GRPO(OnPolicy, GRPOSpec):
    def __init__(self, cfg: Any, models: Any, hybrid: Any, scorer: Scorer, gen: Any, shuffle: torch.Generator,
                 ema: ActorEMA | None, loop: ResumableLoop):
        self.cfg, self.g, self.models, self.hybrid, self.scorer, self.gen = cfg, cfg.grpo, models, hybrid, scorer, gen
        self.shuffle, self.ema, self.loop = shuffle, ema, loop
        # The policy loss's settings; an estimator that reads fewer GRPO flags sets its own.
        self.loss_type = self.g.loss_type or self.default_loss_type
        self.eps_high, self.beta, self.dynamic = self.g.eps_high, self.g.beta, self.g.dynamic

    def advantages(self, rewards: torch.Tensor, rollout: Rollout, old: torch.Tensor | None,
                   ref: torch.Tensor | None, baselines: torch.Tensor | None) -> torch.Tensor:
        """``(N,)`` or ``(N, A)`` advantages of a generation's kept groups: GRPO's group-relative ones.
        ``rewards``, ``baselines`` (from ``prompt_baselines``): ``(N,)``; ``old``, ``ref``: ``(N, A)`` or None."""
        return L.group_advantages(rewards, self.g.num_generations, self.g.scale_rewards)  # type: ignore[arg-type]

    def prompt_baselines(self, batch: dict[str, Any], scorer: Scorer) -> torch.Tensor | None:
        """A reward per prompt ``(P,)`` measured at generation time (ReMax: its greedy answer's); None here."""
        return None

    def needs_old(self, n_micro: int, grad_accum: int, micro_offset: int) -> bool:
        """Whether to compute old log-probs after generation (else old = logprobs.detach() in the loss)."""
        return needs_old_logprobs(self.g.num_iterations, n_micro, grad_accum, micro_offset)

    def describe(self) -> str:
        g = self.g
        return (f"GRPO loss {self.loss_type}, G {g.num_generations}, mu {g.num_iterations}, beta {g.beta}, rewards "
                + self.scorer.describe() + (", dynamic sampling" if self.dynamic else ""))

    def summary(self, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
        return {"loss_type": self.loss_type}

    @torch.no_grad()
    @memory.phase("experience")
    def make_groups(self, stream: EpochStream) -> tuple[GroupBatch | None, dict[str, float], int]:
        """Generate ``num_generations`` completions per prompt of the next batch, score them and compute group
        advantages. With dynamic sampling, groups whose rewards are all equal (no gradient) are dropped and
        further prompt batches are generated to refill, at most ``max_resample_rounds`` extra rounds; then every
        rank keeps the same number of groups, so all ranks run the same number of micro-batches (ZeRO).

        Returns the batch (None when no group is left), stats over every generated completion, and the number
        of answers dropped as too short.
        """
        g, m, rl = self.g, self.models, self.cfg.rl
        G, dev, target = g.num_generations, E.device(), rl.per_device_generation_batch_size
        # The sampling pass returns its log-probs when they will serve as old log-probs: needs_old with the most
        # micro-batches this generation can yield (dynamic sampling only keeps fewer, and fewer never need more).
        accum = self.cfg.optim.gradient_accumulation_steps
        offset = getattr(m.actor, "micro_steps", 0) % accum  # no optimizer step happens until training
        most = math.ceil(target * G / self.cfg.optim.per_device_train_batch_size)
        gen = replace(self.gen, logprobs=self.needs_old(most, accum, offset))
        kept: list[tuple[Rollout, torch.Tensor, torch.Tensor | None]] = []
        seen: dict[str, list[torch.Tensor]] = {"reward": [], "length": [], "eos": [], "group_std": [],
                                               **{f"reward/{n}": [] for n in self.scorer.mixer.names}}
        n_kept, rounds, dropped, gen_time = 0, 0, 0, 0.0
        while True:
            prompts = to_device(next(stream), dev)
            baselines = self.prompt_baselines(prompts, self.scorer)
            if baselines is not None:  # measured by a generation of its own (ReMax's greedy answers)
                gen_time += self.hybrid.last_generate_seconds
                baselines = baselines.float().cpu().repeat_interleave(G)  # (N,) aligned with the completions
                seen.setdefault("reward_baseline", []).append(baselines)
            batch = repeat_prompts(prompts, G)
            rollout, d = generate_rollout(self.hybrid, m.tokenizer, batch, gen, min_answer_len=rl.min_answer_len)
            self.hybrid.release()  # the generate phase ends: its memory goes back before scoring and training
            gen_time += self.hybrid.last_generate_seconds
            dropped += d
            seen["length"].append(rollout.answer_lengths.float().cpu())
            seen["eos"].append(rollout.reached_eos.float().cpu())
            if g.mask_truncated_completions:
                rollout = mask_truncated(rollout)
            mixed = self.scorer(rollout, batch)
            seen["reward"].append(mixed.total)
            seen["group_std"].append(mixed.total.view(-1, G).std(dim=1))
            for name, values in mixed.per_func.items():
                seen[f"reward/{name}"].append(values)
            idx = select_groups(mixed.total, G, self.dynamic, target - n_kept)
            if idx.numel():
                kept.append((rollout.select(idx.to(rollout.sequences.device)), mixed.total[idx],
                             None if baselines is None else baselines[idx]))
            n_kept += idx.numel() // G
            rounds += 1
            if not self.dynamic or rounds > g.max_resample_rounds:
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
        if "reward_baseline" in cat:
            stats["train/reward_baseline"] = cat["reward_baseline"].mean().item()
        if n_groups == 0:
            return None, stats, dropped

        rollout = concat_rollouts([r for r, _, _ in kept], m.tokenizer.pad_token_id)
        rewards = torch.cat([t for _, t, _ in kept])
        rows = torch.arange(n_groups * G)
        rollout, rewards = rollout.select(rows.to(rollout.sequences.device)), rewards[rows]
        baselines = torch.cat([b for _, _, b in kept])[rows] if kept[0][2] is not None else None
        n_micro = math.ceil(rows.numel() / self.cfg.optim.per_device_train_batch_size)
        # Old and reference log-probs in eval mode (no dropout), once per generation.
        m.actor.eval()
        old = behaviour_logprobs(m.actor, rollout, rl.temperature) if self.needs_old(n_micro, accum, offset) else None
        ref = answer_logprobs(m.ref, rollout, rl.temperature) if m.ref is not None else None
        m.actor.train()
        advantages = self.advantages(rewards.to(dev), rollout, old, ref,
                                     None if baselines is None else baselines.to(dev)).to(dev)
        return GroupBatch(rollout, rewards.to(dev), advantages, old, ref), stats, dropped

    def update(self, batch: GroupBatch) -> dict[str, float]:
        """``num_iterations`` passes of GRPO-family policy steps (``L.grpo_policy_loss``) over one generation."""
        g, actor, rl = self.g, self.models.actor, self.cfg.rl
        sums: dict[str, float] = {}
        n = 0
        for _ in range(g.num_iterations):
            mbs = batch.minibatches(self.cfg.optim.per_device_train_batch_size, self.shuffle)
            normalizers = optimizer_step_normalizers(mbs, self.loss_type, rl.max_answer_seq_len, actor.micro_steps,
                                                     self.cfg.optim.gradient_accumulation_steps)
            for i, (mb, normalizer) in enumerate(zip(mbs, normalizers, strict=True), 1):
                with self.loop.micro_batch("train_actor", i):
                    logprobs = answer_logprobs(actor, mb.rollout, rl.temperature)
                    old = mb.old_logprobs if mb.old_logprobs is not None else logprobs.detach()
                    weights, gap = importance_weights(mb.rollout, old, rl.vllm_importance_sampling,
                                                      rl.vllm_importance_sampling_cap)
                    out = L.grpo_policy_loss(logprobs, old, mb.advantages, mb.rollout.action_mask, g.epsilon,
                                             self.eps_high, self.loss_type,  # type: ignore[arg-type]
                                             ref_logprobs=mb.ref_logprobs,
                                             beta=self.beta if mb.ref_logprobs is not None else 0.0,
                                             kl_estimator=g.kl_estimator,  # type: ignore[arg-type]
                                             max_completion_length=rl.max_answer_seq_len, normalizer=normalizer,
                                             weights=weights)
                    step_actor(actor, out.loss, self.ema)
                stats = {"train/actor_loss": out.loss, "train/clip_ratio_low": out.clip_ratio_low,
                         "train/clip_ratio_high": out.clip_ratio_high, "train/clip_ratio": out.clip_ratio,
                         # the sampled tokens' negative log-probability: an estimate of the policy's entropy
                         "train/entropy": -L.masked_mean(logprobs.detach(), mb.rollout.action_mask)}
                if mb.ref_logprobs is not None:
                    stats["train/kl"] = out.kl
                for key, value in stats.items():
                    sums[key] = sums.get(key, 0.0) + float(value.item())
                for key, value in gap.items():
                    sums[key] = sums.get(key, 0.0) + value
                n += 1
        local = torch.tensor([sums[k] / max(n, 1) for k in sorted(sums)])
        return dict(zip(sorted(sums), E.all_reduce_mean(local).tolist(), strict=True))

    def step(self, stream: EpochStream) -> tuple[dict[str, float], int]:
        """One GRPO update: groups -> policy steps. Returns the step's metrics and the short answers dropped."""
        t0 = time.time()
        batch, stats, dropped = self.make_groups(stream)
        exp_time = time.time() - t0
        t1 = time.time()
        train = self.update(batch) if batch is not None else {}
        train_time = time.time() - t1
        tokens = E.all_reduce_sum(torch.tensor(stats.pop("tokens"))).item()
        gen_time = stats.pop("time/generation_s")
        names = sorted(stats)
        reduced = dict(zip(names, E.all_reduce_mean(torch.tensor([stats[k] for k in names])).tolist(), strict=True))
        return {**reduced, **train, "time/generation_s": gen_time, "time/experience_s": exp_time - gen_time,
                "time/training_s": train_time, "time/tokens_per_s": tokens / max(exp_time + train_time, 1e-9),
                **memory.take()}, dropped
