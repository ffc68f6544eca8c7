"""``dschat report``: pictures of one or more output folders (``dschat.training.report``)."""

from __future__ import annotations

from pathlib import Path

import click

from dschat.training.report import write_report


@click.command("report")
@click.argument("folders", nargs=-1, required=True)
@click.option("--out", default=None, metavar="DIR",
              help="Where to write the PNGs and report.html (default: O/report for one folder O; a comparison of "
                   "several folders needs --out).")
def report_command(folders: tuple[str, ...], out: str | None) -> None:
    """Plot the metrics of output folders: a stage's (O/metrics.jsonl) or a whole pipeline's (a section per
    stage), finished or still running, with the alarms of health.jsonl marked and eval.json's figures in a table.
    Several folders are compared, one line per folder. Writes PNGs and one self-contained HTML page."""
    page = write_report([Path(f) for f in folders], Path(out) if out else None)
    click.echo(f"report: {page}")
