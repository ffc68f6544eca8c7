"""Generative judges (RM-R1, Chen et al. 2025, arXiv:2505.02387): prompts, verdicts, batched judging, votes.

A judge reads a user message holding a question and two answers between markers, reasons, and ends with
``<answer>[[A]]</answer>`` or ``<answer>[[B]]</answer>``. This module is what every consumer of a judge shares:

- ``parse_verdict``: the verdict of a completion by the rule ``judge_match`` trains with (docs/algorithms.md, Rule
  rewards: only the last 80 characters count, one label present and the other absent), so evaluation scores what
  training rewarded;
- ``swap_answers`` / ``balance_rows``: exchange answers A and B inside a user message (two marker styles), used
  to balance a judge file's winners (a judge trained on a skewed file learns the position, not the answer);
- ``generate_completions`` / ``judge_prompts``: left-padded batched generation with k samples per prompt and a
  majority vote (``dschat eval --judge``, ``dschat judge``);
- ``JudgeReward``: a trained judge as a stage-3 reward source (reward function ``judge``, for GRPO and PPO
  alike), asked in both orders.

Importing it is cheap: torch and transformers are imported inside the functions that need them.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dschat.devices import forked_rng, pick_device, resolve_dtype, seed_generators
from dschat.errors import UserError
from dschat.prompts import (
    ASSISTANT_SUFFIX,
    EN_RUBRIC,
    HUMAN_PREFIX,
    ZH_RUBRIC,
    Messages,
    is_english,
    judge_user_message,
    read_system_prompt,
)
from dschat.rewards.names import JUDGE
from dschat.utils import progress_bar

TAIL_CHARS = 80  # RM-R1 reads the verdict from the end of the completion only
VERDICTS = {"A": "<answer>[[A]]</answer>", "B": "<answer>[[B]]</answer>"}
WINNER_OF = {"A": "model_a", "B": "model_b"}
LETTER_OF = {"model_a": "A", "model_b": "B"}

# Start/end markers around the two answers, per style: the demo's (MT-Bench's) "Assistant A's Answer", RM-R1's
# single-turn "Chatbot A's Response" and its multi-turn conversation blocks. ``{X}`` is A or B.
MARKER_STYLES: tuple[tuple[str, str], ...] = (
    ("[The Start of Assistant {X}'s Answer]", "[The End of Assistant {X}'s Answer]"),
    ("[The Start of Chatbot {X}'s Response]", "[The End of Chatbot {X}'s Response]"),
    ("[The Start of the Conversation between Chatbot {X} and the Client]",
     "[The End of the Conversation between Chatbot {X} and the Client]"),
)


# ------------------------------------------------------------------------------------------------ verdicts
def parse_verdict(completion: str) -> str | None:
    """``"A"``, ``"B"`` or None: the label whose ``<answer>[[X]]</answer>`` is in the last 80 characters while
    the other's is not. A verdict quoted earlier in the reasoning does not count; both or neither is None."""
    tail = completion[-TAIL_CHARS:]
    a, b = VERDICTS["A"] in tail, VERDICTS["B"] in tail
    if a == b:
        return None
    return "A" if a else "B"


def majority_verdict(verdicts: Sequence[str | None]) -> str | None:
    """The label most of the parseable verdicts give; a tie, or no parseable verdict, is None (unparseable)."""
    counts = Counter(v for v in verdicts if v is not None)
    if counts["A"] == counts["B"]:
        return None
    return "A" if counts["A"] > counts["B"] else "B"


# ------------------------------------------------------------------------------------------------- prompts
def _find_blocks(text: str) -> tuple[int, int, int, int] | None:
    """Content spans ``(a_start, a_end, b_start, b_end)`` of answers A and B, or None when no marker style has
    each of its four markers exactly once, A's block closed before B's opens (or B's before A's)."""
    for start, end in MARKER_STYLES:
        marks = [start.format(X="A"), end.format(X="A"), start.format(X="B"), end.format(X="B")]
        if any(text.count(m) != 1 for m in marks):
            continue
        sa, ea, sb, eb = (text.index(m) for m in marks)
        if not (sa < ea and sb < eb and (ea < sb or eb < sa)):
            continue
        return sa + len(marks[0]), ea, sb + len(marks[2]), eb
    return None


