"""Which ``--model`` values name a local folder, and which folders are models: one rule for training
(``dschat.models.loading.resolve_model``) and planning (``dschat.planning.shapes.model_config``), without torch."""

from __future__ import annotations

from pathlib import Path

from dschat.errors import UserError


def local_model_folder(name: str) -> Path | None:
    """The model folder ``name`` names, or None when it names no local path (an alias, a HF id, ``tiny``: the
    callers resolve those their own way).

    A folder is a model when it holds ``config.json`` itself (a stage's output folder is not: pass its ``model/``
    or ``actor/``). A name that looks like a path (``./x``, ``/x``, ``~/x``, more than one ``/``) but is no folder
    is an error, not a HF id to look up.
    """
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            subs = [s for s in ("model", "actor") if (path / s / "config.json").exists()]
            hint = f"; pass {path / subs[0]}" if subs else ""
            raise UserError(f"{path}: not a model folder (no config.json){hint}")
        return path
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise UserError(f"{name}: model folder not found")
    return None
