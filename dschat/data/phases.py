"""Train-phase datasets (docs/data.md, Train phases): split, tokenize, count drops, cache.

``load_phase(data, phase, tokenizer, seed)`` gives the tokenized train and eval rows of one train_phase:
1. SFT: ``input_ids``, ``labels`` (prompt masked with -100 by default) of prompt + chosen + EOS; every assistant
   turn of a ``messages`` row is trained, not only the last (multi-turn SFT).
2. Reward: ``chosen_input_ids`` and ``rejected_input_ids`` (prompt + answer + EOS) and ``prompt_len``; identical
   pairs dropped.
3. RL: ``prompt_input_ids`` (left-truncated to ``max_prompt_seq_len``), plus the row's ground truth.

Every source is split once, deterministically by seed, into three disjoint parts proportional to
``--data-split``; phase k uses part k. The tokenized result is cached under a key that covers every input that
shapes it, so a changed file, split, seed, tokenizer or length never reuses a stale cache.

``tokenize_as`` tokenizes one phase's part as another phase would: offline DPO (stage 3) trains on the pairs of
the phase-3 part (``load_phase(data, 3, ..., tokenize_as=2)``).
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dschat.config import DataArgs
from dschat.data.formats import (
    CONV_PAIRWISE,
    PAIRWISE,
    Example,
    Span,
    check_malformed,
    detect_format,
    parse_rows,
    render_answer,
    render_prompt,
    render_turns,
    source_format,
)
from dschat.data.sources import WHERE, DataSpec, RawDataset, load_source, source_fingerprint
from dschat.data.usertext import encode_texts, keep_end, prompt_parts, single_bos
from dschat.diskfull import DiskFull, free_text
from dschat.errors import UserError
from dschat.prompts import read_system_prompt
from dschat.utils import atomic_write_text, cache_root, stable_hash

CACHE_VERSION = 4  # bump when tokenization logic changes, so old caches are never read (2: JSON, content keys;
# 3: pairwise rows keep prompt_len; 4: stage 1 trains every assistant turn of a messages row)


@dataclass
class PhaseData:
    """Tokenized rows of one train phase, with what was dropped and why."""

    phase: int
    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]
    counts: dict[str, int] = field(default_factory=dict)
    sources: list[dict[str, Any]] = field(default_factory=list)
    # Every malformed row dropped (counted under ``dropped_malformed``): ``{"source": name, "message": "file:line:
    # why"}``, so a caller (``dschat doctor``) reads the records rather than the log lines.
    malformed: list[dict[str, str]] = field(default_factory=list)


def parse_split(text: str) -> list[float]:
    try:
        parts = [float(x) for x in text.split(",")]
    except ValueError:
        raise UserError(f"--data-split {text!r}: expected three numbers like 2,4,4") from None
    if len(parts) != 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise UserError(f"--data-split {text!r}: expected three non-negative numbers with a positive sum")
    return parts


def split_indices(n: int, split: list[float], seed: int, phase: int) -> list[int]:
    """Indices of part ``phase`` (1-based) of a seeded permutation of ``range(n)``; parts are disjoint."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    total = sum(split)
    bounds = [0]
    acc = 0.0
    for w in split:
        acc += w
        bounds.append(int(round(n * acc / total)))
    return order[bounds[phase - 1]: bounds[phase]]


def tokenizer_fingerprint(tokenizer: Any) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    probe = "Human: 你好，请问我的快递到哪了？ Assistant: order #123 <answer>42</answer>"
    return stable_hash([type(tokenizer).__name__, vocab, tokenizer.all_special_tokens,
                        getattr(tokenizer, "chat_template", None), tokenizer(probe)["input_ids"]])


def _weighted(rows: list[Any], weight: float) -> list[Any]:
    """``weight`` 0.5 keeps the first half (rows are already shuffled), 2 repeats every row twice."""
    whole, frac = int(weight), weight - int(weight)
    return rows * whole + rows[: int(round(frac * len(rows)))]