def swap_answers(text: str) -> str | None:
    """``text`` with the contents of the A and B blocks exchanged (markers and everything else unchanged), or
    None when the markers are not found (see ``MARKER_STYLES``)."""
    spans = _find_blocks(text)
    if spans is None:
        return None
    a0, a1, b0, b1 = spans
    a, b = text[a0:a1], text[b0:b1]
    if a1 < b0:
        return text[:a0] + b + text[a1:b0] + a + text[b1:]
    return text[:b0] + a + text[b1:a0] + b + text[a1:]


def answer_message_index(messages: Messages) -> int | None:
    """Index of the (last) message holding both answers' markers: normally the user turn."""
    for i in range(len(messages) - 1, -1, -1):
        if _find_blocks(messages[i].get("content", "")) is not None:
            return i
    return None


def swap_row(row: dict[str, Any]) -> dict[str, Any] | None:
    """A judge row with answers A and B exchanged and the winner flipped; None when the markers are missing.

    A cold-start ``response`` (a target judge completion) cannot be swapped faithfully (its reasoning names the
    positions), so a row carrying one is refused rather than left contradicting its new winner.
    """
    messages = row.get("context_messages")
    if not isinstance(messages, list) or row.get("winner") not in LETTER_OF:
        return None
    i = answer_message_index(messages)
    if i is None or any(row.get(k) for k in ("response", "completion")):
        return None
    swapped = swap_answers(messages[i]["content"])
    assert swapped is not None
    new_messages = [dict(m) for m in messages]
    new_messages[i]["content"] = swapped
    return {**row, "context_messages": new_messages, "winner": "model_b" if row["winner"] == "model_a" else "model_a"}


@dataclass
class BalanceReport:
    rows: int  # rows written
    before: dict[str, int]  # winner -> count, of the rows written, before swapping
    after: dict[str, int]
    swapped: int
    skipped: int  # rows whose markers were not found (dropped with --skip-unparseable)
    skipped_where: list[str] = field(default_factory=list)


def balance_rows(rows: list[dict[str, Any]], seed: int, skip_unparseable: bool = False,
                 where: Callable[[int], str] = lambda i: f"row {i}") -> tuple[list[dict[str, Any]], BalanceReport]:
    """Swap A and B (and flip the winner) in a seeded subset of the majority winner's rows, so that the two
    winners end up at floor(n/2) and ceil(n/2) (the majority keeps the extra row), with the fewest swaps.

    Rows whose markers cannot be found stop with an error naming ``where(i)``; with ``skip_unparseable`` they are
    dropped and counted. Row order is kept.
    """
    kept: list[tuple[int, dict[str, Any]]] = []
    skipped: list[str] = []
    for i, row in enumerate(rows):
        if row.get("winner") not in LETTER_OF:
            raise UserError(f"{where(i)}: field 'winner' must be 'model_a' or 'model_b', got {row.get('winner')!r}")
        if swap_row(row) is None:
            if not skip_unparseable:
                raise UserError(f"{where(i)}: cannot find answers A and B (markers such as \"[The Start of "
                                "Assistant A's Answer]\" or \"[The Start of Chatbot A's Response]\", each once) in "
                                "context_messages, or the row has a cold-start response; pass --skip-unparseable "
                                "to drop such rows")
            skipped.append(where(i))
            continue
        kept.append((i, row))
    before = Counter(r["winner"] for _, r in kept)
    n = len(kept)
    major = "model_a" if before["model_a"] >= before["model_b"] else "model_b"
    k = before[major] - math.ceil(n / 2)  # swaps that bring the majority down to ceil(n/2)
    candidates = [j for j, (_, r) in enumerate(kept) if r["winner"] == major]
    chosen = set(random.Random(seed).sample(candidates, k)) if k > 0 else set()
    out = [swap_row(r) if j in chosen else r for j, (_, r) in enumerate(kept)]
    after = Counter(r["winner"] for r in out if r is not None)
    report = BalanceReport(n, {w: before[w] for w in ("model_a", "model_b")},
                           {w: after[w] for w in ("model_a", "model_b")}, len(chosen), len(skipped), skipped)
    return [r for r in out if r is not None], report


