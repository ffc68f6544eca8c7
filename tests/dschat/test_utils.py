"""Small shared helpers (dschat/utils.py): the one atomic file write."""

import json

import pytest

from dschat.utils import atomic_file, atomic_write_bytes, write_json, write_jsonl


def test_write_jsonl_bytes_depend_only_on_the_rows(tmp_path):
    rows = [{"prompt": "你好", "n": 1}, {"prompt": "a\nb"}]
    path = write_jsonl(rows, tmp_path / "sub" / "rows.jsonl")
    assert path.read_bytes() == ('{"prompt": "你好", "n": 1}\n{"prompt": "a\\nb"}\n').encode()
    assert path.stat().st_mode & 0o777 == 0o644  # readable by others, as a plain open() would make it
    write_json(tmp_path / "m.json", {"b": 1.5})
    assert json.loads((tmp_path / "m.json").read_text()) == {"b": 1.5}


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = atomic_write_bytes(tmp_path / "f.bin", b"old")
    with pytest.raises(RuntimeError), atomic_file(path) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("killed mid-write")
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


def test_a_full_disk_is_one_diskfull_line_and_the_old_file_stays(tmp_path, monkeypatch):
    import errno
    import os

    from dschat.diskfull import DiskFull

    path = atomic_write_bytes(tmp_path / "f.json", b"old")
    real_replace = os.replace

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(DiskFull, match=r"disk full while writing a file .*f\.json.*previous version is kept"):
        write_json(path, {"new": 1})
    monkeypatch.setattr(os, "replace", real_replace)
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]
