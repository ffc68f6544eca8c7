"""One run per output folder, a folder that cannot be one, and nodes that do not share it (docs/operations.md,
Locks)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from dschat.training.lock import LOCK_NAME
from tests.helpers import ROOT, read_jsonl, run_cli, run_two_nodes
from tests.reliability.conftest import TRAIN, fresh_copy, one_line_error


def test_two_runs_started_together_into_one_folder(tmp_path, small_data):
    """The same command twice, a moment apart: one run trains, the other stops at once with
    one line naming the holder; the folder holds exactly the winner's metrics."""
    out = tmp_path / "run"
    args = [sys.executable, "-c", "from dschat.cli.main import cli; cli()", *TRAIN, "--data", str(small_data),
            "--output-dir", str(out), "--max-steps", "20", "--no-save-final-state"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = []
    try:
        for _ in range(2):
            procs.append(subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                          text=True, env=env))
            time.sleep(0.5)
        results = [(p.pid, p.returncode, err) for p in procs for _, err in [p.communicate(timeout=600)]]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    winners = [r for r in results if r[1] == 0]
    losers = [r for r in results if r[1] != 0]
    assert len(winners) == 1 and len(losers) == 1, [(r[0], r[1], r[2][-1500:]) for r in results]
    loser = subprocess.CompletedProcess(args, losers[0][1], "", losers[0][2])
    one_line_error(loser, str(out), f"pid {winners[0][0]}", socket.gethostname(), "in use by another run")
    steps = [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r]
    assert steps == list(range(1, 21))  # exactly the winner's lines


def test_a_killed_runs_lock_is_taken_over(trained, tmp_path, small_data):
    out = fresh_copy(trained, tmp_path / "run")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that no longer runs, as a run killed with -9 leaves it
    (out / LOCK_NAME).write_text(json.dumps({"pid": gone.pid, "host": socket.gethostname(), "started": "earlier"}))
    proc = run_cli(*TRAIN, "--data", str(small_data), "--output-dir", str(out), "--max-steps", "3", "--resume",
                   "--no-save-final-state")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"took over the lock of a run that is gone (pid {gone.pid}" in proc.stderr
    assert (out / LOCK_NAME).read_text() == ""  # the run ended on its own: its note is cleared


def test_a_finished_run_leaves_no_lock_note(trained, tmp_path, small_data):
    """The next run in a folder whose last run finished (``--resume`` or ``--force``) says nothing of a lock."""
    out = fresh_copy(trained, tmp_path / "run")
    assert (out / LOCK_NAME).read_text() == ""
    for flag in ("--resume", "--force"):
        proc = run_cli(*TRAIN, "--data", str(small_data), "--output-dir", str(out), "--max-steps", "3", flag,
                       "--no-save-final-state")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "lock" not in proc.stderr and (out / LOCK_NAME).read_text() == ""


def test_output_dir_that_is_a_file(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("not a folder")
    proc = run_cli(*TRAIN, "--output-dir", str(path), "--max-steps", "1")
    one_line_error(proc, str(path), "is a file")
    assert path.read_text() == "not a folder"


def test_output_dir_that_cannot_be_written(tmp_path):
    if os.geteuid() == 0:  # root writes anywhere a mode bit forbids; sysfs refuses even root
        path = "/sys/dschat-reliability-test"
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        path = str(ro / "out")
    proc = run_cli(*TRAIN, "--output-dir", path, "--max-steps", "1")
    one_line_error(proc, path)


@pytest.mark.slow
def test_nodes_without_a_shared_output_folder_stop_with_one_line(tmp_path, small_data):
    """Two launchers as two nodes on this machine (as tests/test_launch.py), each node with its own output
    folder: every rank stops at the start with the same line instead of disagreeing about checkpoints later."""
    codes, logs = run_two_nodes(tmp_path, lambda rank: [
        "--model", "tiny", "--data", str(small_data), "--max-seq-len", "64", "--max-steps", "2", "--no-progress",
        "--output-dir", str(tmp_path / f"node{rank}-out")], timeout=300)
    assert all(c != 0 for c in codes), logs
    for log in logs:
        errors = {line.split("dschat: error: ", 1)[1] for line in log.splitlines() if "dschat: error: " in line}
        assert len(errors) == 1 and "not one folder shared by every node: rank 1" in errors.pop(), log[-3000:]
        assert "Traceback" not in log, log[-3000:]
    assert not (tmp_path / "node0-out" / "checkpoints").exists()