def judge_messages(question: str, answer_a: str, answer_b: str, system: str | None = None) -> Messages:
    """The messages of the demo judge rows for a question and two answers: a rubric system message (``system``,
    else the demo rubric in the question's language, as the demo judge was trained with) and the user turn of
    ``dschat.prompts.judge_user_message``."""
    english = is_english(question)
    rubric = system if system else (EN_RUBRIC if english else ZH_RUBRIC)
    user = judge_user_message(question.strip(), answer_a.strip(), answer_b.strip(), english)
    return [{"role": "system", "content": rubric}, {"role": "user", "content": user}]


# ---------------------------------------------------------------------------------------------- generation
@dataclass
class SamplingArgs:
    """How a judge generates. ``votes`` 1 is greedy; more samples ``votes`` completions at ``temperature``."""

    max_new_tokens: int = 128
    votes: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    batch_size: int = 16
    seed: int = 1234
    backend: str = "auto"  # --generation-backend: auto = vLLM on a GPU where installed, else HF generate

    def check(self) -> None:
        if self.votes < 1 or self.max_new_tokens < 1 or self.batch_size < 1:
            raise UserError("--votes, --max-new-tokens and --batch-size must be at least 1")
        if self.votes > 1 and self.temperature <= 0:
            raise UserError("--votes > 1 samples, so --temperature must be > 0")


def encode_prompts(tokenizer: Any, prompts: Sequence[str | Messages], max_len: int | None) -> tuple[
        list[list[int]], int]:
    """Token ids of rendered prompts (``render_prompt``: chat template or Human/Assistant), left-truncated to
    ``max_len`` (the question's end and the answers are at the end). Returns the ids and how many were cut."""
    from dschat.data.formats import render_prompt  # dschat.data imports torch (start-up cost)
    from dschat.data.usertext import encode_texts, keep_end, prompt_parts, single_bos

    texts = [render_prompt(p, tokenizer) for p in prompts]
    ids = encode_texts(tokenizer, texts, [prompt_parts(p) for p in prompts], True)  # user text stays text
    bos = tokenizer.bos_token_id
    out = [single_bos(row, bos) for row in ids]
    if max_len is None:
        return out, 0
    return [keep_end(row, max_len, bos) for row in out], sum(len(row) > max_len for row in out)


