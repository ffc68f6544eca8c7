"""benchmarks/gpu_carry.sh and benchmarks/gpu_check.py: the carry folder comes from its one command within its size
limit (and the limit fails loudly), and the check runs from it (``--smoke``) in a python that has only torch,
transformers, peft and accelerate and what those pull in, as the GPU host has; a failing part makes the exit status
non-zero. The report's rules (what counts as a problem) and the commit without git are checked in-process."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from importlib.metadata import Distribution, PackageNotFoundError, distribution
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
CARRY = ROOT / "benchmarks" / "gpu_carry.sh"
HOST_PACKAGES = ("torch", "transformers", "peft", "accelerate")
PYV = f"{sys.version_info.major}.{sys.version_info.minor}"


def load_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(names: tuple[str, ...]) -> dict[str, Distribution]:
    """The installed distributions ``names`` need, with what they need (no extras)."""
    found: dict[str, Distribution] = {}

    def walk(name: str) -> None:
        if norm(name) in found:
            return
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            return
        found[norm(name)] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                walk(req.name)

    for name in names:
        walk(name)
    return found


def bare_python(dest: Path) -> Path:
    """A venv without pip or this machine's site packages whose site-packages links to the installed files of the
    host's packages alone: the GPU host's python. Its bin folder."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True)
    site = next(dest.glob("lib/python*/site-packages"))
    for dist in closure(HOST_PACKAGES).values():
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            src, link = Path(dist.locate_file(top)), site / top
            if src.exists() and not link.exists():
                link.symlink_to(src)
    return dest / "bin"


def carry_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, **extra}


def build_carry(dest: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CARRY), str(dest), PYV], capture_output=True, text=True, timeout=600,
                          env=carry_env(**env))


def folder_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


@pytest.fixture(scope="module")
def carry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("carry") / ".gpu"
    p = build_carry(dest)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "MiB (limit 64)" in p.stdout
    return dest


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bare_python(tmp_path_factory.mktemp("host") / "venv")


def run_carried(carry: Path, bare: Path, out: Path, *flags: str) -> subprocess.CompletedProcess:
    env = carry_env(PATH=f"{bare}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run(["bash", str(carry / "run.sh"), "--smoke", "--out-dir", str(out), *flags],
                          capture_output=True, text=True, timeout=900, env=env)


@pytest.mark.slow
def test_carry_within_its_limit_and_nothing_the_host_has(carry: Path, tmp_path: Path) -> None:
    assert folder_mib(carry) <= 64
    wheels = {norm(w.name.split("-")[0]) for w in (carry / "wheels").glob("*.whl")}
    assert {"deepspeed", "sentencepiece", "protobuf", "trl", "datasets"} <= wheels
    host = {"torch", "transformers", "peft", "accelerate", "numpy", "tokenizers", "safetensors", "pyyaml", "tqdm"}
    assert not wheels & (host | {"pyarrow", "pandas", "matplotlib", "tensorboard"})
    fields = dict(line.split(None, 1) for line in (carry / "dschat" / "COMMIT").read_text().splitlines())
    assert re.fullmatch(r"[0-9a-f]{40}", fields["commit"]) and fields["describe"]
    assert (carry / "dschat" / "benchmarks" / "gpu_check.py").read_text() == \
        (ROOT / "benchmarks" / "gpu_check.py").read_text()  # the working tree's code, not HEAD's

    p = build_carry(tmp_path / "small", DSCHAT_CARRY_LIMIT_MIB="1")
    assert p.returncode == 1
    assert re.fullmatch(r"gpu_carry.sh: \S+ is [\d.]+ MiB, over the 1 MiB limit", p.stderr.strip().splitlines()[-1])


