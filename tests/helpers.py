"""Shared test helpers: running the CLI in a subprocess and reading run outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """``dschat ARGS`` in a fresh process (as a user runs it); returns the completed process."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-c", "from dschat.cli.main import cli; cli()", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=full_env)


def read_json(path: str | Path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def kill_when_state_saved(args: list[str], output_dir: Path, timeout: int = 600) -> None:
    """Start ``dschat ARGS``, SIGKILL it as soon as a resumable state exists, and wait for it to die."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-c", "from dschat.cli.main import cli; cli()", *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    latest = Path(output_dir) / "checkpoints" / "latest"
    deadline = time.time() + timeout
    try:
        while not latest.exists():
            if proc.poll() is not None:
                raise AssertionError(f"run ended (exit {proc.returncode}) before saving a state")
            if time.time() > deadline:
                raise AssertionError("no state saved in time")
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait()


def losses(path: str | Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in read_jsonl(Path(path) / "metrics.jsonl") if key in r}


def run_stage(cfg):
    """Run the stage whose config ``cfg`` is, in-process, through the CLI's stage lookup (as ``dschat train``)."""
    from dschat.cli.train import stage_module
    from dschat.config import RewardConfig, SFTConfig

    step = 2 if isinstance(cfg, RewardConfig) else 1 if isinstance(cfg, SFTConfig) else 3
    return stage_module(step).run(cfg)


CUDA_ONLY_WORLD = ROOT / "tests" / "cuda_only_world"


def cuda_only_world(tmp_path: Path) -> dict[str, str]:
    """The environment under which a launched run's world group has no CPU backend for dschat's collectives, as
    NCCL has none (``tests/cuda_only_world``); each rank reports to ``tmp_path/cuda_only_world``."""
    report = tmp_path / "cuda_only_world"
    report.mkdir(exist_ok=True)
    path = [str(CUDA_ONLY_WORLD), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(path), "CUDA_ONLY_WORLD_REPORT": str(report)}


def assert_cuda_only_world(tmp_path: Path, ranks: int = 2) -> None:
    """Every rank ran on the emulated CUDA-only world group, and dschat made collectives on it."""
    reports = [json.loads(p.read_text()) for p in sorted((tmp_path / "cuda_only_world").glob("rank*.json"))]
    assert len(reports) == ranks, reports
    assert all(r["world"] == "cuda:gloo" and r["dschat"] > 0 for r in reports), reports


def run_two_nodes(tmp_path, args_of_rank, timeout: int = 600,
                  extra_env: dict[str, str] | None = None) -> tuple[list[int], list[str]]:
    """Two ``launch/multi_node_no_ssh.sh`` launchers as two nodes on this machine (hostfile ``localhost`` and
    ``127.0.0.1``, one CPU rank each, meeting at 127.0.0.1 over gloo), running stage 1 with ``args_of_rank(r)``.

    Returns the exit codes and the logs. Each launcher has a session of its own, so a timeout ends it and the
    ranks it started.
    """
    import contextlib
    import signal
    import socket

    from dschat.models.loading import resolve_model

    resolve_model("tiny")  # built once here: both launchers would otherwise race to build it in the shared cache
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "HOSTFILE": str(hostfile), "STEP": "1", **(extra_env or {})}
    env.pop("DRY_RUN", None)
    procs = []
    with contextlib.ExitStack() as stack:
        for rank in (0, 1):
            log = stack.enter_context(open(tmp_path / f"node{rank}.log", "w"))
            procs.append(subprocess.Popen([str(ROOT / "launch" / "multi_node_no_ssh.sh"), *args_of_rank(rank)],
                                          cwd=tmp_path, env={**env, "NODE_RANK": str(rank)}, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        try:
            codes = [p.wait(timeout=timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
    return codes, [(tmp_path / f"node{r}.log").read_text() for r in (0, 1)]


def fraction_changed(out: Path, folder: str = "actor") -> float:
    """The share of the tiny preset's tensors that differ in ``out/folder`` (did a stage-3 run train?)."""
    import torch
    from safetensors.torch import load_file

    from dschat.models.loading import resolve_model

    start = load_file(str(resolve_model("tiny")) + "/model.safetensors")
    trained = load_file(str(Path(out) / folder / "model.safetensors"))
    return sum(not torch.equal(start[k], trained[k]) for k in start) / len(start)