def generate_completions(model: Any, tokenizer: Any, prompt_ids: list[list[int]], s: SamplingArgs,
                         progress: bool = False, desc: str = "judge") -> list[list[str]]:
    """``s.votes`` completions per prompt (greedy when 1), decoded up to the first EOS with special tokens
    dropped, exactly as stage 3 decodes a completion for its reward functions.

    Prompts are sorted by length and left-padded per batch (generation starts in one column); each batch's
    sampling is seeded from ``s.seed`` and its index, so a run is reproducible and leaves the global RNG as it
    found it.
    """
    import torch

    from dschat.data.collators import pad_sequences  # torch, as above
    from dschat.generation.backends import generate, make_backend
    from dschat.generation.decode import GenerationConfig, Prompts, decode_answers

    device = next(model.parameters()).device
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    out: list[list[str]] = [[] for _ in prompt_ids]
    sample = s.votes > 1
    # Off a GPU, HF's generate as the backend (auto): a judge's verdicts stay those it has always given. A prompt's
    # votes are its row repeated, as ``num_return_sequences`` would expand it.
    backend = make_backend(s.backend, model, fallback="hf")
    gen = GenerationConfig(max_new_tokens=s.max_new_tokens, do_sample=sample, temperature=s.temperature,
                           top_p=s.top_p, top_k=0)
    batches = [order[i: i + s.batch_size] for i in range(0, len(order), s.batch_size)]
    bar = progress_bar(progress, len(prompt_ids), desc)
    was_training = model.training
    model.eval()
    try:
        with forked_rng():  # the caller's CPU and CUDA streams stay where they were
            for b, idx in enumerate(batches):
                ids, mask = pad_sequences([prompt_ids[i] for i in idx], tokenizer.pad_token_id, "left")
                seed_generators(s.seed + b)
                ids, mask = ids.repeat_interleave(s.votes, 0).to(device), mask.repeat_interleave(s.votes, 0).to(device)
                with torch.inference_mode():
                    seqs = generate(backend, model, Prompts(ids, mask, tokenizer.eos_token_id, tokenizer.pad_token_id),
                                    gen).sequences
                texts, _ = decode_answers(tokenizer, seqs[:, ids.shape[1]:])
                for j, i in enumerate(idx):
                    out[i] = texts[j * s.votes: (j + 1) * s.votes]
                if bar is not None:
                    bar.update(len(idx))
    finally:
        if was_training:
            model.train()
        if bar is not None:
            bar.close()
        backend.close()  # a vLLM engine lives for this call
    return out


@dataclass
class Judgement:
    verdict: str | None  # "A", "B" or None (unparseable, or a tied vote)
    completions: list[str]
    verdicts: list[str | None]


def judge_prompts(model: Any, tokenizer: Any, prompts: Sequence[str | Messages], s: SamplingArgs,
                  max_prompt_len: int | None = None, progress: bool = False) -> tuple[list[Judgement], int]:
    """Judge each prompt (k votes, majority over the parseable ones). Returns the judgements and the number of
    prompts left-truncated to ``max_prompt_len``."""
    ids, cut = encode_prompts(tokenizer, prompts, max_prompt_len)
    completions = generate_completions(model, tokenizer, ids, s, progress)
    out = []
    for texts in completions:
        verdicts = [parse_verdict(t) for t in texts]
        out.append(Judgement(majority_verdict(verdicts), texts, verdicts))
    return out, cut


# -------------------------------------------------------------------------------------------------- metrics
def judge_metrics(verdicts: Sequence[str | None], winners: Sequence[str]) -> dict[str, Any]:
    """Accuracy (an unparseable verdict counts as wrong) with its binomial standard error, the unparseable rate,
    the accuracy on rows whose winner is A and on rows whose winner is B, and their difference (position bias:
    a judge that prefers a position scores high on one and low on the other)."""
    if len(verdicts) != len(winners):
        raise ValueError("one verdict per row")
    n = len(verdicts)
    correct = [v is not None and WINNER_OF[v] == w for v, w in zip(verdicts, winners, strict=True)]

    def acc(rows: list[int]) -> float | None:
        return sum(correct[i] for i in rows) / len(rows) if rows else None

    accuracy = acc(list(range(n)))
    a_rows = [i for i, w in enumerate(winners) if w == "model_a"]
    b_rows = [i for i, w in enumerate(winners) if w == "model_b"]
    acc_a, acc_b = acc(a_rows), acc(b_rows)
    return {
        "n": n, "accuracy": accuracy,
        "accuracy_se": math.sqrt(accuracy * (1 - accuracy) / n) if accuracy is not None else None,
        "unparseable_rate": sum(v is None for v in verdicts) / n if n else None,
        "accuracy_when_a": acc_a, "accuracy_when_b": acc_b,
        "position_bias": acc_a - acc_b if acc_a is not None and acc_b is not None else None,
        "rows_winner_a": len(a_rows), "rows_winner_b": len(b_rows),
        "predicted_a": sum(v == "A" for v in verdicts), "predicted_b": sum(v == "B" for v in verdicts),
        "correct": [int(c) for c in correct],
    }


