"""``dschat eval --step 3``: a saved policy on held-out prompts, alone or against a baseline.

A whole job of one command, built from stage 3's own parts, so its numbers are the stage's: the held-out prompts
of ``load_phase`` (phase 3, the stage's split and ``--eval-fraction``/``--max-eval-rows``), the frozen models of
``rlhf.engines``, the sampling and per-batch seeds of stage 3's held-out evaluation (``rlhf.evaluation``), the
reward sources of ``rlhf.scoring.build_scorer`` (reward model, rules, user functions, a judge), and the paired
statistics of ``dschat.stats``. The stage's "before" evaluation is this one with the baseline (its step-1 model) as
the policy; its "after" is the trained actor, with KL to that same model.

Per model: the mean reward and its standard error, each source's mean, answer length and EOS rate, and, for
pass/fail sources (rules scoring 0/1, or judge_match's -1/+1) with ``--num-samples n``, pass@k (Chen et al.
2021, unbiased) for k = 1, 2, 4, ... and n. Against a baseline (the same prompts, the same sampling seeds): the
paired gain and its paired standard error, the win rate by reward (ties half), the policy's KL to the baseline on
the policy's own samples, and with ``--judge-model`` the judge's win rate, each pair judged in both orders.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from dschat import engine as E
from dschat.agents.agent import Agent, build_agent
from dschat.data import DataCollatorRLHF, load_phase
from dschat.devices import resolve_dtype
from dschat.errors import UserError
from dschat.generation.decode import GenerationConfig
from dschat.generation.hybrid_engine import make_hybrid_engine
from dschat.models.loading import load_tokenizer, resolve_saved_model
from dschat.rewards.functions import RM
from dschat.rewards.judge import JUDGE, JudgeReward, load_judge_reward, question_of
from dschat.rewards.names import given_or_default, reward_labels
from dschat.rewards.names import reward_sources as sources_of
from dschat.rlhf.config import check_reward_data, check_reward_models
from dschat.rlhf.engines import Models, frozen_models, reward_model_path
from dschat.rlhf.evaluation import SAMPLE_SEED_STRIDE, evaluate
from dschat.rlhf.scoring import build_scorer, same_tokenizer
from dschat.stats import mean_se, paired_se, pass_at_k, win_rate
from dschat.training.stage import eval_loader
from dschat.utils import progress_bar

NOT_PASS_FAIL = (RM, JUDGE, "overlong")  # graded sources: no pass@k


# ---------------------------------------------------------------------------------------------- reward sources
def reward_sources(rewards: Any, agent: Any) -> list[str]:
    """The sources ``dschat eval`` scores with (``rewards`` a ``RewardArgs``, ``agent`` an ``AgentArgs``):
    ``--reward-funcs``, else the environments' reward with ``--env``, else ``rm`` with ``--reward-model``, else
    none (a judge alone compares the two models)."""
    return given_or_default(rewards.reward_funcs, agent.env, [RM] if rewards.reward_model else [])


def check_sources(rewards: Any, agent: Any, baseline: str) -> None:
    """Stop before anything loads when a source lacks its model, or when nothing would score the answers."""
    names = sources_of(reward_sources(rewards, agent))
    check_reward_models(names, rewards)
    if not names and not (rewards.judge_model and baseline):
        raise UserError("dschat eval --step 3 needs something to score the answers with: --reward-model, "
                        "--reward-funcs, or --judge-model with --baseline")


# ---------------------------------------------------------------------------------------------------- metrics
def prompt_means(samples: Sequence[Sequence[float]]) -> list[float]:
    """``samples[j][i]`` (sample j of prompt i) -> the mean over j for each prompt i."""
    n = len(samples)
    return [sum(col) / n for col in zip(*samples, strict=True)] if n else []


def pass_fail(values: Sequence[float]) -> bool:
    """Whether a source's values are pass/fail: all in {0, 1} (format, accuracy, a 0/1 user function) or all in
    {-1, 1} (judge_match). A sample passes when it scores 1."""
    seen = set(values)
    return bool(seen) and (seen <= {0.0, 1.0} or seen <= {-1.0, 1.0})


def ks_for(n: int) -> list[int]:
    """The k of pass@k reported for n samples: 1, 2, 4, ... below n, and n."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def pass_at_ks(samples: Sequence[Sequence[float]]) -> dict[str, dict[str, float]]:
    """pass@k over prompts (``samples[j][i]``, n = ``len(samples)``): per prompt, the unbiased estimate from its
    n samples of which c score 1 (``stats.pass_at_k``), then the mean over prompts and its standard error."""
    n = len(samples)
    passed = [sum(v == 1.0 for v in col) for col in zip(*samples, strict=True)]  # c per prompt
    out = {}
    for k in ks_for(n):
        per_prompt = [pass_at_k(n, c, k) for c in passed]
        out[f"pass@{k}"] = {"value": sum(per_prompt) / len(per_prompt), "se": mean_se(per_prompt)}
    return out


