"""Offline DPO as a stage-3 algorithm (docs/algorithms.md, DPO family): preference pairs, no sampling, no reward
model in the loss.

``--dpo-loss-type`` picks the loss (pure functions in ``dschat.losses``): sigmoid (DPO, Rafailov et al. 2023),
cdpo (label smoothing, Mitchell 2023), ipo (Azar et al. 2023, length-averaged) and simpo (Meng et al. 2024:
reference-free, length-normalised, margin ``--simpo-gamma``). The reference's log-probs of every training pair are
computed once, at the first step, and travel with the rows (no reference forward per step); a resumed run
recomputes them from the frozen reference.

Data: the phase-3 part of ``--data`` tokenized as pairs (phase 2's chosen/rejected rows, plus ``prompt_len``).
The flags are DPO's own (``--dpo-beta``, ``--dpo-loss-type``): GRPO's ``--beta``/``--loss-type`` have other
defaults and choices, and one declaration per flag keeps ``refuse_inert`` exact. They (``DPOArgs``) and what DPO is
before anything loads (``DPOSpec``) are in ``specs.py``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils.data import DataLoader

from dschat import engine as E
from dschat import losses as L
from dschat.data.collators import DataCollatorReward, DataCollatorRLHF
from dschat.data.packing import check_packing, packed_inputs, shared_prefix_inputs, unpacked_rows
from dschat.models.logits import token_logps
from dschat.rlhf.ema import ActorEMA, step_actor
from dschat.rlhf.evaluation import evaluate
from dschat.rlhf.rollout import positions_from_mask
from dschat.rlhf.scoring import Scorer
from dschat.rlhf.specs import DPOArgs, DPOSpec
from dschat.training import memory
from dschat.training.stage import EpochStream, EvalLoader, ResumableLoop, lockstep_batches, to_device

EVAL_KEYS = ("implicit_accuracy", "implicit_margin", "rewards_chosen", "rewards_rejected", "logps_chosen",
             "logps_rejected", "logratio", "eval_pairs")


class DataCollatorPairs(DataCollatorReward):
    """``DataCollatorReward``'s ``(2B, L)`` batch (B chosen rows, then B rejected) plus ``prompt_len`` ``(2B,)`` and,
    once computed, the reference's summed answer log-probs ``ref_logps`` ``(2B,)``."""

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = super().__call__(rows)
        batch["prompt_len"] = torch.tensor([r["prompt_len"] for r in rows] * 2)
        if rows and all("ref_chosen_logps" in r for r in rows):
            batch["ref_logps"] = torch.tensor([r["ref_chosen_logps"] for r in rows]
                                              + [r["ref_rejected_logps"] for r in rows])
        return batch


