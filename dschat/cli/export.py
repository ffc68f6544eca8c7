"""``dschat export``: turn a saved training state (any ZeRO stage, LoRA too) into a plain HF folder
(``dschat.training.export``)."""

from __future__ import annotations

from pathlib import Path

import click

from dschat.training.export import export_state


@click.command("export")
@click.option("--checkpoint", required=True, type=click.Path(exists=True, file_okay=False),
              help="An output folder (its latest state) or a checkpoints/step-N folder.")
@click.option("--output", required=True, type=click.Path(file_okay=False), help="Where to write the HF folder.")
@click.option("--engine", default=None, help="Which model of the state: model (steps 1-2, default), actor "
              "(step 3 default) or critic.")
@click.option("--save-adapter", is_flag=True, help="Also write the unmerged LoRA adapter (LoRA runs).")
def export(checkpoint: str, output: str, engine: str | None, save_adapter: bool) -> None:
    """Export a saved training state (ZeRO shards, LoRA) as a plain HF folder with safetensors."""
    src = export_state(Path(checkpoint), Path(output), engine, save_adapter)
    click.echo(f"exported {src} -> {output}")
