"""One run per output folder, and an output folder every rank really shares (docs/operations.md, Locks).

Rank 0 holds an exclusive ``flock`` on ``<output_dir>/.dschat.lock`` for the life of the process and writes its
pid, host, start time and a random nonce into it. The kernel drops the lock when the process dies, however it
dies, so a lock left by a killed run is stale by construction: the next run takes it and says whose it was. A run
that ends on its own (finished, or stopped with an error) clears its note as it exits, so the next run in the
folder says nothing; only a killed holder's note is left to report.
Where flock gives no answer (a filesystem without locks, or a network mount refusing the call: ``NO_FLOCK``) the
file itself is the lock: a holder that is no longer alive on this host is taken over, one on another host is
reported. ``lock_state`` judges a folder the same way without keeping the lock (``dschat doctor``).

Every other rank reads the nonce back from its own view of the output folder. A node whose folder is not the
shared one (node-local disks, or a different ``--output-dir`` per node) sees no nonce or another one, and all
ranks stop at once with one line: checkpoints, ``latest`` and the saved models would otherwise be split between
nodes that disagree about what exists.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import secrets
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dschat.errors import UserError

LOCK_NAME = ".dschat.lock"
# flock errors that mean "no usable flock here", not "held": no locks on this filesystem (ENOLCK, EOPNOTSUPP,
# ENOTSUP, EINVAL), or a network mount refusing the call (EBADF, EACCES: NFS emulates flock with a byte-range
# lock, which needs the file open for writing and a running lock daemon). Then the note is the lock.
NO_FLOCK = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.EBADF, errno.EACCES})
_HELD: dict[str, tuple[int, dict[str, Any]]] = {}  # resolved folder -> (fd, our info); re-entrant per process


def _proc_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a live holder from a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def holder_alive(info: dict[str, Any]) -> bool:
    """Whether the process a lock note names (``pid``, ``proc_start``) still runs on this machine."""
    pid = info.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    start = info.get("proc_start")
    now = _proc_start(pid)
    return start is None or now is None or start == now


def _read_info(path: Path, tries: int = 20) -> dict[str, Any]:
    """The holder's note; it may be a moment away (the holder writes it just after locking)."""
    for _ in range(tries):
        with contextlib.suppress(OSError, ValueError):
            info = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(info, dict):
                return info
        time.sleep(0.1)
    return {}


