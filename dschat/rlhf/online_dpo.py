"""Online (iterative) DPO as a stage-3 algorithm (docs/algorithms.md, DPO family): the policy samples, a reward
source ranks, DPO learns.

Each step: ``--num-generations`` answers per prompt from the current policy (the GRPO family's generation and
scoring path: ``repeat_prompts``, ``generate_rollout``, the run's ``Scorer``, so any reward source works: ``rm``,
rules, ``judge``, a user function), the best- and worst-rewarded answer of each prompt become a pair
(``L.best_worst_pairs``; a group whose rewards are all equal is a tie, skipped and counted), and the pairs take a
DPO step with offline DPO's losses (``--dpo-loss-type``, ``--dpo-beta``, ... from ``dpo.py``). The reference is the
initial policy: a frozen engine computes its log-probs of each step's pairs. This is iterative DPO with one
sampling round per step (Xiong et al. 2024, arXiv:2312.11456; Dong et al. 2024, arXiv:2405.07863; Guo et al. 2024,
arXiv:2402.04792, with a reward source in place of an AI annotator).

Log-probs are the policy's own (temperature 1), as offline DPO's: the implicit reward ``beta * (pi - ref)`` is
defined on the policy, not on the tempered sampling distribution. Evaluation is the sampling algorithms' (reward of
held-out answers, paired s.e., KL) plus, where the held-out prompts come from pairwise rows, offline DPO's
implicit-reward accuracy on those pairs, and the implicit-reward accuracy on held-out *sampled* pairs
(``sampled_pairs_eval``): what online DPO learns is the reward sources' preference between the policy's own kind of
answers, which a dataset's pairs need not contain.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils.data import DataLoader

from dschat import engine as E
from dschat import losses as L
from dschat.data.phases import pairs_of
from dschat.devices import forked_rng
from dschat.generation.hybrid_engine import HybridEngine
from dschat.rlhf.dpo import DataCollatorPairs, implicit_eval, implicit_summary, pair_loss, pair_stats
from dschat.rlhf.ema import ActorEMA, step_actor
from dschat.rlhf.onpolicy import OnPolicy
from dschat.rlhf.rollout import Rollout, answer_logprobs, generate_rollout, repeat_prompts
from dschat.rlhf.scoring import Scorer
from dschat.rlhf.specs import OnlineDPOSpec
from dschat.training import memory
from dschat.training.stage import EpochStream, EvalLoader, ResumableLoop, lockstep_batches, to_device

SAMPLED_KEYS = ("sampled_implicit_accuracy", "sampled_pairs", "onpolicy_implicit_accuracy", "onpolicy_pairs")
SAMPLED_SEED_OFFSET = 7919  # the held-out pairs' sampling seeds, apart from the reward evaluation's


def rollout_logps(model: Any, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed answer log-probs ``(B,)`` of a rollout's rows under ``model`` (temperature 1; left-padded prompts and
    the padding after each answer's EOS excluded by the action mask) and the answer lengths ``(B,)``."""
    mask = rollout.action_mask
    return L.masked_sum(answer_logprobs(model, rollout), mask, dim=-1), mask.sum(-1)


