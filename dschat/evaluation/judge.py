"""A generative judge (RM-R1) on held-out judge-pairwise rows: accuracy, unparseable rate, position bias and the
format of its reasoning (``dschat eval --judge``, and the judge pipeline's before/after evaluation)."""

from __future__ import annotations

import time
from typing import Any

from dschat.errors import UserError
from dschat.prompts import read_system_prompt
from dschat.rewards.judge import SamplingArgs, judge_metrics, judge_prompts, load_judge, load_judge_rows, prompt_budget


def evaluate_judge_files(model: str, data: list[str], s: SamplingArgs, system_prompt: str = "", dtype: str = "auto",
                         trust_remote_code: bool = False, progress: bool = True,
                         log: Any = lambda _: None) -> dict[str, Any]:
    """Judge accuracy, unparseable rate and position bias of ``model`` on every row of ``data`` (docs/judge.md). Rows
    that training would drop (empty, malformed) are dropped and counted here too (``dropped_*`` in the result)."""
    s.check()
    system = read_system_prompt(system_prompt) if system_prompt else None
    rows, counts = load_judge_rows(data, system, log)
    if not rows:
        raise UserError(f"no judge rows to evaluate in {', '.join(data)} ({counts})")
    t0 = time.time()
    lm, tok, limit = load_judge(model, dtype, trust_remote_code=trust_remote_code)
    judgements, cut = judge_prompts(lm, tok, [r.messages for r in rows], s, prompt_budget(limit, s.max_new_tokens),
                                    progress=progress)
    metrics = judge_metrics([j.verdict for j in judgements], [r.winner for r in rows])
    # judge_match reads only the verdict, so RL may erode the reasoning format around it: worth watching.
    from dschat.models.loading import resolve_saved_model  # torch: imported when an evaluation runs
    from dschat.rewards.functions import format_reward

    completions = [c for j in judgements for c in j.completions]
    metrics["format_rate"] = sum(format_reward([], completions)) / len(completions)

    metrics.update({"model": resolve_saved_model(model), "data": data, "votes": s.votes,
                    "max_new_tokens": s.max_new_tokens, "temperature": s.temperature if s.votes > 1 else 0.0,
                    "truncated_prompts": cut, **counts, "seconds": round(time.time() - t0, 1),
                    "example": {"where": rows[0].where, "completion": judgements[0].completions[0]}})
    return metrics
