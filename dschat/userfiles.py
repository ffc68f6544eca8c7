"""Loading a user's Python file: ``path/to/file.py:NAME`` as the object it names (reward functions, tools,
environments), with one-line errors that name the file."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from dschat.errors import UserError, first_line


def is_file_spec(spec: str) -> bool:
    """``path/to/file.py:NAME``."""
    path, sep, name = spec.rpartition(":")
    return bool(sep) and path.endswith(".py") and bool(name)


def load_object(spec: str, what: str) -> Any:
    """The object ``spec`` (``path/to/file.py:NAME``) names, its file imported once per process; ``what`` opens
    every error (``reward function 'x.py:f'``)."""
    path_text, _, name = spec.rpartition(":")
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise UserError(f"{what}: file {path} not found")
    module_name = f"dschat_user_{abs(hash(str(path.resolve())))}"
    module = sys.modules.get(module_name)
    if module is None:
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        if module_spec is None or module_spec.loader is None:
            raise UserError(f"{what}: cannot import {path}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - any error in the user's file is reported in one line
            sys.modules.pop(module_name, None)
            raise UserError(f"{what}: importing {path} failed: {type(e).__name__}: {first_line(e)}") from None
    obj = getattr(module, name, None)
    if obj is None:
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise UserError(f"{what}: {path} has no {name!r} (it defines: {', '.join(names) or 'nothing callable'})")
    return obj
