"""A full disk during a write is the user's to fix: one line naming what was written and the free space.

Writers fail in several dialects when the disk fills: ``OSError`` ENOSPC/EDQUOT from Python, safetensors'
``SafetensorError ... No space left on device``, and torch's zip writer ``[enforce fail at inline_container.cc]
... unexpected pos``. ``disk_full_guard`` recognises them, removes the partial files it is told about, and raises
a ``UserError`` (exit 2) instead of a traceback.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

from dschat.errors import UserError
from dschat.units import fmt_bytes

_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_SAYS_FULL = ("no space left on device", "disk quota exceeded")
# torch's zip writer reports a short write without the OS error; it means a full disk only when space is short.
_SHORT_WRITE = ("unexpected pos", "file write failed")
LOW_SPACE = 256 * 2**20


class DiskFull(UserError):
    """A write ran out of disk space (exit code 2)."""


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]


def existing_parent(path: str | Path) -> Path:
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_bytes(path: str | Path) -> int | None:
    try:
        return shutil.disk_usage(existing_parent(path)).free
    except OSError:
        return None


def free_text(path: str | Path) -> str:
    """The free space of ``path``'s filesystem as a phrase (``1.50 GiB``, or ``unknown space``)."""
    free = free_bytes(path)
    return "unknown space" if free is None else fmt_bytes(free)


def is_disk_full(exc: BaseException, path: str | Path | None = None) -> bool:
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in _ERRNOS:
            return True
        text = str(e).lower()
        if any(s in text for s in _SAYS_FULL):
            return True
        if path is not None and any(s in text for s in _SHORT_WRITE):
            free = free_bytes(path)
            if free is not None and free < LOW_SPACE:
                return True
    return False


def remove_quietly(paths: Iterable[str | Path]) -> None:
    for p in paths:
        p = Path(p)
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                p.unlink()


def disk_full_error(what: str, path: str | Path, kept: str = "") -> DiskFull:
    where = existing_parent(path)
    tail = f"; {kept}" if kept else ""
    return DiskFull(f"disk full while writing {what} ({path}): {free_text(where)} free on the "
                    f"filesystem of {where}{tail}")


@contextlib.contextmanager
def disk_full_guard(what: str, path: str | Path, cleanup: Iterable[str | Path] = (), kept: str = "") -> Iterator[None]:
    """Turn a full disk inside the block into one ``DiskFull`` line; ``cleanup`` (partial files or folders) is
    removed first, so the free space reported is what the user really has. Other errors pass unchanged."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - only a full disk is translated; everything else is re-raised
        if not is_disk_full(e, path):
            raise
        remove_quietly(cleanup)
        raise disk_full_error(what, path, kept) from None