def model_metrics(runs: list[dict[str, Any]], names: list[str], graded: frozenset[str] = frozenset(NOT_PASS_FAIL)
                  ) -> dict[str, Any]:
    """One model's figures from its ``evaluate(..., detail=True)`` results, one per sample index: the reward
    averaged per prompt over the samples, its mean and standard error over prompts, each source's mean, KL (when
    measured), answer length, EOS rate, and with more than one sample pass@k of every pass/fail source. ``names``
    are the sources' labels (``rewards.names.reward_labels``), ``graded`` those of the sources that are no pass or
    fail."""
    out: dict[str, Any] = {}
    if names:
        rewards = prompt_means([r["scores"] for r in runs])
        out.update({"reward": sum(rewards) / len(rewards), "reward_se": mean_se(rewards)})
        if names != [RM]:
            for n in names:
                values = [v for r in runs for v in r["per_prompt"][f"reward/{n}"]]
                out[f"reward/{n}"] = sum(values) / len(values)
    for key, name in (("kl", "kl"), ("length", "answer_length"), ("eos", "eos_rate")):
        values = [v for r in runs for v in r["per_prompt"][key]]
        out[name] = sum(values) / len(values) if values else None
    if out.get("kl") is not None:
        out["kl_se"] = mean_se(prompt_means([r["per_prompt"]["kl"] for r in runs]))
    passes = {}
    for n in names if len(runs) > 1 else []:  # one sample: pass@1 is the source's mean above
        if n in graded:
            continue
        samples = [r["per_prompt"][f"reward/{n}"] for r in runs]
        if pass_fail([v for s in samples for v in s]):
            passes[n] = pass_at_ks(samples)
    if passes:
        out["pass_at_k"] = passes
    return out


