"""A full disk during a save is one line naming what was written and the free space (exit 2);
the partial state is removed and the last complete one stays ``latest`` and resumes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers import ROOT, run_cli
from tests.reliability.conftest import TRAIN, one_line_error

# The CLI with torch.save failing as a full disk makes it fail, from the second training state on.
FULL_AT_STEP_2 = """
import errno, torch
real = torch.save
def save(obj, f, *args, **kwargs):
    if ".step-00000002.tmp" in str(f):
        with open(f, "wb") as out:
            out.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    return real(obj, f, *args, **kwargs)
torch.save = save
from dschat.cli.main import cli; cli()
"""


def states(out):
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def test_disk_full_during_a_state_save_keeps_the_last_good_state(tmp_path, small_data):
    out = tmp_path / "run"
    args = [*TRAIN, "--data", str(small_data), "--output-dir", str(out), "--max-steps", "3", "--save-interval", "1"]
    proc = subprocess.run([sys.executable, "-c", FULL_AT_STEP_2, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = one_line_error(proc, "disk full while writing a training state", ".step-00000002.tmp", " free on ",
                          "step-00000001 is kept")
    assert "B free" in line
    assert states(out) == ["latest", "step-00000001"]  # no .tmp left
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000001"
    proc = run_cli(*args, "--resume", "--no-save-final-state")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr and "step-00000001" in proc.stderr


@pytest.mark.slow
def test_a_30mb_tmpfs_fills_during_a_save(tmp_path, small_data):
    """The real thing: a 30 MB tmpfs output folder (a state of the tiny model is 17 MB). Needs root."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=30m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        out = mnt / "run"
        args = [*TRAIN, "--data", str(small_data), "--max-steps", "4", "--save-interval", "1"]
        proc = run_cli(*args, "--output-dir", str(out))
        line = one_line_error(proc, "disk full while writing", " free on ")
        leftovers = [p for p in out.rglob("*") if ".tmp" in p.name]
        assert not leftovers, leftovers
        latest = (out / "checkpoints" / "latest").read_text().strip()
        assert latest in line or "model" in line
        elsewhere = tmp_path / "elsewhere"
        shutil.copytree(out, elsewhere)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
    proc = run_cli(*args, "--output-dir", str(elsewhere), "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {elsewhere / 'checkpoints' / latest}" in proc.stderr
    assert json.loads((elsewhere / "eval.json").read_text())["steps"] == 4
