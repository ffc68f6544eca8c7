"""Loading raw rows from ``--data`` sources: local files, ``save_to_disk`` folders, registered names.

Every row carries where it came from (``file.jsonl:12`` or ``name[train]#5``) so that a bad row is reported by
file and line. Nothing here tokenizes; see ``dschat.data.phases``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dschat.errors import UserError

WHERE = "__where__"  # key added to every raw row: its file and line (or split and index)


@dataclass(frozen=True)
class DataSpec:
    """One ``--data`` argument: ``name[:weight]``."""

    name: str
    weight: float = 1.0

    @staticmethod
    def parse(text: str) -> DataSpec:
        m = re.fullmatch(r"(.+?):(\d+(?:\.\d*)?|\.\d+)", text)
        head, sep, tail = text.rpartition(":")
        if m and not os.path.exists(text):
            name, weight = m.group(1), float(m.group(2))
        elif sep and head and not os.path.exists(text) and os.path.exists(os.path.expanduser(head)):
            # An existing file with a weight that is not a number (f:-1, f:abc): the weight is what is wrong.
            raise UserError(f"--data {text!r}: weight {tail!r} of {head} is not a number >= 0 (path[:weight], "
                            "e.g. data.jsonl:0.5)")
        else:
            name, weight = text, 1.0
        if not name:
            raise UserError(f"--data {text!r}: empty dataset name")
        if weight == 0:
            raise UserError(f"--data {text!r}: weight 0 takes no rows from {name}; leave it out or give a weight > 0")
        return DataSpec(name, weight)


@dataclass
class RawDataset:
    """Rows of one source: its train rows and, when the source has one, its own test split."""

    name: str
    train: list[dict[str, Any]]
    test: list[dict[str, Any]] | None
    fingerprint: Any = field(default=None)


def _content_hash(path: Path) -> str:
    """sha256 of the file's bytes: an edit that keeps size and modification time (``touch -r``, ``cp -p``,
    ``rsync -t``) still changes the cache key."""
    import hashlib

    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(4 * 2**20):
            h.update(block)
    return h.hexdigest()


def _file_fingerprint(path: Path) -> list[Any]:
    return [str(path.resolve()), path.stat().st_size, _content_hash(path)]


def _decode(path: Path, data: bytes, lineno: int, first: bool) -> str:
    """UTF-8 text of one line (or a whole file), a BOM at the start of the file accepted; anything else is a
    one-line error naming the file and line."""
    try:
        return data.decode("utf-8-sig" if first else "utf-8")
    except UnicodeDecodeError as e:
        line = lineno + data.count(b"\n", 0, e.start)
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        binary = b"\0" in data[:4096] or data[:2] == b"\x1f\x8b" or data[:4] in (b"PK\x03\x04", b"PAR1")
        hint = "; is it a binary or compressed file?" if binary else ""
        raise UserError(f"{path}:{line}: not valid UTF-8 text (byte 0x{data[e.start]:02x} at column {column})"
                        f"{hint}") from None


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = _decode(path, raw, lineno, lineno == 1)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
            except RecursionError:
                raise UserError(f"{path}:{lineno}: JSON nested too deeply to read") from None
            if not isinstance(row, dict):
                raise UserError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            row[WHERE] = f"{path}:{lineno}"
            rows.append(row)
    return rows


def _read_json(path: Path) -> list[dict[str, Any]]:
    text = _decode(path, path.read_bytes(), 1, True)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        # A ".json" file that is really JSON Lines is common; try that before giving up.
        if e.msg == "Extra data":
            return _read_jsonl(path)
        raise UserError(f"{path}:{e.lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise UserError(f"{path}: JSON nested too deeply to read") from None
    if isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise UserError(f"{path}: expected a list of rows (or an object holding one list of rows)")
        data = lists[0]
    if not isinstance(data, list):
        raise UserError(f"{path}: expected a list of rows")
    rows = []
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise UserError(f"{path}: row {i}: expected a JSON object, got {type(row).__name__}")
        row = dict(row)
        row[WHERE] = f"{path}[{i}]"
        rows.append(row)
    return rows


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - any reader failure is the file's fault here
        raise UserError(f"{path}: cannot read parquet ({str(e).splitlines()[0]})") from None
    rows = table.to_pylist()
    for i, row in enumerate(rows):
        row[WHERE] = f"{path}#{i}"
    return rows


def _hf_rows(ds: Any, label: str) -> list[dict[str, Any]]:
    rows = ds.to_list()
    for i, row in enumerate(rows):
        row[WHERE] = f"{label}#{i}"
    return rows


def _from_dataset_dict(name: str, dd: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    splits = dict(dd.items()) if hasattr(dd, "items") else {"train": dd}
    train_key = "train" if "train" in splits else next(iter(splits))
    test_key = next((k for k in ("test", "validation", "valid", "eval") if k in splits), None)
    train = _hf_rows(splits[train_key], f"{name}[{train_key}]")
    test = _hf_rows(splits[test_key], f"{name}[{test_key}]") if test_key else None
    return train, test


def _folder_fingerprint(path: Path) -> list[Any]:
    out = []
    for p in sorted(path.rglob("*")):
        if p.is_file():
            out.append([str(p.relative_to(path)), p.stat().st_size, _content_hash(p)])
    return [str(path.resolve()), out]


def load_source(spec: DataSpec) -> RawDataset:
    """Read every row of one source. Errors name the file and line; an absent name says why it cannot load."""
    path = Path(spec.name).expanduser()
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            rows = _read_jsonl(path)
        elif suffix == ".json":
            rows = _read_json(path)
        elif suffix == ".parquet":
            rows = _read_parquet(path)
        else:
            raise UserError(f"{path}: unsupported file type {suffix!r} (use .jsonl, .json, .parquet or a "
                            "save_to_disk folder)")
        return RawDataset(str(path), rows, None, _file_fingerprint(path))
    if path.is_dir():
        if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
            import datasets

            try:
                dd = datasets.load_from_disk(str(path))
            except Exception as e:  # noqa: BLE001
                raise UserError(f"{path}: cannot load saved dataset ({str(e).splitlines()[0]})") from None
            train, test = _from_dataset_dict(str(path), dd)
            return RawDataset(str(path), train, test, _folder_fingerprint(path))
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in (".jsonl", ".json", ".parquet"))
        split_files = {p.stem.split("-")[0].lower(): p for p in files}
        if "train" in split_files:
            train = load_source(DataSpec(str(split_files["train"]))).train
            test_path = next((split_files[k] for k in ("test", "validation", "eval") if k in split_files), None)
            test = load_source(DataSpec(str(test_path))).train if test_path else None
            return RawDataset(str(path), train, test, _folder_fingerprint(path))
        raise UserError(f"{path}: folder is neither a save_to_disk dataset nor holds train.jsonl/.json/.parquet")
    if spec.name.startswith((".", "/", "~")) or spec.name.endswith((".jsonl", ".json", ".parquet")):
        raise UserError(f"{spec.name}: file not found")
    return _load_registered(spec.name)


def _load_registered(name: str) -> RawDataset:
    """A hub dataset name, served from the local HF cache (no download when offline)."""
    import datasets

    try:
        dd = datasets.load_dataset(name)
    except Exception as e:  # noqa: BLE001 - any failure here means "not available locally"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"dataset {name!r} is not a local file or folder and could not be loaded from the HF "
                        f"cache (offline?): {first[:200]}") from None
    train, test = _from_dataset_dict(name, dd)
    fp: Any = [name, getattr(dd, "cache_files", None) and str(dd.cache_files)]
    return RawDataset(name, train, test, fp)


def source_fingerprint(spec: DataSpec) -> Any:
    """What identifies a source's content (paths, sizes, content hashes), for the tokenized cache key."""
    path = Path(spec.name).expanduser()
    if path.is_file():
        return _file_fingerprint(path)
    if path.is_dir():
        return _folder_fingerprint(path)
    return None  # registered names: fingerprinted after loading (from the HF cache files)