def paired_metrics(policy: list[dict[str, Any]], baseline: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """Policy against baseline on the same prompts with the same sampling seeds: the gain in mean reward with
    its paired standard error (``stats.paired_se`` over per-prompt means), the win rate by per-prompt reward
    (ties half), and each source's gain."""
    if not names:
        return {}
    after, before = prompt_means([r["scores"] for r in policy]), prompt_means([r["scores"] for r in baseline])
    wr = win_rate(after, before)
    out: dict[str, Any] = {"reward_gain": sum(after) / len(after) - sum(before) / len(before),
                           "reward_gain_se": paired_se(before, after), "win_rate": wr["rate"],
                           "win_rate_se": wr["se"], "wins": wr["wins"], "ties": wr["ties"], "losses": wr["losses"]}
    if names != [RM]:
        for n in names:
            a = prompt_means([r["per_prompt"][f"reward/{n}"] for r in policy])
            b = prompt_means([r["per_prompt"][f"reward/{n}"] for r in baseline])
            out[f"reward/{n}_gain"] = sum(a) / len(a) - sum(b) / len(b)
            out[f"reward/{n}_gain_se"] = paired_se(b, a)
    return out


def judge_win_metrics(scores: Sequence[Sequence[float]]) -> dict[str, Any]:
    """The judge's verdicts on policy vs baseline (``scores[j][i]``: ``JudgeReward.compare`` of sample j of
    prompt i, the mean of +1/-1/0 over both orders): per prompt the mean over samples s, counted a win when
    s > 0, a tie at 0, a loss below; the win rate is the mean of (s + 1) / 2 (an order won counts 1, a verdict
    that flips with the order or cannot be read 1/2), with its standard error over prompts."""
    s = prompt_means(scores)
    outcome = [(v + 1) / 2 for v in s]
    return {"judge_win_rate": sum(outcome) / len(outcome), "judge_win_rate_se": mean_se(outcome),
            "judge_wins": sum(v > 0 for v in s), "judge_ties": sum(v == 0 for v in s),
            "judge_losses": sum(v < 0 for v in s)}


# ------------------------------------------------------------------------------------------------------ models
def evaluate_policy(cfg: Any, baseline: str = "", num_samples: int = 1,
                    default_data: Callable[[], Sequence[str]] | None = None, progress: bool = True,
                    log: Callable[[str], None] = lambda _: None, baseline_tools: bool = True) -> dict[str, Any]:
    """Sample ``num_samples`` answers per held-out prompt from the policy ``cfg.actor.model`` (and from
    ``baseline``), score them, and return the figures of the module docstring as one JSON-able dict.

    ``cfg`` is the ``RLHFConfig`` the evaluation runs under: its data flags choose the prompts as stage 3 does,
    ``rl`` the sampling (``max_answer_seq_len``, ``temperature``, ``top_p``, ``top_k``, ``generation_backend``),
    ``run.seed`` the split and
    the sampling seeds, ``optim.per_device_eval_batch_size`` the batches (generation is batched, so the same
    batch size gives the stage's exact samples), ``rewards`` the sources (``reward_sources``).
    """
    t0 = time.time()
    r, rl = cfg.rewards, cfg.rl
    entries = reward_sources(r, cfg.agent)
    check_sources(r, cfg.agent, baseline)
    cfg.rewards.reward_funcs = entries  # the scorer's sources are exactly these (no algorithm default)
    names, labels = sources_of(entries), reward_labels(entries)  # what scores; what names its figures
    graded = frozenset(label for label, n in zip(labels, names, strict=True) if n in NOT_PASS_FAIL)
    trust = cfg.model.trust_remote_code
    policy_path = resolve_saved_model(cfg.actor.model)
    baseline_path = resolve_saved_model(baseline) if baseline else ""
    tok = load_tokenizer(policy_path, trust)
    if baseline and not same_tokenizer(tok, load_tokenizer(baseline_path, trust)):
        raise UserError(f"--baseline {baseline_path} must share the policy's tokenizer: both answer the same "
                        "tokenized prompts, and the KL compares their log-probs of the same tokens")
    agent = build_agent(cfg.agent)  # --tools and --env: the policy's answers are episodes
    if agent is not None:
        agent.warm()
    data = load_phase(cfg.data, 3, tok, cfg.run.seed, log=log, default_data=default_data, need_train=False,
                      tools=agent.tool_schemas if agent is not None and agent.tools else None)
    rows = data.eval
    if not rows:
        raise UserError("no held-out prompts: the phase-3 part has no test split and --eval-fraction or "
                        "--max-eval-rows leaves none (to use every row of a file: --data-split 0,0,1 "
                        "--eval-fraction 1 --max-eval-rows 0)")
    check_reward_data(names, rows)
    if agent is not None:
        agent.check_rows(rows)

    dev = E.device()
    dtype = resolve_dtype(cfg.model.dtype, dev)
    # The policy's KL is measured against the baseline (the stage's reference is its step-1 model).
    as_policy = frozen_models(policy_path, tok, dtype, reward_model_path(r.reward_model) if RM in names else "",
                              baseline_path, trust)
    base, reward, rm_tok = as_policy.ref, as_policy.reward, as_policy.reward_tokenizer
    as_baseline = Models(base, None, None, reward, tok, rm_tok, None) if base is not None else None
    scorer = build_scorer(cfg, as_policy) if names else None
    head_to_head = bool(r.judge_model and baseline)
    judge: JudgeReward | None = None
    if head_to_head:  # the reward source 'judge' already loaded this judge: use that copy
        judge = scorer.mixer.funcs.get(JUDGE) if scorer is not None else None  # type: ignore[assignment]
        if judge is None:
            judge = load_judge_reward(r.judge_model, r.judge_max_new_tokens, cfg.data.judge_system_prompt,
                                      cfg.model.dtype, trust, progress=progress)
    gen = GenerationConfig.from_flags(rl)
    loader = eval_loader(rows, cfg.optim.per_device_eval_batch_size, DataCollatorRLHF(tok.pad_token_id))

    bar = progress_bar(progress, len(rows) * num_samples * (2 if base is not None else 1), "sample")
    tick = bar.update if bar is not None else None

    def sample(models: Models, agent: Agent | None) -> list[dict[str, Any]]:
        hybrid = make_hybrid_engine(models.actor, tok, False, rl.generation_backend, cfg.vllm,
                                    max_model_len=cfg.data.max_prompt_seq_len + rl.max_answer_seq_len, agent=agent)
        try:
            return [evaluate(models, hybrid, loader, gen, rl.temperature, cfg.run.seed + j * SAMPLE_SEED_STRIDE,
                             scorer, detail=True, tick=tick) for j in range(num_samples)]
        finally:
            hybrid.close()  # one vLLM engine at a time: the baseline's comes next

    try:
        runs = {"policy": sample(as_policy, agent)}
        if as_baseline is not None:  # without tools: what the tools add (--baseline-without-tools)
            runs["baseline"] = sample(as_baseline, agent if baseline_tools else None)
    finally:
        if bar is not None:
            bar.close()

    out: dict[str, Any] = {
        "policy_model": policy_path, "baseline_model": baseline_path or None,
        "prompts": len(rows), "num_samples": num_samples, "max_new_tokens": rl.max_answer_seq_len,
        "temperature": rl.temperature, "top_p": rl.top_p, "top_k": rl.top_k,
        "generation_backend": rl.generation_backend, "seed": cfg.run.seed,
        "reward_funcs": labels, "reward_weights": scorer.mixer.weights if scorer is not None else [],
        "tools": [t.name for t in agent.tools] if agent is not None else [],
        "envs": list(agent.envs) if agent is not None else [], "baseline_tools": baseline_tools,
        "policy": model_metrics(runs["policy"], labels, graded),
    }
    if "baseline" in runs:
        out["baseline"] = model_metrics(runs["baseline"], labels, graded)
        out["paired"] = paired_metrics(runs["policy"], runs["baseline"], labels)
    if judge is not None:
        scores = []
        for p, b in zip(runs["policy"], runs["baseline"], strict=True):
            questions = [question_of(None, text) for text in p["per_prompt"]["prompts"]]
            scores.append(judge.compare(questions, p["per_prompt"]["completions"], b["per_prompt"]["completions"]))
        out.setdefault("paired", {}).update(judge_win_metrics(scores))
        out["judge_model"] = resolve_saved_model(r.judge_model)
    counts = {k: v for k, v in data.counts.items() if k != "train_rows"}
    out.update({**counts, "sources": data.sources, "seconds": round(time.time() - t0, 1),
                "example": {"prompt": runs["policy"][0]["per_prompt"]["prompts"][0],
                            "policy": runs["policy"][0]["per_prompt"]["completions"][0],
                            **({"baseline": runs["baseline"][0]["per_prompt"]["completions"][0]}
                               if "baseline" in runs else {})}})
    return finite(out)


def finite(x: Any) -> Any:
    """JSON has no NaN: a standard error of fewer than two prompts is written as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [finite(v) for v in x]
    return x
