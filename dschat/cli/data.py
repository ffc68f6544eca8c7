"""``dschat data``: ``data inspect`` (a train phase as the stages see it) and ``data balance`` (judge files).

Registered on the ``dschat`` group by ``dschat.cli.main``; torch and transformers are imported when a command runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from dschat.config import DataArgs
from dschat.demo import demo_data
from dschat.errors import UserError
from dschat.rewards.judge import balance_rows
from dschat.utils import write_jsonl


@click.group()
def data() -> None:
    """Inspect datasets as the stages will see them."""


@data.command("inspect")
@click.option("--data", "data_", multiple=True, help="Dataset (repeatable, path[:weight]); default: the demo corpus.")
@click.option("--phase", type=click.IntRange(1, 3), default=1, show_default=True, help="Train phase to show.")
@click.option("--model", default="tiny", show_default=True, help="Model whose tokenizer is used.")
@click.option("--data-split", "--data_split", "data_split", default="10,10,10", show_default=True,
              help="Split proportions (the default gives every phase a third).")
@click.option("--max-seq-len", "--max_seq_len", "max_seq_len", type=int, default=256, show_default=True)
@click.option("--max-prompt-seq-len", "--max_prompt_seq_len", "max_prompt_seq_len", type=int, default=128,
              show_default=True)
@click.option("--seed", type=int, default=1234, show_default=True)
@click.option("-n", "--num-samples", "num_samples", type=int, default=3, show_default=True)
def data_inspect(data_: tuple[str, ...], phase: int, model: str, data_split: str, max_seq_len: int,
                 max_prompt_seq_len: int, seed: int, num_samples: int) -> None:
    """Print decoded samples of a train phase with their token ids and masks, and the drop counts."""
    # torch and transformers: see the module docstring
    from dschat.data import DataCollatorReward, DataCollatorRLHF, DataCollatorSFT, load_phase
    from dschat.models.loading import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(model))
    args = DataArgs(data=list(data_), data_split=data_split, max_seq_len=max_seq_len,
                    max_prompt_seq_len=max_prompt_seq_len)
    pd = load_phase(args, phase, tok, seed, log=lambda s: click.echo(s, err=True), default_data=demo_data)
    for src in pd.sources:
        click.echo(f"source {src['name']}: format {src['format']}, {src['rows']} rows, "
                   f"{src['train_rows']} phase-{phase} train rows")
    click.echo("counts: " + ", ".join(f"{k}={v}" for k, v in sorted(pd.counts.items())))
    rows = pd.train[:num_samples]
    pad = tok.pad_token_id
    collator: Any = {1: DataCollatorSFT, 2: DataCollatorReward, 3: DataCollatorRLHF}[phase](pad)
    batch = collator(rows)
    for i, row in enumerate(rows):
        click.echo(f"\n=== sample {i} ===")
        if phase == 1:
            ids, labels = row["input_ids"], row["labels"]
            spans = label_spans(labels)
            n_trained = sum(1 for trained, _, _ in spans if trained)
            click.echo(f"{n_trained} trained span(s) (the answer, and every assistant turn of a messages row), "
                       f"{len(spans) - n_trained} masked")
            for trained, start, end in spans:
                click.echo(f"  {'trained' if trained else 'masked '} ({end - start} tokens): "
                           f"{tok.decode(ids[start:end])!r}")
            click.echo(f"input_ids: {ids}")
            click.echo(f"labels:    {labels}")
            click.echo(f"attention_mask (padded batch): {batch['attention_mask'][i].tolist()}")
        elif phase == 2:
            b = len(rows)
            for name, j in (("chosen", i), ("rejected", b + i)):
                ids = row[f"{name}_input_ids"]
                click.echo(f"{name} ({len(ids)} tokens): {tok.decode(ids)!r}")
                click.echo(f"  input_ids: {ids}")
                click.echo(f"  attention_mask (batch row {j}, right-padded): {batch['attention_mask'][j].tolist()}")
        else:
            ids = row["prompt_input_ids"]
            click.echo(f"prompt ({len(ids)} tokens): {tok.decode(ids)!r}")
            click.echo(f"  input_ids: {ids}")
            click.echo(f"  prompt_att_mask (left-padded): {batch['prompt_att_mask'][i].tolist()}")
            if row.get("answer") is not None:
                click.echo(f"  answer: {row['answer']!r}")


def label_spans(labels: list[int]) -> list[tuple[bool, int, int]]:
    """Runs of trained (label != -100) and masked positions: ``(trained, start, end)``, in order."""
    spans: list[tuple[bool, int, int]] = []
    for i, label in enumerate(labels):
        trained = label != -100
        if spans and spans[-1][0] == trained:
            spans[-1] = (trained, spans[-1][1], i + 1)
        else:
            spans.append((trained, i, i + 1))
    return spans


@data.command("balance")
@click.option("--data", "data_", required=True, help="Judge-pairwise file (context_messages + winner): .jsonl, "
                                                     ".json or .parquet.")
@click.option("--output", required=True, type=click.Path(dir_okay=False), help="Balanced rows, as JSON Lines.")
@click.option("--seed", type=int, default=1234, show_default=True, help="Picks which rows are swapped.")
@click.option("--skip-unparseable", "--skip_unparseable", "skip_unparseable", is_flag=True,
              help="Drop (and count) rows whose answer markers are not found, instead of stopping.")
def data_balance(data_: str, output: str, seed: int, skip_unparseable: bool) -> None:
    """Balance a judge file's winners: swap answers A and B and flip the winner in a seeded subset of rows, so
    that half the rows (floor/ceil) have each winner. A judge trained on a skewed file learns the position."""
    from dschat.data.sources import WHERE, DataSpec, load_source  # torch (dschat.data): see the module docstring

    if Path(output).expanduser().resolve() == Path(data_).expanduser().resolve():
        raise UserError("--output must differ from --data (the input is read while the output is written)")
    raw = load_source(DataSpec(data_))
    rows = raw.train + (raw.test or [])
    if not rows:
        raise UserError(f"{raw.name}: no rows")
    where = [str(r.get(WHERE, f"{raw.name}#{i}")) for i, r in enumerate(rows)]
    clean = [{k: v for k, v in r.items() if k != WHERE} for r in rows]
    out, report = balance_rows(clean, seed, skip_unparseable, where=lambda i: where[i])
    write_jsonl(out, output)

    def counts(c: dict[str, int]) -> str:
        return f"model_a {c['model_a']}, model_b {c['model_b']}"

    click.echo(f"rows: {report.rows}" + (f" (skipped {report.skipped} without answer markers)" if report.skipped
                                         else ""))
    click.echo(f"before: {counts(report.before)}")
    click.echo(f"after:  {counts(report.after)}")
    click.echo(f"swapped: {report.swapped}")
    click.echo(f"wrote {output}", err=True)