def sequence_logps(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   prompt_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probs ``(N,)`` of the answer tokens (after ``prompt_len``, EOS included) of right-padded
    sequences ``(N, L)``, and the answer lengths ``(N,)``; the output layer runs on answer tokens only."""
    return _answer_logps(model, input_ids, attention_mask, prompt_len, shared_prompt=False)


def pair_logps(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               prompt_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``sequence_logps`` of a ``(2B, L)`` pair batch (B chosen rows, then their B rejected rows), each pair run
    as one sequence that holds its prompt once (``packing.shared_prefix_layout``): the same log-probs, for one
    prompt instead of two and the padding of one sequence instead of two. The rows one by one where that layout
    does not apply (flash attention, a short sliding window)."""
    return _answer_logps(model, input_ids, attention_mask, prompt_len, shared_prompt=True)


def _answer_logps(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: torch.Tensor,
                  shared_prompt: bool) -> tuple[torch.Tensor, torch.Tensor]:
    target = torch.arange(1, input_ids.shape[1], device=input_ids.device)  # (L-1,) position of each target token
    answer = (target.unsqueeze(0) >= prompt_len.unsqueeze(1)) & attention_mask[:, 1:].bool()  # (N, L-1)
    rows, cols = answer.nonzero(as_tuple=True)  # token cols + 1 of row `rows` is predicted at col
    targets = input_ids[rows, cols + 1]
    shared = shared_prefix_inputs(model, input_ids, attention_mask, prompt_len[: len(prompt_len) // 2]) \
        if shared_prompt else None
    if shared is None:
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask,
                  "position_ids": positions_from_mask(attention_mask)}
        at = (rows, cols)
    else:
        inputs, index = shared
        flat, width = index[rows, cols], inputs["input_ids"].shape[1]  # the predicting position in the layout
        at = (flat // width, flat % width)
    logps = token_logps(model, at[0], at[1], targets, **inputs)
    sums = torch.zeros(input_ids.shape[0], dtype=logps.dtype, device=logps.device).index_add(0, rows, logps)
    return sums, answer.sum(-1)


def packed_sequence_logps(model: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``sequence_logps`` of a ``--packing`` batch (``PackedPairsCollator``): the model runs on the packed
    sequences ``(S, W)``; each answer token's log-prob is summed into its row of the ``(2B,)`` chosen-first view."""
    ids, row, pos = batch["packed_input_ids"], batch["packed_row"], batch["packed_position_ids"]
    target = row[:, 1:]  # (S, W-1) the view row of each target token (-1: padding)
    # an answer token of the same row as the token before it (a row's first token follows another row)
    answer = (target >= 0) & (target == row[:, :-1]) & (pos[:, 1:] >= batch["prompt_len"][target.clamp(min=0)])
    rows, cols = answer.nonzero(as_tuple=True)  # token cols + 1 of packed sequence `rows`, predicted at col
    logps = token_logps(model, rows, cols, ids[rows, cols + 1], **packed_inputs(model, batch, "packed_"))
    n, owner = batch["input_ids"].shape[0], target[rows, cols]
    sums = torch.zeros(n, dtype=logps.dtype, device=logps.device).index_add(0, owner, logps)
    lengths = torch.zeros(n, dtype=torch.long, device=logps.device).index_add(0, owner, torch.ones_like(owner))
    return sums, lengths


def pair_loss(a: DPOArgs, logps: torch.Tensor, lengths: torch.Tensor,
              ref_logps: torch.Tensor | None) -> L.DPOLossOutput:
    """The chosen loss over ``(2B,)`` summed log-probs (chosen first), their answer lengths and the reference's,
    plus ``rpo_alpha`` times the chosen answers' per-token NLL."""
    c, x = logps.chunk(2)
    nc, nx = lengths.clamp(min=1).float().chunk(2)
    if a.dpo_loss_type == "simpo":
        out = L.simpo_loss(c / nc, x / nx, a.beta, a.simpo_gamma)
    else:
        assert ref_logps is not None
        rc, rx = ref_logps.chunk(2)
        if a.dpo_loss_type == "ipo":  # IPO on length-averaged log-ratios (docs/algorithms.md, DPO family)
            loss = L.dpo_loss(c / nc, x / nx, rc / nc, rx / nx, a.beta, loss_type="ipo").loss
            # Its implicit rewards, accuracy and margin on the summed log-ratios, as TRL reports them for IPO too,
            # so the figures compare across loss types and with TRL's.
            out = L.implicit_rewards(loss, c - rc, x - rx, a.beta)
        else:
            smoothing = a.label_smoothing if a.dpo_loss_type == "cdpo" else 0.0
            out = L.dpo_loss(c, x, rc, rx, a.beta, smoothing, loss_type=a.dpo_loss_type)  # type: ignore[arg-type]
    if a.rpo_alpha:
        out = out._replace(loss=out.loss + a.rpo_alpha * L.per_token_nll(c, nc))
    return out


def pair_stats(out: L.DPOLossOutput, logps: torch.Tensor, ref_logps: torch.Tensor | None) -> dict[str, float]:
    c, x = logps.detach().chunk(2)
    stats = {"loss": out.loss.item(), "implicit_accuracy": out.reward_accuracy.item(),
             "implicit_margin": out.reward_margin.item(), "rewards_chosen": out.chosen_rewards.mean().item(),
             "rewards_rejected": out.rejected_rewards.mean().item(), "logps_chosen": c.mean().item(),
             "logps_rejected": x.mean().item()}
    if ref_logps is not None:  # mean log-ratio of the pair sequences to the reference (SimPO has none)
        stats["logratio"] = (logps.detach() - ref_logps).mean().item()
    return stats


@torch.no_grad()
def implicit_eval(models: Any, a: DPOArgs, loader: EvalLoader) -> dict[str, Any]:
    """``EVAL_KEYS`` over held-out pairs (``DataCollatorPairs`` batches): the implicit reward ``beta * (pi - ref)``
    of chosen and rejected answers, its accuracy (ties count half) and margin, the summed log-probs, and the mean
    log-ratio of the pair sequences to the reference (None with simpo, which has none)."""
    cols: dict[str, list[float]] = {k: [] for k in ("acc", "margin", "rc", "rx", "lc", "lx", "ratio")}
    models.actor.eval()
    for batch, real in lockstep_batches(loader):
        b = to_device(batch, E.device())
        logps, lengths = pair_logps(models.actor, b["input_ids"], b["attention_mask"], b["prompt_len"])
        ref = pair_logps(models.ref, b["input_ids"], b["attention_mask"], b["prompt_len"])[0] \
            if models.ref is not None else None
        out = pair_loss(a, logps, lengths, ref)
        if not real:
            continue
        c, x = logps.chunk(2)
        rc, rx = out.chosen_rewards, out.rejected_rewards
        cols["acc"] += ((rc > rx).float() + 0.5 * (rc == rx).float()).tolist()
        cols["margin"] += (rc - rx).tolist()
        cols["rc"] += rc.tolist()
        cols["rx"] += rx.tolist()
        cols["lc"] += c.tolist()
        cols["lx"] += x.tolist()
        if ref is not None:
            cols["ratio"] += (logps - ref).view(2, -1).mean(0).tolist()
    models.actor.train()
    gathered = E.gather_objects(cols)
    t = {k: torch.tensor([v for part in gathered for v in part[k]]) for k in cols}
    res: dict[str, Any] = {k: (t[c].mean().item() if len(t[c]) else None) for k, c in zip(
        EVAL_KEYS, ("acc", "margin", "rc", "rx", "lc", "lx", "ratio"), strict=False)}
    res["eval_pairs"] = len(t["acc"])
    return res


def implicit_summary(a: DPOArgs, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """eval.json's DPO part: the loss, beta and every ``EVAL_KEYS`` entry before and after."""
    out: dict[str, Any] = {"loss_type": a.dpo_loss_type, "beta": a.beta}
    for k in EVAL_KEYS:
        out[f"{k}_before"], out[f"{k}_after"] = before.get(k), after.get(k)
    return out


class DPO(DPOSpec):
    collator = DataCollatorPairs

    def __init__(self, cfg: Any, models: Any, hybrid: Any, scorer: Scorer | None, gen: Any, shuffle: torch.Generator,
                 ema: ActorEMA | None, loop: ResumableLoop):
        self.cfg, self.a, self.models, self.hybrid, self.scorer, self.gen = cfg, cfg.dpo, models, hybrid, scorer, gen
        self.ema, self.loop = ema, loop
        self.reference_ready = models.ref is None
        self.packed_collate = DataCollatorPairs(models.tokenizer.pad_token_id).packed()  # --packing micro-batches
        if cfg.data.packing:
            check_packing(models.actor, cfg.data.max_seq_len)

    def describe(self) -> str:
        a = self.a
        extra = {"cdpo": f", label smoothing {a.label_smoothing}", "simpo": f", gamma {a.simpo_gamma}"}
        rewards = f", eval rewards {self.scorer.describe()}" if self.scorer is not None else ""
        return f"DPO loss {a.dpo_loss_type}, beta {a.beta}{extra.get(a.dpo_loss_type, '')}{rewards}"

    def summary(self, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
        return implicit_summary(self.a, before, after)

    def state(self) -> dict[str, Any]:
        return {}

    @torch.no_grad()
    @memory.phase("experience")
    def compute_reference(self, rows: list[dict[str, Any]]) -> None:
        """The reference's summed answer log-probs of every pair, once, stored in the rows (all ranks compute all
        rows: the sampler hands a rank different rows each epoch, and ZeRO-3 forwards are collective)."""
        t0, collate = time.time(), DataCollatorPairs(self.models.tokenizer.pad_token_id)
        size = self.cfg.optim.per_device_eval_batch_size
        for i in range(0, len(rows), size):
            chunk = rows[i: i + size]
            b = to_device(collate(chunk), E.device())
            logps, _ = pair_logps(self.models.ref, b["input_ids"], b["attention_mask"], b["prompt_len"])
            c, x = logps.chunk(2)
            for row, lc, lx in zip(chunk, c.tolist(), x.tolist(), strict=True):
                row["ref_chosen_logps"], row["ref_rejected_logps"] = lc, lx
        self.reference_ready = True
        if E.is_main():
            print(f"[dpo] reference log-probs of {len(rows)} pairs computed once in {time.time() - t0:.1f}s")

    def step(self, stream: EpochStream) -> tuple[dict[str, float], int]:
        """One update: the next batch of pairs, in micro-batches of the chosen DPO loss. Returns its metrics."""
        if not self.reference_ready:
            self.compute_reference(unpacked_rows(stream.loader.dataset))  # type: ignore[arg-type]
        t0, actor, size = time.time(), self.models.actor, self.cfg.optim.per_device_train_batch_size
        b = to_device(next(stream), E.device())
        B = b["input_ids"].shape[0] // 2
        sums: dict[str, float] = {}
        if "packs" in b:  # --packing: micro-batches of `size` packed sequences (the batch itself when it is one)
            packs = b["packs"]
            chunks = [b] if len(packs) <= size else [to_device(self.packed_collate(packs[i: i + size]), E.device())
                                                     for i in range(0, len(packs), size)]
        else:  # micro-batches of `size` pairs: a chunk's chosen rows, then its rejected rows
            chunks = [torch.cat([idx, idx + B]) for idx in torch.arange(B, device=b["input_ids"].device).split(size)]
        for i, chunk in enumerate(chunks, 1):
            with self.loop.micro_batch("train_actor", i):
                if isinstance(chunk, dict):
                    ref = chunk.get("ref_logps")
                    logps, lengths = packed_sequence_logps(actor, chunk)
                else:
                    ref = b["ref_logps"][chunk] if "ref_logps" in b else None
                    logps, lengths = pair_logps(actor, b["input_ids"][chunk], b["attention_mask"][chunk],
                                                b["prompt_len"][chunk])
                out = pair_loss(self.a, logps, lengths, ref)
                step_actor(actor, out.loss, self.ema)
            for k, v in pair_stats(out, logps, ref).items():
                sums[k] = sums.get(k, 0.0) + v / len(chunks)
        names = sorted(sums)
        reduced = E.all_reduce_mean(torch.tensor([sums[k] for k in names])).tolist()
        metrics = {f"train/{'actor_loss' if k == 'loss' else k}": v for k, v in zip(names, reduced, strict=True)}
        pairs = E.all_reduce_sum(torch.tensor(float(B))).item()
        return {**metrics, "time/training_s": time.time() - t0,
                "time/pairs_per_s": pairs / max(time.time() - t0, 1e-9), **memory.take()}, 0

    @torch.no_grad()
    @memory.phase("eval")
    def evaluate(self, loader: EvalLoader) -> dict[str, Any]:
        """Held-out implicit-reward accuracy, margin, log-probs and log-ratio to the reference over pairs; with
        reward sources, also the reward of sampled answers to the pairs' prompts (``evaluation.evaluate``)."""
        res = implicit_eval(self.models, self.a, loader)
        if self.scorer is not None:
            res.update(evaluate(self.models, self.hybrid, self.prompt_loader(loader), self.gen,
                                self.cfg.rl.temperature, self.cfg.run.seed, self.scorer,
                                num_samples=self.cfg.rl.eval_samples, progress=self.cfg.run.progress))
        return res

    def prompt_loader(self, loader: EvalLoader) -> EvalLoader:
        """The prompts of this rank's held-out pairs, left-padded for generation."""
        def prompts(ids: list[int], n: int) -> dict[str, Any]:
            return {"prompt_input_ids": list(ids[:n])}
        collate = DataCollatorRLHF(self.models.tokenizer.pad_token_id)
        rows = [prompts(r["chosen_input_ids"], r["prompt_len"]) for r in loader.loader.dataset]  # type: ignore
        f = loader.filler
        filler = None if f is None else collate([prompts(f["input_ids"][0].tolist(), int(f["prompt_len"][0]))])
        dl = DataLoader(rows, batch_size=self.cfg.optim.per_device_eval_batch_size, shuffle=False,
                        collate_fn=collate)
        return EvalLoader(dl, filler)
