"""Reward-model loss and evaluation, shared by stage 2 (before, during and after training) and ``dschat eval --step 2``.

A reward model here is anything whose forward maps ``(input_ids, attention_mask)`` of shape ``(N, T)`` to
per-token values ``(N, T)``: a ``dschat.reward_model.RewardModel`` or a DeepSpeed engine wrapping one. Batches come
from ``DataCollatorReward``: B chosen rows, then B rejected rows, right-padded.

Metrics (SPEC 4): pairwise accuracy (chosen > rejected, ties count half), mean chosen and rejected end scores,
mean margin, plus the mean and standard deviation of all end scores (chosen and rejected together), which
stage 3 uses to normalise rewards. Every metric is a ratio of sums, all-reduced over ranks, so evaluating
disjoint shards on N ranks gives exactly the single-process numbers.
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
from dschat.data.packing import common_prefix, packed_inputs, shared_prefix_inputs, unpack
from dschat.errors import UserError
from dschat.losses import PairwiseLossOutput, last_token_pairwise_loss, pairwise_loss
from dschat.reward_model import RewardModel
from dschat.stage import EvalLoader, lockstep_batches, to_device


@dataclass
class RewardEval:
    """Reward-model metrics over an evaluation set (SPEC 4)."""

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


def is_reward_checkpoint(path: str, trust_remote_code: bool = False) -> bool:
    """Whether the model folder holds a trained scoring head (saved as ``*ForSequenceClassification``)."""
    from transformers import AutoConfig

    archs = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).architectures or []
    return any(a.endswith("ForSequenceClassification") for a in archs)


def check_reward_checkpoint(path: str, trust_remote_code: bool = False) -> None:
    """Stop with one line unless ``path`` holds a trained reward model: a ``*ForSequenceClassification`` with one
    label (a causal LM would be scored by a randomly initialised head)."""
    from transformers import AutoConfig

    if not is_reward_checkpoint(path, trust_remote_code):
        raise UserError(f"{path}: not a reward model (its config names no *ForSequenceClassification "
                        "architecture); a causal LM would be scored by a random head")
    num_labels = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).num_labels
    if num_labels != 1:
        raise UserError(f"{path}: a reward model has one output label, this one has {num_labels}")


def reward_loss(values: torch.Tensor, batch: dict[str, torch.Tensor], rm_loss: str = "pairwise",
                center_coef: float = 0.0) -> PairwiseLossOutput:
    """The stage-2 loss of one ``DataCollatorReward`` batch from the per-token values ``(2B, T)``: 'pairwise'
    (SPEC 4, divergence-truncated) or 'last-token' (end scores, minus each row's optional 'margin')."""
    chosen, rejected = split_pairs(batch)
    b = chosen["input_ids"].size(0)
    if rm_loss == "last-token":
        scores = RewardModel.end_scores(values, batch["attention_mask"])  # (2B,)
        return last_token_pairwise_loss(scores[:b], scores[b:], batch.get("margin"), center_coef)
    return pairwise_loss(values[:b], values[b:], chosen["input_ids"], rejected["input_ids"],
                         chosen["attention_mask"], rejected["attention_mask"])


def reward_values(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """Per-token values ``(2B, T)`` of a ``DataCollatorReward`` batch, laid out as the right-padded view the losses
    read. The model runs on the packed sequences of a ``--packing`` batch; otherwise on one sequence per pair that
    holds the tokens both rows begin with (the prompt, at least) once (``shared_prefix_layout``: the same values,
    fewer tokens), or on the rows one by one where that layout does not apply (flash attention)."""
    if "packed_index" in batch:
        return unpack(model(**packed_inputs(model, batch, "packed_")), batch["packed_index"])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    shared = shared_prefix_inputs(model, ids, mask, common_prefix(ids, mask))
    if shared is None:
        return model(input_ids=ids, attention_mask=mask)
    inputs, index = shared
    return unpack(model(**inputs), index)


def split_pairs(batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A ``DataCollatorReward`` batch ``(2B, T)`` -> its chosen half and its rejected half, each ``(B, T)``."""
    b = batch["input_ids"].size(0) // 2
    keys = ("input_ids", "attention_mask")
    return {k: batch[k][:b] for k in keys}, {k: batch[k][b:] for k in keys}


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
        values = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])  # (2B, T)
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