class OnlineDPO(OnPolicy, OnlineDPOSpec):
    def __init__(self, cfg: Any, models: Any, hybrid: Any, scorer: Scorer, gen: Any, shuffle: torch.Generator,
                 ema: ActorEMA | None, loop: ResumableLoop):
        self.cfg, self.a, self.models, self.hybrid, self.scorer, self.gen = cfg, cfg.dpo, models, hybrid, scorer, gen
        self.ema, self.loop = ema, loop
        self.G = cfg.grpo.num_generations
        # Totals over the run (kept in the resumable state, so a resumed run reports the same).
        self.totals: dict[str, int] = {k: int(loop.state.get(k, 0)) for k in ("pairs", "tie_groups", "unpaired_groups")}

    def describe(self) -> str:
        a = self.a
        extra = {"cdpo": f", label smoothing {a.label_smoothing}", "simpo": f", gamma {a.simpo_gamma}"}
        return (f"online DPO loss {a.dpo_loss_type}, beta {a.beta}{extra.get(a.dpo_loss_type, '')}, G {self.G} "
                f"best vs worst, rewards {self.scorer.describe()}")

    def summary(self, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
        sampled = {f"{k}_{when}": r.get(k) for k in SAMPLED_KEYS for when, r in (("before", before), ("after", after))}
        return {**implicit_summary(self.a, before, after), **sampled, **self.totals}

    def state(self) -> dict[str, Any]:
        return dict(self.totals)

    @torch.no_grad()
    @memory.phase("experience")
    def make_pairs(self, stream: EpochStream) -> tuple[Rollout, torch.Tensor | None, dict[str, float], int]:
        """Sample G answers per prompt of the next batch, score them and pair best with worst.

        Returns the pairs as one rollout of ``2M`` rows (the M chosen answers, then their M rejected ones; every
        rank keeps the same M, the fewest any rank has, so all run the same micro-batches under ZeRO-3), the
        reference's summed log-probs of those rows ``(2M,)`` (None with simpo), the step's sampling stats and the
        number of answers dropped as too short.
        """
        m, rl, G = self.models, self.cfg.rl, self.G
        batch = repeat_prompts(to_device(next(stream), E.device()), G)
        rollout, dropped = generate_rollout(self.hybrid, m.tokenizer, batch, self.gen, min_answer_len=rl.min_answer_len)
        self.hybrid.release()  # the generate phase ends: its memory goes back before scoring and training
        mixed = self.scorer(rollout, batch)
        rewards = mixed.total  # (N,)
        pairs = L.best_worst_pairs(rewards, G, rollout.answer_lengths.cpu() > 0)
        M = int(-E.all_reduce_max(torch.tensor(-float(pairs.chosen.numel()))).item())  # the fewest on any rank
        rows = torch.cat([pairs.chosen[:M], pairs.rejected[:M]])
        # reward_std is the mean within-group spread: what the pairs are made of (0 in a tie).
        stats = {"train/reward": rewards.mean().item(),
                 "train/reward_std": rewards.view(-1, G).std(dim=1).mean().item(),
                 "train/answer_length": rollout.answer_lengths.float().mean().item(),
                 "train/eos_rate": rollout.reached_eos.float().mean().item(),
                 "tokens": rollout.answer_lengths.sum().item(), "time/generation_s": self.hybrid.last_generate_seconds,
                 **{f"train/reward/{n}": v.mean().item() for n, v in mixed.per_func.items()}}
        if M:  # the same M on every rank, so every rank logs the same keys
            stats["train/reward_chosen_sample"] = rewards[pairs.chosen[:M]].mean().item()
            stats["train/reward_rejected_sample"] = rewards[pairs.rejected[:M]].mean().item()
        counts = {"pairs": float(M), "tie_groups": float(pairs.ties), "unpaired_groups": float(pairs.unpaired)}
        counts = dict(zip(counts, E.all_reduce_sum(torch.tensor(list(counts.values()))).tolist(), strict=True))
        for k, v in counts.items():
            self.totals[k] += int(v)
            stats[f"train/{k}"] = v
        selected = rollout.select(rows.to(rollout.sequences.device))
        ref = None
        if m.ref is not None and M:
            ref = rollout_logps(m.ref, selected)[0]  # once per step, the frozen initial policy
        return selected, ref, stats, dropped

    def update(self, pairs: Rollout, ref: torch.Tensor | None) -> dict[str, float]:
        """DPO steps over the step's ``M`` pairs (chosen rows first), ``--per-device-train-batch-size`` per
        micro-batch; the metrics are means over micro-batches and ranks."""
        M, actor = pairs.sequences.shape[0] // 2, self.models.actor
        if M == 0:  # every group tied on every rank (M is the fewest on any rank): nothing to learn from
            with memory.phase("train_actor"):  # no micro-batch, but every step's row has the phase's figures
                return {}
        sums: dict[str, float] = {}
        chunks = torch.arange(M).split(self.cfg.optim.per_device_train_batch_size)
        for i, idx in enumerate(chunks, 1):
            rows = torch.cat([idx, idx + M])  # the chunk's chosen rows, then its rejected rows
            with self.loop.micro_batch("train_actor", i):
                logps, lengths = rollout_logps(actor, pairs.select(rows.to(pairs.sequences.device)))
                r = ref[rows.to(ref.device)] if ref is not None else None
                out = pair_loss(self.a, logps, lengths, r)
                step_actor(actor, out.loss, self.ema)
            for k, v in pair_stats(out, logps, r).items():
                sums[k] = sums.get(k, 0.0) + v / len(chunks)
        if not sums:
            return {}
        names = sorted(sums)
        reduced = E.all_reduce_mean(torch.tensor([sums[k] for k in names])).tolist()
        # On the policy's own samples the log-ratio to the reference is a (k1, per-sequence) KL estimate.
        rename = {"loss": "actor_loss", "logratio": "kl"}
        return {f"train/{rename.get(k, k)}": v for k, v in zip(names, reduced, strict=True)}

    def step(self, stream: EpochStream) -> tuple[dict[str, float], int]:
        """One update: sample and pair, then DPO steps. Returns its metrics and the answers dropped as too short."""
        t0 = time.time()
        pairs, ref, stats, dropped = self.make_pairs(stream)
        exp_time = time.time() - t0
        t1 = time.time()
        train = self.update(pairs, ref)
        train_time = time.time() - t1
        tokens = E.all_reduce_sum(torch.tensor(stats.pop("tokens"))).item()
        gen_time = stats.pop("time/generation_s")
        local = [k for k in sorted(stats) if k not in ("train/pairs", "train/tie_groups", "train/unpaired_groups")]
        reduced = dict(zip(local, E.all_reduce_mean(torch.tensor([stats[k] for k in local])).tolist(), strict=True))
        counts = {k: stats[k] for k in stats if k not in reduced}
        return {**reduced, **counts, **train, "time/generation_s": gen_time,
                "time/experience_s": exp_time - gen_time, "time/training_s": train_time,
                "time/tokens_per_s": tokens / max(exp_time + train_time, 1e-9), **memory.take()}, dropped

    @torch.no_grad()
    @memory.phase("eval")
    def evaluate(self, loader: EvalLoader) -> dict[str, Any]:
        """The sampling algorithms' evaluation (reward of answers to the held-out prompts, KL), plus offline DPO's
        implicit-reward metrics on the pairs of the held-out rows that have one (``pairs_of``)."""
        res = super().evaluate(loader)
        pairs = self.pair_loader(loader)
        if pairs is not None:
            res.update(implicit_eval(self.models, self.a, pairs))
        res.update(self.sampled_pairs_eval(loader))
        return res

    @torch.no_grad()
    def sampled_pairs_eval(self, loader: EvalLoader) -> dict[str, Any]:
        """Implicit-reward accuracy on held-out sampled pairs: ``--num-generations`` answers to each held-out prompt,
        the reward sources' best against their worst, as training pairs them. A pair counts when
        ``beta * (log pi - log ref)`` ranks the best above the worst (a tie counts half: 0.5 before training, where
        the policy is the reference). Two samplers, with the same fixed seeds:

        * ``sampled_*``: the frozen initial policy (the reference engine), so the evaluations before and after
          training score the same pairs;
        * ``onpolicy_*``: the policy being evaluated, i.e. pairs of the kind online DPO trains on, on prompts it
          never trained on (before training the two are the same pairs).

        None without a reference (simpo)."""
        if self.models.ref is None:
            return {}
        m = self.models
        initial = HybridEngine(m.ref, m.tokenizer.pad_token_id, m.tokenizer.eos_token_id, backend=self.hybrid.backend,
                               agent=self.hybrid.agent)
        # RNG-neutral: iterating a DataLoader draws from the global generator, and training's sampling must not
        # depend on whether this evaluation ran
        out: dict[str, Any] = {}
        for prefix, sampler in (("sampled", initial), ("onpolicy", self.hybrid)):
            with forked_rng():
                accuracy, count = self._sampled_pairs_accuracy(loader, sampler)
            out[f"{prefix}_implicit_accuracy"], out[f"{prefix}_pairs"] = accuracy, count
        return out

    def _sampled_pairs_accuracy(self, loader: EvalLoader, sampler: Any) -> tuple[float | None, int]:
        m, G = self.models, self.G
        was_training = m.actor.training
        m.actor.eval()
        wins, count = 0.0, 0.0
        for i, (batch, real) in enumerate(lockstep_batches(loader)):  # ZeRO-3: generation and forwards collective
            batch = repeat_prompts(to_device(batch, E.device()), G)
            rollout, _ = generate_rollout(sampler, m.tokenizer, batch, self.gen,
                                          seed=self.cfg.run.seed + SAMPLED_SEED_OFFSET + i, min_answer_len=1)
            rewards = self.scorer(rollout, batch).total
            implicit = rollout_logps(m.actor, rollout)[0] - rollout_logps(m.ref, rollout)[0]  # (N,) per beta
            pairs = L.best_worst_pairs(rewards, G, rollout.answer_lengths.cpu() > 0)
            if real and pairs.chosen.numel():
                c, x = pairs.chosen.to(implicit.device), pairs.rejected.to(implicit.device)
                wins += L.pairwise_metrics(implicit[c], implicit[x]).accuracy.item() * c.numel()  # ties half
                count += float(c.numel())
        if was_training:
            m.actor.train()
        wins, count = E.all_reduce_sum(torch.tensor([wins, count])).tolist()
        return (wins / count if count else None), int(count)

    def pair_loader(self, loader: EvalLoader) -> EvalLoader | None:
        """This rank's held-out pairs, or None when some rank has none (the evaluation is collective)."""
        rows = pairs_of(list(loader.loader.dataset), self.models.tokenizer, self.cfg.data)  # type: ignore[arg-type]
        if E.all_reduce_max(torch.tensor(-float(len(rows)))).item() >= 0:  # the fewest on a rank is 0
            return None
        collate = DataCollatorPairs(self.models.tokenizer.pad_token_id)
        dl = DataLoader(rows, batch_size=self.cfg.optim.per_device_eval_batch_size, shuffle=False,
                        collate_fn=collate)
        return EvalLoader(dl, collate(rows[:1]))
