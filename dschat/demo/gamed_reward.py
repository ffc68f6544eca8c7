"""A reward that can be gamed, for the health monitor's demo (docs/health.md, A gamed reward): it pays for
length, so a policy trained on it beside the accuracy rule learns to write more instead of answering better.

    dschat train --step 3 --algo grpo ... --reward-funcs accuracy --reward-funcs dschat/demo/gamed_reward.py:verbosity
"""

from __future__ import annotations

from typing import Any


def verbosity(prompts: list[str], completions: list[str], **row_fields: Any) -> list[float]:
    """0.02 per character of the completion, at most 2: more words, more reward, whatever they say."""
    return [min(2.0, 0.02 * len(c)) for c in completions]
