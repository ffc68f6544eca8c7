"""Stage 3's held-out evaluation: the policy's sampled answers to held-out prompts scored by every reward source,
before and after training, and the before/after part of stage 3's ``eval.json``.

It lives with what it evaluates: it samples with ``rollout`` and scores with ``scoring``, and the algorithms
(``onpolicy``, ``dpo``) and ``step3_rlhf/main.py`` call it. ``dschat eval --step 3`` (``dschat.apps.saved_policy``)
evaluates a saved policy with the same function, so its numbers are the stage's."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from dschat import engine as E
from dschat.rewards.functions import RM
from dschat.rlhf.rollout import answer_logprobs, completion_texts, generate_rollout
from dschat.rlhf.scoring import Scorer
from dschat.stats import paired_se
from dschat.training import memory
from dschat.training.stage import lockstep_batches, to_device
from dschat.utils import progress_bar

SAMPLE_SEED_STRIDE = 100_003  # sample j of a prompt is drawn with the batch seeds of sample 0 plus j * stride
SAMPLES_KEPT = 8  # answers kept as text (``"samples"``) for the trackers' tables, from the main rank's first batch


@torch.no_grad()
@memory.phase("eval")
def evaluate(models: Any, hybrid: Any, loader: Any, gen: Any, temperature: float, seed: int,
             scorer: Scorer | None, detail: bool = False, tick: Callable[[int], None] | None = None,
             num_samples: int = 1, progress: bool = False) -> dict[str, Any]:
    """Mean reward (with its standard error) and the mean of each reward source, KL to the reference (when there
    is one) and answer length on held-out prompts, ``num_samples`` completions per prompt.

    Sampling uses a fixed seed per batch (sample j: plus ``j * SAMPLE_SEED_STRIDE``, as ``dschat eval
    --num-samples``), so before/after evaluations draw the same random numbers. With several samples a prompt's
    reward (and each source's) is the mean of its samples: ``scores`` holds one value per prompt, and the
    standard errors (``reward_se`` here, the paired one of ``summarize``) are over prompts; KL, length and EOS
    rate are means over every answer. ``scorer`` None: no reward (``dschat eval`` with a judge alone).
    ``detail`` (one sample only): also the per-prompt values under ``"per_prompt"`` (each source's reward, KL,
    length, EOS, and the decoded prompts and completions), for ``dschat eval``'s paired statistics; ``tick(n)``
    after each batch of n answers (the caller's progress bar), or with ``progress`` a bar of this one (main rank).
    On the main rank ``"samples"`` holds the first ``SAMPLES_KEPT`` prompts with their first answer and its reward
    (``prompt``, ``answer``, ``reward``), for the trackers' tables (``RunTracker.log_samples``).
    """
    if detail and num_samples != 1:
        raise ValueError("evaluate(detail=True) reports one sample per prompt; call it once per sample")
    bar = None
    if tick is None:
        rows = len(getattr(getattr(loader, "loader", None), "dataset", ()))  # this rank's held-out rows
        bar = progress_bar(progress and E.is_main(), rows * num_samples, "eval", leave=False)  # under training's
        tick = bar.update if bar is not None else None
    try:
        runs = [_sample_once(models, hybrid, loader, gen, temperature, seed + j * SAMPLE_SEED_STRIDE, scorer,
                             detail, tick, keep=SAMPLES_KEPT if j == 0 else 0) for j in range(num_samples)]
    finally:
        if bar is not None:
            bar.close()
    t, texts, samples = runs[0]
    if num_samples > 1:  # per prompt: the mean over its samples (rewards); every answer counts (KL, length, EOS)
        t = {k: (torch.cat([r[k] for r, _, _ in runs]) if k in ("kl", "length", "eos")
                 else torch.stack([r[k] for r, _, _ in runs]).mean(0)) for k in t}
    names = scorer.mixer.names if scorer is not None else []

    def mean(x: torch.Tensor) -> float | None:
        return x.mean().item() if len(x) else None

    s = t["scores"]
    std = s.std().item() if len(s) > 1 else 0.0
    out: dict[str, Any] = {"scores": s.tolist(), "reward": mean(s),
                           "reward_se": std / math.sqrt(len(s)) if len(s) else None,
                           "reward_std": std if len(s) else None, "kl": mean(t["kl"]),
                           "answer_length": mean(t["length"]), "eos_rate": mean(t["eos"]),
                           "eval_prompts": len(t["eos"]) // num_samples,
                           "eval_samples": num_samples}
    if names and names != [RM]:
        out.update({f"reward/{n}": mean(t[n]) for n in names})
        out["source_scores"] = {n: t[n].tolist() for n in names}  # per prompt, for each source's paired s.e.
    if detail:
        out["per_prompt"] = {**{f"reward/{n}": t[n].tolist() for n in names}, "kl": t["kl"].tolist(),
                             "length": t["length"].tolist(), "eos": t["eos"].tolist(), **texts}
    if samples:
        out["samples"] = samples
    return out


def _sample_once(models: Any, hybrid: Any, loader: Any, gen: Any, temperature: float, seed: int,
                 scorer: Scorer | None, detail: bool, tick: Callable[[int], None] | None,
                 keep: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, list[str]], list[dict[str, Any]]]:
    """One answer per held-out prompt: every rank's per-prompt values (``"scores"``, each source, KL, length,
    EOS), with ``detail`` the decoded prompts and completions, and on the main rank the first ``keep`` prompts
    with their answer and reward as text (decoded from this rank's first batches only)."""
    names = scorer.mixer.names if scorer is not None else []
    cols: dict[str, list[Any]] = {"scores": [], "kl": [], "length": [], "eos": [], **{n: [] for n in names}}
    texts: dict[str, list[str]] = {"prompts": [], "completions": []}
    samples: list[dict[str, Any]] = []
    keep = keep if E.is_main() else 0
    was_training = models.actor.training
    models.actor.eval()
    # Lockstep: under ZeRO-3 the gather around generate and every forward are collectives on all ranks.
    for i, (batch, real) in enumerate(lockstep_batches(loader)):
        batch = to_device(batch, E.device())
        rollout, _ = generate_rollout(hybrid, models.tokenizer, batch, gen, seed=seed + i, min_answer_len=1)
        mask = rollout.action_mask.float()
        kl = None
        if models.ref is not None:
            logp = answer_logprobs(models.actor, rollout, temperature)
            ref = answer_logprobs(models.ref, rollout, temperature)
            kl = ((logp - ref) * mask).sum(-1)  # per-sequence KL estimate (k1 summed over tokens)
        mixed = scorer(rollout, batch) if scorer is not None else None
        if not real:
            continue
        if kl is not None:
            cols["kl"] += kl.tolist()
        if mixed is not None:
            cols["scores"] += mixed.total.tolist()
            for name in names:
                cols[name] += mixed.per_func[name].tolist()
        cols["length"] += mask.sum(-1).tolist()
        cols["eos"] += rollout.reached_eos.float().tolist()
        if detail or len(samples) < keep:
            prompts, completions, _ = completion_texts(models.tokenizer, rollout, batch["prompt_att_mask"])
            if detail:
                texts["prompts"] += prompts
                texts["completions"] += completions
            rewards = mixed.total.tolist() if mixed is not None else [None] * len(prompts)
            samples += [{"prompt": p, "answer": a, "reward": r}
                        for p, a, r in zip(prompts, completions, rewards, strict=True)][:keep - len(samples)]
        if tick is not None:
            tick(rollout.sequences.shape[0])
    if was_training:
        models.actor.train()
    gathered = E.gather_objects(cols)
    t = {k: torch.tensor([v for part in gathered for v in part[k]]) for k in cols}
    if detail:
        every = E.gather_objects(texts)
        texts = {k: [x for part in every for x in part[k]] for k in texts}
    return t, texts, samples


PER_PROMPT = ("scores", "source_scores", "per_prompt", "samples")


def eval_scalars(result: dict[str, Any]) -> dict[str, Any]:
    """An evaluation's loggable scalars (``eval/...``): everything but the per-prompt scores (and details)."""
    return {f"eval/{k}": v for k, v in result.items() if k not in PER_PROMPT}


def summarize(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The before/after part of stage 3's ``eval.json``: rewards with their standard errors, the paired gain,
    KL, answer length and EOS rate, and each reward source's mean when there is more than the reward model."""
    both = before.get("scores") is not None and after.get("scores") is not None
    out: dict[str, Any] = {
        "reward_before": before.get("reward"), "reward_after": after.get("reward"),
        "reward_before_se": before.get("reward_se"), "reward_after_se": after.get("reward_se"),
        "reward_gain": (after["reward"] - before["reward"]) if both else None,
        "reward_gain_se": paired_se(before["scores"], after["scores"]) if both else None,
        "kl_before": before.get("kl"), "kl_after": after.get("kl"),
        "answer_length_before": before.get("answer_length"), "answer_length_after": after.get("answer_length"),
        "eos_rate_before": before.get("eos_rate"), "eos_rate_after": after.get("eos_rate"),
        "eval_prompts": after.get("eval_prompts"), "eval_samples": after.get("eval_samples"),
    }
    return out


def source_summary(before: dict[str, Any], after: dict[str, Any], scorer: Scorer) -> dict[str, Any]:
    """The reward sources and weights, and each source's mean before/after (when there is more than ``rm``), with
    the paired standard error of its gain (the same prompts and sampling seeds before and after): a demo whose
    total rises only through ``format`` shows it here."""
    out: dict[str, Any] = {"reward_funcs": scorer.mixer.names, "reward_weights": scorer.mixer.weights}
    for name in scorer.mixer.names:
        if f"reward/{name}" in after:
            out[f"reward_{name}_before"] = before.get(f"reward/{name}")
            out[f"reward_{name}_after"] = after[f"reward/{name}"]
            b, a = (before.get("source_scores") or {}).get(name), (after.get("source_scores") or {}).get(name)
            if b is not None and a is not None and len(a) == len(b) > 1:
                out[f"reward_{name}_gain_se"] = paired_se(b, a)
    return out