def describe(info: dict[str, Any]) -> str:
    return (f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, started {info.get('started', '?')}")


def _in_use(folder: Path, info: dict[str, Any]) -> UserError:
    return UserError(f"{folder} is in use by another run ({describe(info)}); wait for it to finish or choose "
                     "another --output-dir")


def _try_flock(fd: int) -> tuple[bool, OSError | None]:
    """Try the exclusive lock without waiting: ``(taken, refusal)``. Not taken and no refusal: another process
    holds it. A refusal (``NO_FLOCK``): this filesystem gives no answer, so the caller judges by the note."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True, None
    except BlockingIOError:
        return False, None
    except OSError as e:
        if e.errno not in NO_FLOCK:
            raise
        return False, e


def _held_by_note(info: dict[str, Any]) -> bool:
    """Without a usable flock: a note from another host is taken as held, one from this host when its process lives."""
    if info.get("pid") in (None, os.getpid()):
        return False
    return info.get("host") != socket.gethostname() or holder_alive(info)


@dataclass
class LockState:
    """What ``lock_state`` found: whether a live run holds the folder (``held``), the holder's note (``info``), and
    why the lock could not be tested directly, as one line (``refusal``; the note decided then). ``writable``
    False: this user cannot open the lock file for writing, so a run would stop there."""

    held: bool
    info: dict[str, Any]
    refusal: str | None = None
    writable: bool = True


def lock_state(folder: str | Path) -> LockState | None:
    """Whether a live run holds ``folder``'s lock, judged as ``acquire`` judges it (the lock taken and released at
    once; the note where flock gives no answer); None when the folder has no lock file. For ``dschat doctor``."""
    path = Path(folder) / LOCK_NAME
    if not path.is_file():
        return None
    info = _read_info(path, tries=1)
    try:
        fd = os.open(path, os.O_RDWR)  # as the run opens it: NFS grants flock only to a file open for writing
    except OSError as e:
        return LockState(_held_by_note(info), info, f"cannot open it for writing ({e.strerror})", writable=False)
    try:
        taken, refusal = _try_flock(fd)
    finally:
        os.close(fd)  # closing drops a lock just taken
    if refusal is not None:
        name = errno.errorcode.get(refusal.errno or 0, str(refusal.errno))
        return LockState(_held_by_note(info), info, f"flock refused ({name}: {refusal.strerror})")
    return LockState(not taken, info)


def _note() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "proc_start": _proc_start(os.getpid()),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "nonce": secrets.token_hex(16),
            "command": " ".join(sys.argv)[:500]}


def _write_note(fd: int, note: dict[str, Any]) -> None:
    data = (json.dumps(note) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def acquire(folder: str | Path, log: Any = None) -> dict[str, Any]:
    """Lock ``folder`` (which must exist) for this process; return our note (with its ``nonce``). Raises a one-line
    ``UserError`` naming the holder when another live run has it. Calling it again in the same process is a no-op."""
    folder = Path(folder)
    key = str(folder.resolve())
    if key in _HELD:
        return _HELD[key][1]
    path = folder / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise UserError(f"--output-dir {folder}: cannot create {LOCK_NAME} there ({e.strerror})") from None
    try:
        taken, refusal = _try_flock(fd)
    except OSError:
        os.close(fd)
        raise
    if refusal is not None:  # no usable flock on this filesystem: the note is the lock
        os.close(fd)
        return _acquire_by_note(folder, key, log)
    if not taken:
        os.close(fd)
        raise _in_use(folder, _read_info(path))
    previous = _read_info(path, tries=1)
    note = _note()
    _write_note(fd, note)
    _HELD[key] = (fd, note)
    atexit.register(release, folder)
    if previous.get("pid") not in (None, os.getpid()) and log is not None:
        log(f"took over the lock of a run that is gone ({describe(previous)})")
    return note


def _acquire_by_note(folder: Path, key: str, log: Any) -> dict[str, Any]:
    path = folder / LOCK_NAME
    previous = _read_info(path, tries=1)
    if previous.get("pid") is not None and previous.get("pid") != os.getpid():
        if previous.get("host") != socket.gethostname():
            raise UserError(f"{folder} is in use by another run ({describe(previous)}), as far as this filesystem "
                            f"(no locks) can tell; if that run is gone, delete {path}")
        if holder_alive(previous):
            raise _in_use(folder, previous)
        if log is not None:
            log(f"took over the lock of a run that is gone ({describe(previous)})")
    note = _note()
    tmp = folder / f"{LOCK_NAME}.{note['nonce']}"
    tmp.write_text(json.dumps(note) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    time.sleep(0.2)  # two takers at once: the last rename wins, the other sees a foreign nonce and stops
    if _read_info(path, tries=1).get("nonce") != note["nonce"]:
        raise _in_use(folder, _read_info(path))
    _HELD[key] = (-1, note)
    atexit.register(release, folder)
    return note


def release(folder: str | Path) -> None:
    """Clear our note and give the lock up (at exit, unless the process was killed: then the kernel drops the
    lock and the note stays for the next run to report). The note is emptied, not deleted, while the lock is still
    held, so no other run can take a fresh file's lock in between."""
    fd, note = _HELD.pop(str(Path(folder).resolve()), (-1, {}))
    path = Path(folder) / LOCK_NAME
    with contextlib.suppress(OSError):
        if fd >= 0:
            os.ftruncate(fd, 0)
        elif note and _read_info(path, tries=1).get("nonce") == note.get("nonce"):
            path.unlink()
    if fd >= 0:
        os.close(fd)


def prepare_output_dir(folder: Path) -> None:
    """Create the output folder, or stop with one line when it is a file or cannot be written."""
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--output-dir {folder}: is a file, not a folder; choose another --output-dir")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UserError(f"--output-dir {folder}: a part of the path is a file, not a folder") from None
    except OSError as e:
        raise UserError(f"--output-dir {folder}: cannot create it ({e.strerror})") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"--output-dir {folder}: not writable by this user")
    probe = folder / f".dschat-write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        from dschat.diskfull import disk_full_error, is_disk_full

        if is_disk_full(e):
            raise disk_full_error("a test file", probe) from None
        raise UserError(f"--output-dir {folder}: cannot write there ({e.strerror})") from None


def sees_nonce(folder: Path, nonce: str, wait: float = 3.0) -> bool:
    """Whether this rank's view of ``folder`` shows the lock note rank 0 just wrote (a network filesystem may
    show the previous note for a moment, so it is read again until ``wait`` seconds have passed)."""
    deadline = time.time() + wait
    while True:
        if _read_info(folder / LOCK_NAME, tries=1).get("nonce") == nonce:
            return True
        if time.time() > deadline:
            return False
        time.sleep(0.1)


def claim_output_dir(folder: Path, log: Any = None) -> None:
    """Collective, at the start of a run: rank 0 creates and locks ``folder``; every rank checks that it sees the
    same folder. Any problem stops every rank with the same line."""
    from dschat import engine as E

    problem, nonce = None, None
    if E.is_main():
        try:
            prepare_output_dir(folder)
            nonce = acquire(folder, log)["nonce"]
        except UserError as e:
            problem = str(e)
    problem, nonce = E.broadcast_object((problem, nonce))
    if problem:
        raise UserError(problem)
    if E.world_size() == 1:
        return
    ok = E.is_main() or sees_nonce(folder, nonce)
    views = E.gather_objects((ok, E.rank(), socket.gethostname()))
    blind = [v for v in views if not v[0]]
    if blind:
        _, rank, host = blind[0]
        raise UserError(f"--output-dir {folder} is not one folder shared by every node: rank {rank} on {host} does "
                        "not see what rank 0 wrote there; give every node the same --output-dir on a shared "
                        "filesystem (checkpoints and 'latest' must be seen by all ranks)")
