"""Small shared helpers: cache location, atomic file and folder writes, seeding, hashing, addresses."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from dschat.diskfull import disk_full_error, is_disk_full


def cache_root() -> Path:
    """``$DSCHAT_CACHE`` or ``~/.cache/dschat``: demo files, the tiny model, tokenized datasets."""
    root = os.environ.get("DSCHAT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dschat")
    return Path(root)


def stable_hash(obj: Any, n: int = 16) -> str:
    """A short hex digest of a JSON-serialisable object (keys sorted)."""
    blob = json.dumps(obj, sort_keys=True, ensure_ascii=False, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:n]


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write; on success it replaces ``path`` in one rename.

    Readers (and concurrent writers of the same content) see the old file or the new one, never a half-written
    one; a failure inside the block removes the temporary file and leaves ``path`` as it was (a full disk becomes
    one ``DiskFull`` line). The file gets mode 0644 (``mkstemp`` creates 0600) and is flushed to disk before the
    rename.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        if is_disk_full(e):
            raise disk_full_error("a file", path, "its previous version is kept") from None
        raise
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and is_disk_full(e):
            raise disk_full_error("a file", path, "its previous version is kept") from None
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (``atomic_file``); returns ``path``."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def atomic_write_text(path: str | Path, text: str) -> Path:
    """UTF-8 ``text`` written atomically, byte for byte (no newline translation)."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False, default=str) + "\n")


METRICS_FILE = "metrics.jsonl"  # a run's logged rows in its output folder (every stage, the report, the resume)


def write_jsonl(rows: Iterable[dict[str, Any]], path: str | Path) -> Path:
    """UTF-8 JSON Lines with ``ensure_ascii=False`` and ``\\n`` line ends, so the bytes depend only on the rows;
    written atomically. Returns ``path``."""
    with atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return Path(path)


def read_jsonl_rows(path: str | Path) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects of a JSON Lines file and how many non-blank lines were not one (a running job's
    half-written last line, a line cut by a full disk); those are skipped."""
    rows: list[dict[str, Any]] = []
    bad = 0
    for line in Path(path).read_bytes().decode("utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad += 1
    return rows, bad


@contextlib.contextmanager
def atomic_dir(final: str | Path, replace: bool = True) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it replaces ``final`` in one rename.

    A crash inside the block leaves ``final`` as it was (old content or absent), never half written. With
    ``replace=False`` (deterministic content built by several processes at once), a ``final`` that another
    process completed meanwhile is kept and this copy discarded, so no reader ever sees it vanish.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
    try:
        yield tmp
        if not replace:
            try:
                os.rename(tmp, final)  # fails if another process got there first
            except OSError:
                if not final.exists():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
            return
        if final.exists():
            old = final.parent / f".{final.name}.old-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def set_seed(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def progress_bar(enabled: bool, total: int, desc: str, **kwargs: Any) -> Any:
    """A tqdm bar on stderr (redrawn at most once a second), or None when ``enabled`` is false."""
    if not enabled:
        return None
    import sys

    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, mininterval=1.0, **kwargs)


def unwrap(model: Any) -> Any:
    """The plain module inside a DeepSpeed engine (or the module itself)."""
    import torch

    inner = getattr(model, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` as a pair, or a one-line error."""
    from dschat.errors import UserError

    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"{text!r} is not HOST:PORT")
    return host, int(port)


def listen_at(host: str, port: int, backlog: int = 16) -> Any:
    """A TCP socket listening at exactly ``host:port`` (port 0: any free one), never on every interface; one line
    (``UserError``) when the address is taken or is not this machine's."""
    import socket

    from dschat.errors import UserError, first_line

    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
        sock.listen(backlog)
    except OSError as e:
        raise UserError(f"cannot listen at {host}:{port}: {first_line(e)}") from None
    return sock


def free_port() -> int:
    """A TCP port free on the loopback right now (the OS's pick)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