def _prepare_source(raw: RawDataset, spec: DataSpec, split: list[float], seed: int, phase: int,
                    data: DataArgs, judge_system: str | None = None,
                    log: Any = print) -> tuple[str, list[Example], list[Example], Counter[str], list[str]]:
    counts: Counter[str] = Counter()
    fmt = source_format(raw.train, raw.name)

    part = [raw.train[i] for i in split_indices(len(raw.train), split, seed, phase)]
    if raw.test is not None:
        train_rows, eval_rows = part, list(raw.test)
    else:
        # Held-out rows come from this phase's own part, so no phase ever evaluates on another's training rows.
        n_eval = int(round(len(part) * data.eval_fraction)) if len(part) >= 2 else 0
        n_eval = max(n_eval, 1) if data.eval_fraction > 0 and len(part) >= 2 else n_eval
        if data.max_eval_rows:
            n_eval = min(n_eval, data.max_eval_rows)
        eval_rows, train_rows = part[:n_eval], part[n_eval:]
    if data.max_eval_rows and len(eval_rows) > data.max_eval_rows:
        eval_rows = eval_rows[: data.max_eval_rows]
    train, problems = parse_rows(_weighted(train_rows, spec.weight), fmt, counts, judge_system)
    evals, eval_problems = parse_rows(eval_rows, fmt, counts, judge_system)
    problems += eval_problems
    check_malformed(problems, len(train) + len(evals) + sum(counts.values()), raw.name, log, " in this phase")
    return fmt, train, evals, counts, problems


def _encode(tokenizer: Any, texts: list[str], special: bool, parts: list[list[str | None]]) -> list[list[int]]:
    """Ids of rendered texts; ``parts`` (per text) are the row's own strings, tokenized as text."""
    return encode_texts(tokenizer, texts, parts, special)