# ------------------------------------------------------------------------------------------ loading a judge
def load_judge(model: str, dtype: str = "auto", device: Any = None, trust_remote_code: bool = False) -> tuple[
        Any, Any, int | None]:
    """A judge as a plain HF causal LM in eval mode on ``device`` (default: CUDA when there is one), its
    tokenizer, and the longest sequence it takes (None when its config does not say). A stage output folder
    stands for its ``actor/`` or ``model/``."""
    from dschat.models.loading import create_causal_lm, load_tokenizer, max_positions, resolve_saved_model  # torch

    path = resolve_saved_model(model)
    dev = device if device is not None else pick_device("auto")
    tokenizer = load_tokenizer(path, trust_remote_code)
    try:
        lm = create_causal_lm(path, resolve_dtype(dtype, dev), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot load a causal LM judge ({str(e).strip().splitlines()[0][:200]})") from None
    lm.to(dev).eval()
    for p in lm.parameters():
        p.requires_grad_(False)
    return lm, tokenizer, max_positions(lm.config, tokenizer)


def prompt_budget(limit: int | None, max_new_tokens: int) -> int | None:
    if limit is None:
        return None
    if limit - max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt: the judge takes {limit} "
                        "positions in all")
    return limit - max_new_tokens


# ----------------------------------------------------------------------------------------- reward source
def question_of(row_prompt: Any, decoded_prompt: str) -> str:
    """The question a policy answered, for the judge's user message: the ``Human:`` turn of an rm-static prompt,
    the last user message of a message list, else the decoded prompt as the policy saw it."""
    if isinstance(row_prompt, list):
        users = [m.get("content", "") for m in row_prompt if isinstance(m, dict) and m.get("role") == "user"]
        if users:
            return users[-1]
    text = row_prompt if isinstance(row_prompt, str) and row_prompt.strip() else decoded_prompt
    cut = text.rfind(HUMAN_PREFIX.strip())
    if cut >= 0:
        text = text[cut + len(HUMAN_PREFIX.strip()):]
    if text.rstrip().endswith(ASSISTANT_SUFFIX.strip()):
        text = text.rstrip()[: -len(ASSISTANT_SUFFIX.strip())]
    return text.strip()


class JudgeReward:
    """A trained judge as a reward function (``dschat.rewards.functions.RewardFunc``): each completion is compared with
    the row's reference ``answer`` twice, as answer A and as answer B, and earns the mean of +1 (judged better),
    -1 (judged worse) and 0 (unparseable) over the two orders. Asking in both orders cancels the judge's
    position bias: a judge that always says A gives every completion 0, not +1.

    ``generate(prompts) -> verdicts`` is injectable, so the scoring rule is tested without a model.
    """

    __name__ = JUDGE

    def __init__(self, judge: Callable[[list[Messages]], list[str | None]], system: str | None = None):
        self.judge = judge
        self.system = system

    def __call__(self, prompts: list[str], completions: list[str], answer: Sequence[Any] | None = None,
                 prompt: Sequence[Any] | None = None, **row_fields: Any) -> list[float]:
        if answer is None or any(a is None or not str(a).strip() for a in answer):
            raise UserError("reward 'judge' needs a reference answer on every row (the 'answer' field of "
                            "prompt-only rows) to compare the policy's completion with")
        row_prompts = list(prompt) if prompt is not None else [None] * len(prompts)
        questions = [question_of(raw, decoded) for decoded, raw in zip(prompts, row_prompts, strict=True)]
        return self.compare(questions, completions, [str(a) for a in answer])

    def compare(self, questions: Sequence[str], completions: Sequence[str], others: Sequence[str]) -> list[float]:
        """Each completion against the other answer to its question, in both orders: the mean of +1 (judged
        better), -1 (worse) and 0 (unparseable) over the completion as A and as B. ``dschat eval --step 3``
        compares a policy's answers with a baseline's this way."""
        queries: list[Messages] = []
        for question, completion, other in zip(questions, completions, others, strict=True):
            queries.append(judge_messages(question, completion, other, self.system))  # completion as A
            queries.append(judge_messages(question, other, completion, self.system))  # completion as B
        verdicts = self.judge(queries)
        out = []
        for i in range(len(completions)):
            as_a, as_b = verdicts[2 * i], verdicts[2 * i + 1]
            first = 0.0 if as_a is None else (1.0 if as_a == "A" else -1.0)
            second = 0.0 if as_b is None else (1.0 if as_b == "B" else -1.0)
            out.append((first + second) / 2)
        return out