@pytest.mark.slow
def test_smoke_from_the_carry_on_a_bare_python(carry: Path, bare: Path, tmp_path: Path) -> None:
    missing = subprocess.run([str(bare / "python3"), "-c", "import deepspeed"], capture_output=True, text=True)
    assert missing.returncode != 0  # the host lacks it: it must come from the carry
    out = tmp_path / "out"
    p = run_carried(carry, bare, out)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["problems"] == [] and report["ok"]
    assert all(row["rc"] == 0 for row in report["parts"].values())
    assert list(report["parts"]) == ["setup", "grpo", "stages", "ppo", "decode"]
    assert report["grpo"]["trl"] == {"skipped": "no pyarrow"}
    assert report["grpo"]["dschat"]["rc"] == 0 and report["grpo"]["dschat"]["step_s"] > 0
    assert report["grpo"]["dschat_async"]["rc"] == 0 and report["grpo"]["dschat_async"]["step_s"] > 0
    assert report["grpo"]["dschat_async"]["sampler_devices"] == "cpu" and report["grpo"]["lockstep_over_async"] > 0
    for stage in ("stage1", "stage2", "stage3_ppo"):
        row = report["stages"][stage]
        assert row["rc"] == 0 and row["steps"] == 2 and row["plan"]["rc"] == 0, stage
    assert report["ppo"]["rc"] == 0 and report["ppo"]["step_s"] > 0
    for backend in ("dschat", "graph", "hf"):
        assert report["decode"][backend]["ms_per_step"] > 0 and report["decode"][backend]["captures_in_timed"] == 0
    env = report["env"]
    assert any(name.startswith("deepspeed-") for name in env["carried"])
    assert not any(name.startswith(("transformers-", "numpy-", "torch-")) for name in env["carried"])
    assert env["commit"] == (carry / "dschat" / "COMMIT").read_text().split()[1]
    for log in ("part-setup", "part-grpo", "part-stages", "part-ppo", "part-decode", "stage1", "grpo-dschat", "ppo"):
        assert (out / "logs" / f"{log}.log").is_file(), log


@pytest.mark.slow
def test_smoke_exits_non_zero_when_a_part_fails(carry: Path, bare: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    p = run_carried(carry, bare, out, "--parts", "stages", "--inject-failure", "stages")
    assert p.returncode == 1, p.stdout[-2000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["parts"]["setup"]["rc"] == 0 and report["parts"]["stages"]["rc"] == 3
    assert report["problems"] and not report["ok"]
    assert "gpu_check: FAILED stages: its process exited 3" in p.stdout
    assert "failure injected" in (out / "logs" / "part-stages.log").read_text()


def test_problems_rows_errors_and_missing_figures() -> None:
    check = load_check()
    report = {"parts": {"setup": {"rc": 0, "log": "l"}, "grpo": {"rc": 0, "log": "l"}, "decode": {"rc": 0, "log": "l"}},
              "setup": {"policy_params": 10},
              "grpo": {"trl": {"skipped": "no pyarrow"}, "dschat": {"rc": 0, "step_s": 1.5},
                       "dschat_async": {"rc": 0, "step_s": 1.0, "sampler_devices": "cpu"}},
              "decode": {"rows": 8, "dschat": {"ms_per_step": 2.0, "captures_in_timed": 0},
                         "graph": {"ms_per_step": 1.0, "captures_in_timed": 2}, "hf": {"error": "boom"}}}
    assert check.problems(report, ["setup", "grpo"], smoke=True) == []
    found = check.problems(report, ["setup", "grpo", "decode", "ppo"], smoke=True)
    assert found == ["decode.hf: boom", "decode.graph: 2 captures in the timed run", "ppo: did not run"]
    assert check.problems(report, ["setup", "grpo", "decode", "ppo"], smoke=False) == ["decode.hf: boom"]
    del report["grpo"]["dschat_async"]  # the asynchronous row is a figure of its own
    assert check.problems(report, ["grpo"], smoke=True) == ["grpo.dschat_async: no result"]
    report["grpo"]["dschat"] = {"rc": 1, "step_s": None, "plan": {"rc": 0, "json": {"error": "not a row"}}}
    assert check.problems(report, ["grpo"], smoke=True) == ["grpo.dschat: exit code 1", "grpo.dschat: no step_s",
                                                            "grpo.dschat_async: no result"]
    report["parts"]["grpo"]["rc"] = 124
    assert check.problems(report, ["grpo"], smoke=False)[0] == "grpo: its process exited 124 (l)"


def test_commit_without_git(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    check = load_check()
    monkeypatch.setenv("PATH", str(tmp_path))  # no git on the path, as on the GPU host
    assert check.git("rev-parse", "HEAD") is None
    assert set(check.commit()) == {"commit", "describe"}
    monkeypatch.setattr(check, "ROOT", tmp_path)
    (tmp_path / "COMMIT").write_text("commit abc123\ndescribe abc123-dirty\n")
    assert check.commit() == {"commit": "abc123", "describe": "abc123-dirty"}


def test_children_keep_the_carried_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    check = load_check()
    monkeypatch.setenv("PYTHONPATH", "/carry/site")
    assert check.child_env()["PYTHONPATH"] == f"{check.ROOT}{os.pathsep}/carry/site"
