"""Loading only what dschat wrote (docs/operations.md, Security).

A pickle runs code when it is loaded. dschat's own files load without pickles: tensors with
``torch.load(weights_only=True)``, everything else as JSON. DeepSpeed's checkpoint loaders (``load_checkpoint``
and ``zero_to_fp32``, deepspeed 0.19) call ``torch.load(weights_only=False)`` and need it: their optimizer files
hold DeepSpeed objects (loss scalers, enums). So every training state carries ``manifest.json``, the sha256 and
size of each of its files, written before the state is renamed into place; a state is loaded (``--resume``,
``dschat export``) only after every file matches it and no file was added. A planted or swapped pickle is
refused before anything unpickles it.

The manifest proves a state is the one dschat wrote, not who wrote it: someone who may write into the output
folder may also rewrite the manifest. Output folders and caches belong on storage only trusted users can write
(README, Security).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dschat.errors import UserError

MANIFEST = "manifest.json"
FORMAT = "dschat-state-manifest/1"
CHUNK = 4 * 2**20


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def state_files(folder: str | Path) -> list[str]:
    """Every file under ``folder`` (relative, POSIX, sorted) but the manifest; links count as files."""
    root = Path(folder)
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if (p.is_file() or p.is_symlink()) and p.relative_to(root).as_posix() != MANIFEST)


def hash_files(folder: str | Path, files: list[str]) -> dict[str, str]:
    return {f: sha256_file(Path(folder) / f) for f in files}


def manifest_text(folder: str | Path, digests: dict[str, str]) -> str:
    root = Path(folder)
    files = {f: {"sha256": d, "size": (root / f).stat().st_size} for f, d in sorted(digests.items())}
    return json.dumps({"format": FORMAT, "files": files}, indent=1) + "\n"


def read_manifest(folder: str | Path) -> tuple[dict[str, dict[str, Any]] | None, str | None]:
    """``(files, None)`` or ``(None, problem)``."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None, (f"{folder}: no {MANIFEST}, so it cannot be shown to be a state dschat wrote (states from "
                      "before dschat wrote manifests, or altered ones, are refused: loading one unpickles code)")
    try:
        blob = json.loads(path.read_text(encoding="utf-8"))
        files = blob["files"]
        if blob.get("format") != FORMAT or not isinstance(files, dict):
            raise ValueError(blob.get("format"))
        for entry in files.values():
            if not (isinstance(entry["sha256"], str) and isinstance(entry["size"], int)):
                raise ValueError(entry)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None, f"{path}: not a dschat state manifest; refusing to load the state"
    return files, None


def precheck(folder: str | Path) -> tuple[dict[str, dict[str, Any]] | None, str | None]:
    """The manifest's entries when the folder holds exactly its files at their sizes, else a problem (no
    hashing yet: that part may be shared between ranks, see ``dschat.training.resume``)."""
    files, problem = read_manifest(folder)
    if files is None:
        return None, problem
    root = Path(folder)
    on_disk = state_files(root)
    extra = sorted(set(on_disk) - set(files))
    if extra:
        return None, (f"{root / extra[0]}: not in the state's {MANIFEST}; refusing to load a state holding files "
                      "dschat did not write")
    for name, entry in sorted(files.items()):
        path = root / name
        if not path.is_file() or path.is_symlink():
            return None, f"{path}: listed in the state's {MANIFEST} but missing; the state is incomplete"
        if path.stat().st_size != entry["size"]:
            return None, (f"{path}: {path.stat().st_size} bytes where the state's {MANIFEST} says {entry['size']}; "
                          "the state was altered or damaged; refusing to load it")
    return files, None


def compare(folder: str | Path, files: dict[str, dict[str, Any]], digests: dict[str, str]) -> str | None:
    for name, entry in sorted(files.items()):
        if digests.get(name) != entry["sha256"]:
            return (f"{Path(folder) / name}: its sha256 differs from the state's {MANIFEST}; the state was altered "
                    "or damaged after dschat wrote it; refusing to load it")
    return None


def verify_state(folder: str | Path,
                 hasher: Callable[[str | Path, list[str]], dict[str, str]] = hash_files) -> None:
    """Raise a one-line ``UserError`` unless ``folder`` holds exactly the files of its manifest, unchanged."""
    files, problem = precheck(folder)
    if files is None:
        raise UserError(problem)
    problem = compare(folder, files, hasher(folder, sorted(files)))
    if problem:
        raise UserError(problem)


def load_tensors(path: str | Path) -> Any:
    """``torch.load`` that refuses pickled code: tensors, numbers, strings and containers of them only."""
    import pickle

    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as e:
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise UserError(f"{path}: not a plain tensor file, refusing to unpickle it ({first})") from None


def damaged_safetensors(folder: str | Path) -> tuple[Path, str] | None:
    """The first ``*.safetensors`` file under ``folder`` whose header is unreadable or whose tensors run past the
    end of the file (a truncated download or copy), with what is wrong; None when all look whole."""
    import struct

    for path in sorted(Path(folder).glob("*.safetensors")):
        size = path.stat().st_size
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > size - 8:
                    return path, f"header length {n} exceeds the file's {size} bytes"
                header = json.loads(f.read(n))
            ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        except (OSError, struct.error, ValueError, KeyError, TypeError, AttributeError, IndexError):
            return path, "damaged header"
        if 8 + n + max(ends, default=0) > size:
            return path, f"truncated: {size} bytes, the header describes {8 + n + max(ends, default=0)}"
    return None