def load_judge_reward(model: str, max_new_tokens: int = 128, system_prompt_file: str = "", dtype: str = "auto",
                      trust_remote_code: bool = False, batch_size: int = 32, progress: bool = False) -> JudgeReward:
    """The reward function ``judge`` of stage 3: the judge at ``model`` (greedy, so a completion's reward does
    not depend on sampling noise) on this rank's device. It is a plain frozen module, not a DeepSpeed engine:
    each rank holds a copy and judges its own completions. ``progress``: a bar per call (``dschat eval``)."""
    from dschat import engine as E  # deepspeed: imported only when a run uses a judge

    lm, tok, limit = load_judge(model, dtype, E.device(), trust_remote_code)
    # HF's generate: the run's --generation-backend names the actor's sampler, and a second vLLM engine in the
    # process would compete with it for memory
    s = SamplingArgs(max_new_tokens=max_new_tokens, votes=1, batch_size=batch_size, backend="hf")
    budget = prompt_budget(limit, max_new_tokens)
    system = read_system_prompt(system_prompt_file) if system_prompt_file else None

    def run(queries: list[Messages]) -> list[str | None]:
        judgements, _ = judge_prompts(lm, tok, queries, s, budget, progress=progress)
        return [j.verdict for j in judgements]

    return JudgeReward(run, system)


# ---------------------------------------------------------------------------------------------- judge rows
@dataclass
class JudgeRow:
    messages: Messages
    winner: str  # model_a | model_b
    where: str


def load_judge_rows(data: Sequence[str], system: str | None = None,
                    log: Callable[[str], None] = lambda _: None) -> tuple[list[JudgeRow], dict[str, int]]:
    """Every row of judge-pairwise sources (a source's own test split included), with ``system`` injected as in
    training (``--judge-system-prompt``). Rows are read as training reads them (``dschat.data.formats.parse_rows``):
    empty and malformed rows are dropped and counted (``dropped_<reason>``), and a source that is mostly malformed
    stops; a source of another format is a user error."""
    # dschat.data imports torch: here, so that importing this module stays cheap
    from dschat.data.formats import JUDGE as JUDGE_FORMAT
    from dschat.data.formats import check_malformed, describe_keys, detect_format, parse_rows
    from dschat.data.sources import DataSpec, load_source

    rows: list[JudgeRow] = []
    counts: Counter[str] = Counter()
    for d in data:
        raw = load_source(DataSpec.parse(d))
        raw_rows = raw.train + (raw.test or [])
        if not raw_rows:
            raise UserError(f"{raw.name}: no rows")
        fmt = detect_format(raw_rows[0])
        if fmt != JUDGE_FORMAT:
            raise UserError(f"{raw.name}: judging needs judge-pairwise rows (context_messages + winner); this source "
                            f"is {fmt or 'of no known format'} (fields: {describe_keys(raw_rows[0])})")
        examples, problems = parse_rows(raw_rows, JUDGE_FORMAT, counts, system)
        check_malformed(problems, len(raw_rows), raw.name, log)
        rows += [JudgeRow(ex.prompt, str(ex.answer), ex.where) for ex in examples]  # type: ignore[arg-type]
    return rows, dict(counts)