def _tools_of(ex: Example, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The tool schemas a row's template renders: the run's, else the row's own ``tools`` field."""
    own = ex.extra.get("tools") if isinstance(ex.extra, dict) else None
    return tools or (own if isinstance(own, list) and own else None)


def tokenize_examples(examples: list[Example], phase: int, tokenizer: Any, data: DataArgs,
                      counts: Counter[str], tools: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Tokenize normalised examples for ``phase``; unusable rows are dropped into ``counts``. ``tools`` (the
    function schemas of a run's ``--tools``), else a row's own ``tools`` field, go to the chat template."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise UserError("the tokenizer has no EOS token; set one in its tokenizer_config.json")
    usable: list[Example] = []
    for ex in examples:
        if phase == 1 and ex.chosen is None:
            counts["dropped_no_response"] += 1
        elif phase == 2 and (ex.chosen is None or ex.rejected is None):
            counts["dropped_not_pairwise"] += 1
        elif phase == 2 and ex.chosen == ex.rejected:
            counts["dropped_identical_pair"] += 1
        else:
            usable.append(ex)
    def tools_of(ex: Example) -> list[dict[str, Any]] | None:
        return _tools_of(ex, tools)

    prompts = _encode(tokenizer, [render_prompt(ex.prompt, tokenizer, tools_of(ex)) for ex in usable], True,
                      [prompt_parts(ex.prompt) for ex in usable])
    bos = tokenizer.bos_token_id
    prompts = [single_bos(ids, bos) for ids in prompts]
    rows: list[dict[str, Any]] = []
    if phase == 3:
        keep = data.max_prompt_seq_len
        for ex, ids in zip(usable, prompts, strict=True):
            if len(ids) > keep:
                counts["truncated_prompt"] += 1
                ids = keep_end(ids, keep, bos)  # the question and 'Assistant:' are at the end
            rows.append({"prompt_input_ids": ids, "answer": ex.answer, "where": ex.where,
                         "extra": _jsonable(ex.extra)})
        return rows
    chosen = _encode(tokenizer, [render_answer(ex.prompt, ex.chosen or "", tokenizer, tools_of(ex)) for ex in usable],
                     False,
                     [[ex.chosen] for ex in usable])
    rejected = (_encode(tokenizer, [render_answer(ex.prompt, ex.rejected or "", tokenizer, tools_of(ex))
                                    for ex in usable], False,
                        [[ex.rejected] for ex in usable])
                if phase == 2 else [[]] * len(usable))
    turns = _earlier_turns(usable, tokenizer, counts, tools) if phase == 1 else {}
    for i, (ex, p, c, x) in enumerate(zip(usable, prompts, chosen, rejected, strict=True)):
        p, p_labels = turns.get(i, (p, [-100] * len(p)))
        c_ids, x_ids = p + c + [eos], p + x + [eos]
        if not c:
            counts["dropped_empty"] += 1
            continue
        if len(c_ids) > data.max_seq_len or (phase == 2 and len(x_ids) > data.max_seq_len):
            counts["dropped_too_long"] += 1
            continue
        if phase == 1:
            labels = (p_labels + c + [eos]) if data.mask_prompt else list(c_ids)
            rows.append({"input_ids": c_ids, "labels": labels})
        else:
            if c_ids == x_ids:  # different strings can still tokenize alike
                counts["dropped_identical_pair"] += 1
                continue
            row = {"chosen_input_ids": c_ids, "rejected_input_ids": x_ids, "prompt_len": len(p)}
            margin = ex.extra.get("margin")
            if isinstance(margin, int | float):
                row["margin"] = float(margin)
            rows.append(row)
    return rows


def _earlier_turns(examples: list[Example], tokenizer: Any, counts: Counter[str],
                   tools: list[dict[str, Any]] | None = None) -> dict[int, tuple[list[int], list[int]]]:
    """Multi-turn SFT: for each ``messages`` example whose prompt holds assistant turns, the prompt's ids and
    their labels, every earlier assistant turn trained and the rest masked (-100); keyed by the example's index.

    Each span is tokenized on its own (the first with the BOS, as a prompt is), as the final answer already is
    apart from its prompt, so a one-turn row keeps exactly the ids it always had. A conversation its template
    does not render as the prefix of its continuation trains its final answer only, counted under
    ``multi_turn_last_only``.
    """
    found: dict[int, list[Span]] = {}
    for i, ex in enumerate(examples):
        if not ex.train_all_turns or not any(m["role"] == "assistant" for m in ex.prompt):  # type: ignore[union-attr]
            continue
        spans = render_turns(ex.prompt, tokenizer, _tools_of(ex, tools))
        if spans is None:
            counts["multi_turn_last_only"] += 1
        else:
            found[i] = spans
    if not found:
        return {}
    order = list(found)
    firsts = _encode(tokenizer, [found[i][0].text for i in order], True, [found[i][0].parts for i in order])
    rest = [(i, s) for i in order for s in found[i][1:]]
    rest_ids = iter(_encode(tokenizer, [s.text for _, s in rest], False, [s.parts for _, s in rest]))
    out: dict[int, tuple[list[int], list[int]]] = {}
    bos = tokenizer.bos_token_id
    for i, first in zip(order, firsts, strict=True):
        ids = single_bos(first, bos)
        labels = [-100] * len(ids)
        for span in found[i][1:]:
            span_ids = next(rest_ids)
            ids = ids + span_ids
            labels = labels + (list(span_ids) if span.trained else [-100] * len(span_ids))
        out[i] = (ids, labels)
    return out


def pairs_of(rows: list[dict[str, Any]], tokenizer: Any, data: DataArgs) -> list[dict[str, Any]]:
    """The chosen/rejected pairs behind phase-3 prompt rows that came from pairwise data (a prompt row keeps its
    source row's fields in ``extra``), tokenized as phase 2 tokenizes pairs; rows without a pair give none, and
    pairs phase 2 would drop (identical, too long) are dropped. Online DPO trains on prompts and evaluates its
    implicit reward on the pairs of the same held-out rows that offline DPO evaluates on."""
    counts: Counter[str] = Counter()
    examples: list[Example] = []
    for row in rows:
        source = {**row.get("extra", {}), WHERE: row.get("where", "?")}
        fmt = detect_format(source)
        if fmt in (PAIRWISE, CONV_PAIRWISE):
            examples += parse_rows([source], fmt, counts)[0]
    return tokenize_examples(examples, 2, tokenizer, data, counts)


def _jsonable(extra: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in extra.items() if isinstance(v, str | int | float | bool | list | dict | type(None))}


def cache_key(data: DataArgs, phase: int, tokenizer: Any, seed: int, specs: list[DataSpec],
              tokenize_as: int | None = None, tools: list[dict[str, Any]] | None = None) -> str:
    return stable_hash({
        **({"tools": tools} if tools else {}),  # the schemas a chat template renders into prompts
        "v": CACHE_VERSION, "phase": phase, "seed": seed, "split": data.data_split,
        **({"tokenize_as": tokenize_as} if tokenize_as not in (None, phase) else {}),
        "sources": [[s.name, s.weight, source_fingerprint(s)] for s in specs],
        "max_seq_len": data.max_seq_len, "max_prompt_seq_len": data.max_prompt_seq_len,
        "eval_fraction": data.eval_fraction, "max_eval_rows": data.max_eval_rows,
        "mask_prompt": data.mask_prompt, "tokenizer": tokenizer_fingerprint(tokenizer),
        # The rubric's text, not its path: an edited rubric file must not reuse a stale cache. Absent when unset,
        # so caches made before the flag existed stay valid.
        **({"judge_system_prompt": read_system_prompt(data.judge_system_prompt)} if data.judge_system_prompt
           else {}),
    }, n=24)


def count_line(phase: int, counts: dict[str, int]) -> str:
    """One line with the phase's row counts and every drop reason (also written to the stage's eval.json)."""
    dropped = ", ".join(f"{k.removeprefix('dropped_')} {v}" for k, v in sorted(counts.items())
                        if k.startswith("dropped_") and v)
    return (f"data: phase {phase}: {counts.get('train_rows', 0)} train rows, {counts.get('eval_rows', 0)} eval rows; "
            f"dropped: {dropped or 'none'}")


def load_phase(data: DataArgs, phase: int, tokenizer: Any, seed: int, use_cache: bool = True,
               log: Any = print, default_data: Callable[[], Sequence[str]] | None = None,
               tokenize_as: int | None = None, need_train: bool = True,
               tools: list[dict[str, Any]] | None = None) -> PhaseData:
    """The tokenized train/eval rows of ``phase`` (1, 2 or 3) from ``data.data``, cached on disk; ``tokenize_as``
    (default ``phase``) tokenizes that part as another phase's rows (offline DPO: the phase-3 part as pairs).

    Without ``data.data`` the sources are ``default_data()`` (the stage mains pass the demo corpus,
    ``dschat.demo.demo_data``); with neither there is nothing to train on, a user error. ``need_train`` False
    (``dschat eval``, which reads only the held-out rows): a phase without training rows is fine, so
    ``--eval-fraction 1`` holds out every row.
    """
    split = parse_split(data.data_split)
    judge_system = read_system_prompt(data.judge_system_prompt) if data.judge_system_prompt else None
    names = list(data.data) if data.data else list(default_data()) if default_data is not None else []
    if not names:
        raise UserError("no --data given: pass a JSON Lines, JSON or Parquet file, a save_to_disk folder or a "
                        "dataset name (repeatable)")
    specs = [DataSpec.parse(d) for d in names]
    cache_dir = Path(data.data_cache_dir).expanduser() if data.data_cache_dir else cache_root() / "data"
    shape = tokenize_as or phase
    key = cache_key(data, phase, tokenizer, seed, specs, shape, tools)
    # JSON, never a pickle: a cache folder shared between users or nodes must not be a way to run code.
    cache_file = cache_dir / f"phase{phase}-{key}.json"
    if use_cache and all(source_fingerprint(s) is not None for s in specs) and cache_file.exists():
        cached = _read_cache(cache_file)
        if cached is not None:
            log(f"data: phase {phase} from cache {cache_file}")
            log(count_line(phase, cached.counts))
            return cached
    if split[phase - 1] == 0:
        raise UserError(f"--data-split {data.data_split} gives train phase {phase} no rows")
    counts: Counter[str] = Counter()
    train: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    sources = []
    malformed: list[dict[str, str]] = []
    for spec in specs:
        raw = load_source(spec)
        fmt, tr, ev, c, problems = _prepare_source(raw, spec, split, seed, phase, data, judge_system, log)
        counts.update(c)
        malformed += [{"source": raw.name, "message": text} for text in problems]
        before = len(train)
        train += tokenize_examples(tr, shape, tokenizer, data, counts, tools)
        evals += tokenize_examples(ev, shape, tokenizer, data, counts, tools)
        sources.append({"name": raw.name, "format": fmt, "rows": len(raw.train),
                        "test_rows": len(raw.test) if raw.test is not None else 0,
                        "train_rows": len(train) - before, "weight": spec.weight})
        log(f"data: {raw.name}: {len(raw.train)} rows, format {fmt}, phase {phase} train rows {len(train) - before}")
    if not train and (need_train or not evals):
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "no rows in this phase's part"
        needs = {1: "a response (pairwise or sft rows)", 2: "chosen/rejected pairs", 3: "a prompt"}[shape]
        formats = ", ".join(f"{s['name']} is {s['format']}" for s in sources)
        raise UserError(f"train phase {phase} has no usable rows after filtering ({reasons}); it needs {needs}; "
                        f"{formats}; check --data, --data-split and --max-seq-len")
    counts["train_rows"] = len(train)
    counts["eval_rows"] = len(evals)
    result = PhaseData(phase, train, evals, dict(counts), sources, malformed)
    log(count_line(phase, result.counts))
    if use_cache:
        _write_cache(cache_file, result, log)
    return result


def _read_cache(path: Path) -> PhaseData | None:
    """A cached phase, or None when the file is unreadable or not shaped like one (then it is rebuilt)."""
    try:
        blob = json.loads(path.read_text(encoding="utf-8"))
        cached = PhaseData(**blob)
        if not (isinstance(cached.train, list) and isinstance(cached.eval, list) and isinstance(cached.counts, dict)
                and all(isinstance(r, dict) for r in cached.train + cached.eval)):
            return None
        return cached
    except (OSError, ValueError, TypeError):
        return None


def _write_cache(path: Path, result: PhaseData, log: Any) -> None:
    """Write the cache atomically; a full disk only costs the cache (the run goes on without it)."""
    try:
        atomic_write_text(path, json.dumps(result.__dict__, ensure_ascii=False, separators=(",", ":")))
    except DiskFull:
        log(f"data: disk full writing the tokenized cache {path} ({free_text(path.parent)} free); "
            "continuing without it")
