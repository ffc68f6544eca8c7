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
    return subprocess.run([sys.executable, "-c", "from dschat.cli import cli; cli()", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=full_env)


def read_json(path: str | Path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def kill_when_state_saved(args: list[str], output_dir: Path, timeout: int = 600) -> None:
    """Start ``dschat ARGS``, SIGKILL it as soon as a resumable state exists, and wait for it to die."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-c", "from dschat.cli import cli; cli()", *args], cwd=ROOT,
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
    from dschat.cli import stage_module
    from dschat.config import RewardConfig, SFTConfig

    step = 2 if isinstance(cfg, RewardConfig) else 1 if isinstance(cfg, SFTConfig) else 3
    return stage_module(step).run(cfg)
