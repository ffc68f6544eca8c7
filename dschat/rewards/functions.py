"""Reward sources of stage 3 (docs/algorithms.md, Rule rewards): rule functions by name, user functions from a
file, and the mixer.

GRPO and PPO both take them (``--reward-funcs``); PPO's default is the reward model alone.

A reward function scores a batch of completions::

    fn(prompts: list[str], completions: list[str], **row_fields) -> list[float]

``prompts`` and ``completions`` are decoded text (special tokens removed), one entry per completion; a prompt
appears once per completion it received. ``row_fields`` are lists aligned with ``completions``:

- ``answer``: the row's ground truth (``answer`` / ``ground_truth`` / ``solution`` of a prompt-only row, the
  ``winner`` of a judge row), ``None`` where the row has none;
- every other field of the dataset row, by its own name (``winner``, ``context_messages``, ...), ``None`` where
  a row lacks it;
- ``completion_lengths``: completion lengths in tokens (EOS included);
- ``reached_eos``: whether each completion ended with EOS (rather than at the length cap).

Functions take ``**row_fields`` so that they ignore the fields they do not use. They are pure: no model, no
config, no rank. ``rm`` (the reward model's end score) needs a model, so stage 3 computes it and hands the
values to the mixer (``RewardMixer(..., external={"rm": scores})``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dschat.errors import UserError
from dschat.losses import overlong_penalty
from dschat.prompts import ANSWER_CLOSE, ANSWER_OPEN, THINK_CLOSE, THINK_OPEN
from dschat.rewards.judge import LETTER_OF, parse_verdict
from dschat.rewards.names import RM
from dschat.rewards.remote import RemoteReward, is_remote
from dschat.userfiles import is_file_spec, load_object

RewardFunc = Callable[..., list[float]]

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


# ------------------------------------------------------------------------------------------------ rules
def format_reward(prompts: list[str], completions: list[str], **row_fields: Any) -> list[float]:
    """1.0 when each of ``<think>``, ``</think>``, ``<answer>``, ``</answer>`` is present exactly once, in that
    order, else 0.0. Text around the blocks is not judged here: a length or
    content rule does that, and GRPO needs only the tags to find the answer."""
    tags = (THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)
    out = []
    for text in completions:
        once = all(text.count(tag) == 1 for tag in tags)
        ordered = once and [text.index(t) for t in tags] == sorted(text.index(t) for t in tags)
        out.append(1.0 if ordered else 0.0)
    return out


_CURRENCY = "$¥￥€£"
# Units a numeric answer may carry after the number ("42 dollars", "42元", "42%").
_UNIT_RE = re.compile(r"\s*(dollars?|usd|rmb|yuan|cny|元|块钱|块|美元|人民币|%)\s*$", re.IGNORECASE)
_THOUSANDS_RE = re.compile(r"(?<=\d)[,\u202f\u00a0' ](?=\d{3}(?!\d))")
_NUMBER_RE = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")


def normalize_answer(text: str) -> str:
    """Canonical text of an answer: trimmed, without currency symbols, units and thousands separators, and
    without a trailing ``.0`` (``" $1,234.0 dollars"`` -> ``"1234"``); non-numeric text is case-folded with
    runs of whitespace collapsed."""
    s = text.strip().strip(_CURRENCY).strip()
    s = _UNIT_RE.sub("", s).strip().strip(_CURRENCY).strip()
    candidate = _THOUSANDS_RE.sub("", s)
    if _NUMBER_RE.fullmatch(candidate):
        s = candidate
        if "." in s and "e" not in s.lower():
            s = s.rstrip("0").rstrip(".") or "0"
        return s
    return " ".join(s.split()).casefold()


def _as_number(text: str) -> float | None:
    if not _NUMBER_RE.fullmatch(text):
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def answers_match(predicted: str, truth: str) -> bool:
    """Equal after ``normalize_answer``; compared as numbers when both parse (``"78.00"`` == ``"78"``)."""
    a, b = normalize_answer(predicted), normalize_answer(truth)
    x, y = _as_number(a), _as_number(b)
    if x is not None and y is not None:
        return math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9)
    return a == b and a != ""


def extract_answer(completion: str) -> str | None:
    """The content of the last ``<answer>...</answer>`` of a completion, or None."""
    found = _ANSWER_RE.findall(completion)
    return found[-1] if found else None


def accuracy_reward(prompts: list[str], completions: list[str], answer: Sequence[Any] | None = None,
                    **row_fields: Any) -> list[float]:
    """1.0 when the ``<answer>`` content equals the ground truth ``answer`` (see ``answers_match``), else 0.0.

    Every row needs a ground truth: a silent 0 for rows without one would train on nothing.
    """
    if answer is None or any(a is None for a in answer):
        raise UserError("reward 'accuracy' needs a ground truth on every row (an 'answer', 'ground_truth' or "
                        "'solution' field of the prompt-only data)")
    out = []
    for text, truth in zip(completions, answer, strict=True):
        predicted = extract_answer(text)
        out.append(1.0 if predicted is not None and answers_match(predicted, str(truth)) else 0.0)
    return out


def judge_match_reward(prompts: list[str], completions: list[str], winner: Sequence[Any] | None = None,
                       answer: Sequence[Any] | None = None, **row_fields: Any) -> list[float]:
    """RM-R1 (Chen et al. 2025): +1 when the last 80 characters of the completion hold the verdict for the
    row's winner (``<answer>[[A]]</answer>`` for ``model_a``, ``[[B]]`` for ``model_b``) and not the other
    verdict; -1 otherwise, including when neither is there. Only the tail counts, so a verdict quoted in the
    reasoning does not.

    The winner comes from the ``winner`` field, else from ``answer`` (a judge row's ground truth).
    """
    labels = winner if winner is not None and all(w is not None for w in winner) else answer
    if labels is None or any(w not in LETTER_OF for w in labels):
        raise UserError("reward 'judge_match' needs judge rows whose 'winner' is 'model_a' or 'model_b'")
    # The verdict rule lives in dschat.rewards.judge, so `dschat eval --judge` scores exactly what training rewards.
    return [1.0 if parse_verdict(text) == LETTER_OF[w] else -1.0 for text, w in zip(completions, labels, strict=True)]


def overlong_reward(max_len: int, buffer: int, factor: float = 1.0) -> RewardFunc:
    """DAPO's soft overlong punishment (Yu et al. 2025) as a reward function over ``completion_lengths``:
    0 up to ``max_len - buffer`` tokens, then linearly down to ``-factor`` at ``max_len``."""

    def overlong(prompts: list[str], completions: list[str], completion_lengths: Sequence[int] | None = None,
                 **row_fields: Any) -> list[float]:
        if completion_lengths is None:
            raise UserError("reward 'overlong' needs completion_lengths (token counts)")
        lengths = torch.tensor([float(n) for n in completion_lengths])
        return overlong_penalty(lengths, max_len, buffer, factor).tolist()

    return overlong


def env_reward(prompts: list[str], completions: list[str], **row_fields: Any) -> list[float]:
    """The environment's reward of each episode (``--env``: the sum of its turns' rewards; docs/tools.md), 0.0
    where a row had no environment."""
    rewards = row_fields.get("env_reward") or [None] * len(completions)
    return [float(r) if r is not None else 0.0 for r in rewards]


RULES: dict[str, RewardFunc] = {
    "format": format_reward,
    "accuracy": accuracy_reward,
    "judge_match": judge_match_reward,
    "env": env_reward,
}
NAMES = (*RULES, "overlong", RM, "judge")


# ------------------------------------------------------------------------------------------- user functions
def is_user_function(name: str) -> bool:
    return is_file_spec(name)


def load_user_function(spec: str) -> RewardFunc:
    """``path/to/file.py:function_name`` -> the function, imported from that file."""
    fn = load_object(spec, f"reward function {spec!r}")
    if not callable(fn):
        raise UserError(f"reward function {spec!r}: {spec.rpartition(':')[2]!r} is not callable")
    return fn


def get_reward_func(name: str, max_completion_length: int = 256, overlong_buffer: int | None = None,
                    overlong_factor: float = 1.0) -> RewardFunc | None:
    """The function called ``name`` (a rule or ``file.py:function``); None for ``rm``, which stage 3 computes.

    ``overlong`` is bound here to ``max_completion_length`` and its buffer (default a quarter of it).
    """
    if name == RM:
        return None
    if name in RULES:
        return RULES[name]
    if name == "overlong":
        buffer = overlong_buffer if overlong_buffer is not None else max(1, max_completion_length // 4)
        if not 0 < buffer <= max_completion_length:
            raise UserError(f"--overlong-buffer must be in [1, {max_completion_length}] (the longest answer), "
                            f"got {buffer}")
        return overlong_reward(max_completion_length, buffer, overlong_factor)
    if is_user_function(name):
        return load_user_function(name)
    if is_remote(name):  # default client settings; stage 3 passes its own (dschat.rlhf.scoring.build_scorer)
        return RemoteReward(name)
    if name == "judge":  # a model, not a rule: dschat.rewards.judge.load_judge_reward builds it from --judge-model
        raise UserError("reward function 'judge' needs a trained judge: pass --judge-model (stage 3)")
    raise UserError(f"unknown reward function {name!r}; use one of {', '.join(NAMES)}, path/to/file.py:function "
                    "or a reward server's http://host:port/score")


# --------------------------------------------------------------------------------------------------- mixer
@dataclass
class MixedRewards:
    total: torch.Tensor  # (N,) weighted sum over the functions
    per_func: dict[str, torch.Tensor]  # label -> (N,) unweighted values, for logging train/reward/<label>


class RewardMixer:
    """The weighted sum of several reward sources: ``total_i = sum_k w_k * r_k(i)``."""

    def __init__(self, names: Sequence[str], weights: Sequence[float] | None = None,
                 funcs: dict[str, RewardFunc | None] | None = None, labels: Sequence[str] | None = None):
        """``names``: the sources in order; ``weights`` default to 1 each; ``labels`` (default: the sources) name
        each source's values (``per_func``, and so its metrics: ``dschat.rewards.names.reward_labels``) and key
        ``funcs``, which maps each to its function (None for externally computed sources such as ``rm``, whose
        values the caller passes by source); by default they are looked up with ``get_reward_func``."""
        if not names:
            raise UserError("no reward functions selected (--reward-funcs)")
        if len(set(names)) != len(names):
            raise UserError(f"--reward-funcs lists a function twice: {', '.join(names)}")
        weights = list(weights) if weights else [1.0] * len(names)
        if len(weights) != len(names):
            raise UserError(f"{len(weights)} --reward-weights for {len(names)} --reward-funcs "
                            f"({', '.join(names)}); give one weight per function or none")
        self.sources = list(names)
        self.names = list(labels) if labels is not None else list(names)  # the labels
        if len(self.names) != len(self.sources) or len(set(self.names)) != len(self.names):
            raise ValueError(f"one distinct label per reward source: {self.names} for {self.sources}")
        self.weights = [float(w) for w in weights]
        self.funcs = funcs if funcs is not None else \
            {label: get_reward_func(n) for label, n in zip(self.names, self.sources, strict=True)}

    @property
    def external(self) -> list[str]:
        """Sources whose values the caller supplies (e.g. ``rm``)."""
        return [n for label, n in zip(self.names, self.sources, strict=True) if self.funcs.get(label) is None]

    def __call__(self, prompts: list[str], completions: list[str], external: dict[str, Any] | None = None,
                 **row_fields: Any) -> MixedRewards:
        n = len(completions)
        per_func: dict[str, torch.Tensor] = {}
        for name, source in zip(self.names, self.sources, strict=True):
            fn = self.funcs.get(name)
            if fn is None:
                if external is None or source not in external:
                    raise ValueError(f"reward source {source!r} is computed by the caller; pass external={{...}}")
                values = external[source]
            else:
                values = _call(source, fn, prompts, completions, row_fields)
            per_func[name] = _check_values(source, values, n)
        total = torch.zeros(n)
        for name, w in zip(self.names, self.weights, strict=True):
            total = total + w * per_func[name]
        return MixedRewards(total, per_func)


def _call(name: str, fn: RewardFunc, prompts: list[str], completions: list[str],
          row_fields: dict[str, Any]) -> Any:
    """``fn`` on the batch; when it raises, one line naming the function, the first row it fails on (found by
    calling it row by row) and the exception, instead of a traceback from inside the user's file."""
    try:
        return fn(prompts, completions, **row_fields)
    except UserError:
        raise
    except Exception as batch_error:  # noqa: BLE001 - the user's code may raise anything
        failure: tuple[int, BaseException] | None = None
        for i in range(min(len(completions), 256)):
            fields = {k: v[i: i + 1] if isinstance(v, list | tuple) else v for k, v in row_fields.items()}
            try:
                fn(prompts[i: i + 1], completions[i: i + 1], **fields)
            except Exception as e:  # noqa: BLE001
                failure = (i, e)
                break
        i, error = failure if failure is not None else (None, batch_error)
        row = (f"on row {i} of the batch (prompt {_snippet(prompts[i])}, completion {_snippet(completions[i])})"
               if i is not None else f"on a batch of {len(completions)} completions")
        first = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
        raise UserError(f"reward function {name!r} raised {type(error).__name__}: {first} {row}") from None


def _snippet(text: str, n: int = 60) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= n else text[: n - 3] + "...")


def _check_values(name: str, values: Any, n: int) -> torch.Tensor:
    try:
        t = torch.as_tensor(values if isinstance(values, torch.Tensor) else list(values),
                            dtype=torch.float32).detach().cpu().flatten()
    except (TypeError, ValueError) as e:
        raise UserError(f"reward function {name!r} must return a list of numbers: {e}") from None
    if t.numel() != n:
        raise UserError(f"reward function {name!r} returned {t.numel()} values for {n} completions")
    if not torch.isfinite(t).all():
        raise UserError(f"reward function {name!r} returned a non-finite value")
    return t


def parse_weights(values: Sequence[str | float]) -> list[float]:
    """``--reward-weights`` arrive as strings (repeatable flags); floats, with a clear error otherwise."""
    out = []
    for v in values:
        try:
            out.append(float(v))
        except (TypeError, ValueError):
            raise UserError(f"--reward-weights expects numbers, got {v!r}") from None
    return out
