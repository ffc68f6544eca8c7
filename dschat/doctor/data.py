"""The doctor's data check: the stage's data loaded as the stage loads it (formats, drops, malformed rows, prompts
over the limit) and a histogram of prompt and answer lengths."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from dschat.doctor.report import ERROR, OK, WARN, Report
from dschat.errors import UserError

#: A share of rows dropped as too long, or of prompts cut to --max-prompt-seq-len, above which the data check warns.
LONG_SHARE = 0.10
#: Malformed rows named one by one; the rest are counted.
MALFORMED_SHOWN = 3


def check_data(step: int, cfg: Any, tok: Any, default_data: Callable[[str], Sequence[str]] | None,
                report: Report) -> list[str]:
    """Load the stage's data as it would (``load_phase``, no cache); report each source's format, the drops, the
    prompts over --max-prompt-seq-len (stage 3) and a length histogram. Returns the sources' formats."""
    from dschat.data import load_phase
    from dschat.data.sources import DataSpec, load_source

    data, seed = cfg.data, cfg.run.seed
    kind, shape = "pairwise", step
    if step == 3:
        kind, shape = cfg.algorithm.demo_data, cfg.algorithm.tokenize_as or 3
    default = (lambda: default_data(kind)) if default_data is not None else None
    try:
        pd = load_phase(data, step, tok, seed, use_cache=False, log=lambda _: None, default_data=default,
                        tokenize_as=shape)
        if step == 3:
            from dschat.rlhf.config import check_reward_data

            check_reward_data(cfg.reward_func_names(), pd.train + pd.eval)
    except UserError as e:
        # Name every source that does not read, not only the first; else the phase's own error.
        names = list(data.data) or (list(default()) if default else [])
        broken = []
        for name in names:
            try:
                load_source(DataSpec.parse(name))
            except UserError as bad:
                broken.append(str(bad))
        for text in broken or [str(e)]:
            report.add("data", ERROR, text)
        return []
    for s in pd.sources:
        report.add("data", OK, f"{s['name']}: {s['rows']} rows, format {s['format']}; {s['train_rows']} train rows "
                               f"in phase {step}" + (f" (tokenized as phase {shape})" if shape != step else ""))
    _report_malformed(pd.malformed, report)
    counts = pd.counts
    drops = {k.removeprefix("dropped_"): v for k, v in sorted(counts.items()) if k.startswith("dropped_") and v}
    seen = counts.get("train_rows", 0) + counts.get("eval_rows", 0) + sum(drops.values())
    listed = ", ".join(f"{k} {v}" for k, v in drops.items()) or "none"
    too_long = drops.get("too_long", 0)
    severity = WARN if seen and too_long / seen > LONG_SHARE else OK
    why = (f"; {too_long / seen:.0%} are longer than --max-seq-len {data.max_seq_len} (over {LONG_SHARE:.0%}): "
           "raise it or shorten the data") if severity == WARN else ""
    report.add("data", severity, f"phase {step}: {counts.get('train_rows', 0)} train and {counts.get('eval_rows', 0)} "
                                 f"eval rows kept of {seen}; dropped: {listed}{why}")
    if counts.get("multi_turn_last_only"):
        report.add("data", WARN, f"{counts['multi_turn_last_only']} multi-turn rows train only their last answer "
                                 "(the chat template does not render them turn by turn)")
    if shape == 3:
        cut, kept = counts.get("truncated_prompt", 0), counts.get("train_rows", 0) + counts.get("eval_rows", 0)
        share = cut / kept if kept else 0.0
        advice = f"; over {LONG_SHARE:.0%}: raise the limit or shorten the prompts" if share > LONG_SHARE else ""
        report.add("data", WARN if advice else OK,
                   f"{cut} of {kept} prompts ({share:.0%}) exceed --max-prompt-seq-len {data.max_prompt_seq_len} "
                   f"and lose their beginning (left truncation){advice}")
    _histograms(step, shape, cfg, tok, load_phase, default, report)
    return [s["format"] for s in pd.sources]


def _report_malformed(records: list[dict[str, str]], report: Report) -> None:
    """The malformed rows the stage drops (``PhaseData.malformed``): the first few by file and line, then a count
    per source."""
    for r in records[:MALFORMED_SHOWN]:
        report.add("data", WARN, f"dropped a malformed row: {r['message']}")
    rest = Counter(r["source"] for r in records[MALFORMED_SHOWN:])
    for source, n in rest.items():
        report.add("data", WARN, f"... and {n} more malformed rows in {source}")


def _histograms(step: int, shape: int, cfg: Any, tok: Any, load_phase: Any, default: Any, report: Report) -> None:
    """Prompt and answer token lengths of the phase's rows, tokenized as the stage does but without the length
    limits (so the histogram shows what the limits cut)."""
    unlimited = dataclasses.replace(cfg.data, max_seq_len=10**9, max_prompt_seq_len=10**9, mask_prompt=True,
                                    packing=False, group_by_length=False)
    try:
        pd = load_phase(unlimited, step, tok, cfg.run.seed, use_cache=False, log=lambda _: None,
                        default_data=default, tokenize_as=shape)
    except UserError:
        return
    rows = pd.train + pd.eval
    prompts: list[int] = []
    answers: list[int] = []
    for r in rows:
        if shape == 3:
            prompts.append(len(r["prompt_input_ids"]))
        elif shape == 2:
            prompts.append(r["prompt_len"])
            answers += [len(r["chosen_input_ids"]) - r["prompt_len"], len(r["rejected_input_ids"]) - r["prompt_len"]]
        else:  # the masked head is the prompt (with earlier turns of a multi-turn row counted as answer)
            head = next((i for i, label in enumerate(r["labels"]) if label != -100), len(r["labels"]))
            prompts.append(head)
            answers.append(len(r["input_ids"]) - head)
    limit = cfg.data.max_prompt_seq_len if shape == 3 else cfg.data.max_seq_len
    if prompts:
        report.add("data", OK, "prompt tokens " + histogram(prompts) + (f" | limit {limit}" if shape == 3 else ""))
    if answers:
        report.add("data", OK, "answer tokens (EOS included) " + histogram(answers)
                               + f" | prompt + answer limit {limit}")


def histogram(lengths: Sequence[int]) -> str:
    """A one-line text histogram: count, median, 95th percentile, max, then counts per power-of-two bin
    (``<=16:3`` counts lengths 9-16) with a bar of block characters."""
    xs = sorted(lengths)
    if not xs:
        return "n=0"
    bins: Counter[int] = Counter(max(1, 1 << max(0, (x - 1).bit_length())) for x in xs)
    top = max(bins.values())
    blocks = " ▁▂▃▄▅▆▇█"
    bar = "".join(blocks[max(1, round(8 * bins.get(b, 0) / top))] if bins.get(b) else " "
                  for b in _bin_range(min(bins), max(bins)))
    cells = " ".join(f"<={b}:{bins[b]}" for b in sorted(bins))
    return (f"n={len(xs)} median {xs[len(xs) // 2]} p95 {xs[min(len(xs) - 1, int(0.95 * len(xs)))]} max {xs[-1]} "
            f"[{bar}] {cells}")


def _bin_range(lo: int, hi: int) -> list[int]:
    out = [lo]
    while out[-1] < hi:
        out.append(out[-1] * 2)
    return out
