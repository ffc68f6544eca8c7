"""Reward-model evaluation, shared by stage 2 (before, during and after training) and ``dschat eval --step 2``.

A reward model here is anything whose forward maps ``(input_ids, attention_mask)`` of shape ``(N, T)`` to
per-token values ``(N, T)``: a ``dschat.models.reward_model.RewardModel`` or a DeepSpeed engine wrapping one.
Batches come from ``DataCollatorReward``: B chosen rows, then B rejected rows, right-padded.

Metrics (docs/algorithms.md, Reward-model loss): pairwise accuracy (chosen > rejected, ties count half), mean
chosen and rejected end scores, mean margin, plus the mean and standard deviation of all end scores (chosen and
rejected together), which stage 3 uses to normalise rewards. Every metric is a ratio of sums, all-reduced over
ranks, so evaluating disjoint shards on N ranks gives exactly the single-process numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from dschat import engine as E
from dschat.config import DataArgs
from dschat.data import PhaseData, load_phase
from dschat.models.reward_model import RewardModel, check_reward_checkpoint
from dschat.training import oom
from dschat.training.stage import EvalLoader, lockstep_batches, to_device


@dataclass
class RewardEval:
    """Reward-model metrics over an evaluation set."""

    accuracy: float  # fraction of pairs with score_c > score_x, ties count half
    chosen_score: float  # mean end score of the chosen answers
    rejected_score: float  # mean end score of the rejected answers
    margin: float  # mean of score_c - score_x
    score_mean: float  # mean of all 2 * pairs end scores (reward normalisation in stage 3)
    score_std: float  # population std of the same scores
    pairs: int
    ties: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def evaluate_reward(model: Any, loader: EvalLoader) -> RewardEval:
    """Score every pair of ``loader`` (``eval_loader``: this rank's shard, batches from ``DataCollatorReward``),
    summed over ranks.

    Under ZeRO-3 every forward is a collective (each layer's parameters are gathered from all ranks), so the
    ranks run in lockstep (``lockstep_batches``); otherwise uneven shards would hang the gathers.
    """
    was_training = model.training
    model.eval()
    dev = E.device()
    # float64 sums: the std comes from sum and sum of squares, which cancel badly in float32.
    sums = torch.zeros(7, dtype=torch.float64)  # wins, ties, pairs, sum_c, sum_x, sum_all, sumsq_all
    for batch, real in lockstep_batches(loader):
        batch = to_device(batch, dev)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        values = oom.split_on_oom(  # out of memory: the batch's halves, in order (a row's values are its own)
            "eval", ids.shape[0], lambda a, b, ids=ids, mask=mask: model(input_ids=ids[a:b], attention_mask=mask[a:b]),
            torch.cat, local=oom.rank_local(model))  # (2B, T)
        if not real:
            continue
        scores = RewardModel.end_scores(values, batch["attention_mask"]).double().cpu()  # (2B,)
        b = scores.numel() // 2
        c, x = scores[:b], scores[b:]
        both = torch.cat([c, x])
        sums += torch.stack([(c > x).double().sum(), (c == x).double().sum(), torch.tensor(b, dtype=torch.float64),
                             c.sum(), x.sum(), both.sum(), (both**2).sum()])
    wins, ties, pairs, sum_c, sum_x, sum_all, sumsq_all = E.all_reduce_sum(sums.to(dev)).cpu().tolist()
    if was_training:
        model.train()
    n = max(pairs, 1.0)
    mean_all = sum_all / max(2 * pairs, 1.0)
    var_all = max(sumsq_all / max(2 * pairs, 1.0) - mean_all**2, 0.0)
    return RewardEval(
        accuracy=(wins + 0.5 * ties) / n,
        chosen_score=sum_c / n,
        rejected_score=sum_x / n,
        margin=(sum_c - sum_x) / n,
        score_mean=mean_all,
        score_std=math.sqrt(var_all),
        pairs=int(pairs),
        ties=int(ties),
    )


# Without held-out pairs, reward_mean/reward_std come from this many training pairs (2x as many end scores),
# scored once after training: the standard error of the mean is then about std / 11, plenty for normalising
# stage-3 rewards, at a sixth of the cost of re-scoring --max-eval-rows (400) pairs.
STATS_PAIRS = 64


def stats_sample(rows: list[dict[str, Any]], cap: int = STATS_PAIRS) -> list[dict[str, Any]]:
    """At most ``cap`` rows, evenly spaced over ``rows`` (so every source of a multi-source set is represented)."""
    if len(rows) <= cap:
        return list(rows)
    return [rows[i * len(rows) // cap] for i in range(cap)]


def load_all_pairs(data: list[str], tokenizer: Any, max_seq_len: int,
                   log: Callable[[str], None] = lambda _: None) -> PhaseData:
    """Every row of the given pairwise sources as evaluation pairs, in ``.train``; nothing held out.

    Phase 2 of a ``0,1,0`` split with no held-out fraction gives all rows of each file, tokenized and filtered
    exactly as stage 2 does (identical, empty and over-long pairs dropped and counted). A source with its own
    test split (a ``save_to_disk`` folder, a registered name) contributes its test rows too.
    """
    args = DataArgs(data=list(data), data_split="0,1,0", eval_fraction=0.0, max_eval_rows=0,
                    max_seq_len=max_seq_len)
    pd = load_phase(args, 2, tokenizer, seed=0, log=log)
    rows = pd.train + pd.eval
    counts = {k: v for k, v in pd.counts.items() if k not in ("train_rows", "eval_rows")}
    return PhaseData(2, rows, [], {**counts, "pairs": len(rows)}, pd.sources)


def evaluate_saved_reward_model(model: str, data: list[str], batch_size: int, max_seq_len: int, dtype: str = "auto",
                                trust_remote_code: bool = False,
                                log: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """``dschat eval --step 2``: a saved reward model (a stage-2 output folder stands for its ``model/``) on every
    pair of ``data``; the metrics, the data's drop counts and sources."""
    from dschat.data import DataCollatorReward
    from dschat.devices import resolve_dtype
    from dschat.models.loading import create_reward_model, load_tokenizer, resolve_saved_model
    from dschat.training.stage import eval_loader

    path = resolve_saved_model(model, inside=("model",))
    check_reward_checkpoint(path, trust_remote_code)
    tokenizer = load_tokenizer(path, trust_remote_code)
    pairs = load_all_pairs(data, tokenizer, max_seq_len, log=log)
    rm = create_reward_model(path, resolve_dtype(dtype, E.device()), pad_token_id=tokenizer.pad_token_id,
                             trust_remote_code=trust_remote_code)
    rm.to(E.device())
    result = evaluate_reward(rm, eval_loader(pairs.train, batch_size, DataCollatorReward(tokenizer.pad_token_id)))
    return {"model": path, "data": data, "accuracy": result.accuracy,
            "chosen_score": result.chosen_score, "rejected_score": result.rejected_score,
            "margin": result.margin, "score_mean": result.score_mean, "score_std": result.score_std,
            "pairs": result.pairs, "ties": result.ties, **pairs.counts, "sources": pairs.sources}
