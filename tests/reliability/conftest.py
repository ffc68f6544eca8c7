"""Fixtures of the reliability cases: one small trained run shared by the module's tests (copied before a test
changes it), a tiny data file, and the checks every case makes on a failed command."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import run_cli

# A run as small as the tiny preset allows: two optimizer steps, a state after each.
TRAIN = ["train", "--step", "1", "--model", "tiny", "--max-seq-len", "64", "--no-progress"]


def one_line_error(proc, *needles: str, code: int = 2) -> str:
    """Assert the command failed with ``code``, one ``dschat: error:`` line naming ``needles``, no traceback."""
    err = proc.stderr
    assert proc.returncode == code, (proc.returncode, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("dschat: error:")]
    assert len(errors) == 1, err[-3000:]
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


def sft_rows(n: int = 40) -> list[dict]:
    return [{"prompt": f"\n\nHuman: what is {i} plus {i}?\n\nAssistant:", "response": f" It is {2 * i}."}
            for i in range(n)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def small_data(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("data") / "sft.jsonl", sft_rows())


@pytest.fixture(scope="session")
def trained(tmp_path_factory, small_data) -> Path:
    """A finished step-1 run with states after steps 1 and 2 and its data cache beside it in ``cache/`` (do not
    modify: copy with ``fresh_copy``)."""
    out = tmp_path_factory.mktemp("trained") / "run"
    proc = run_cli(*TRAIN, "--data", str(small_data), "--output-dir", str(out), "--max-steps", "2",
                   "--save-interval", "1", "--data-cache-dir", str(out.parent / "cache"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def fresh_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


class Evil:
    """Unpickling it creates ``marker``: proof that a loader ran code from a file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))
