"""Loading a user's Python file: ``path/to/file.py:NAME`` as the object it names (reward functions, tools,
environments), with one-line errors that name the file; and the ``LABEL=SOURCE`` spelling that names such a source
(``--reward-funcs``, ``--tools``, ``--env``)."""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dschat.errors import UserError, first_line

LABEL = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
_LABELLED = re.compile(rf"({LABEL.pattern})=(.+)")


def split_label(entry: str) -> tuple[str | None, str]:
    """``LABEL=SOURCE`` -> ``(LABEL, SOURCE)``; an entry without a label -> ``(None, entry)``. A label is a letter
    or ``_`` then letters, digits, ``_`` and ``-``, so a path or URL (``/x.py:f``, ``http://...?a=b``) is never
    taken for one."""
    m = _LABELLED.fullmatch(entry)
    return (m.group(1), m.group(2)) if m else (None, entry)


def is_file_spec(spec: str) -> bool:
    """``path/to/file.py:NAME``."""
    path, sep, name = spec.rpartition(":")
    return bool(sep) and path.endswith(".py") and bool(name)


def load_object(spec: str, what: str, probe: Callable[[str], str | None] | None = None) -> Any:
    """The object ``spec`` (``path/to/file.py:NAME``) names, its file imported once per process; ``what`` opens
    every error (``reward function 'x.py:f'``). ``probe(path)``, when given, imports the file elsewhere first (a
    child process) and says what went wrong there (``None``: nothing), so a file that ends its process at import
    stops the run with one line; an import that raises anything, ``SystemExit`` included, is one line too."""
    path_text, _, name = spec.rpartition(":")
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise UserError(f"{what}: file {path} not found")
    module_name = f"dschat_user_{abs(hash(str(path.resolve())))}"
    module = sys.modules.get(module_name)
    if module is None:
        why = probe(str(path)) if probe is not None else None
        if why is not None:
            raise UserError(f"{what}: importing {path} {why}")
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        if module_spec is None or module_spec.loader is None:
            raise UserError(f"{what}: cannot import {path}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException as e:  # noqa: BLE001 - any error in the user's file (sys.exit too) is one line
            sys.modules.pop(module_name, None)
            raise UserError(f"{what}: importing {path} failed: {type(e).__name__}: {_said(e)}") from None
    obj = getattr(module, name, None)
    if obj is None:
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise UserError(f"{what}: {path} has no {name!r} (it defines: {', '.join(names) or 'nothing callable'})")
    return obj


def _said(error: BaseException) -> str:
    """``first_line`` of a user's exception, whose own ``__str__`` may raise."""
    try:
        return first_line(error)
    except Exception:  # noqa: BLE001 - an unreadable message: the type alone
        return type(error).__name__
