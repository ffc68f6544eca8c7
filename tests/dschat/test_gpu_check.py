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
    assert list(report["parts"]) == ["setup", "grpo", "stages", "ppo", "weights", "decode"]
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
    weights = report["weights"]  # the plane's plumbing on a CPU; the GPU's rows say why they are not measured
    assert {k: weights[k] for k in ("copy", "pack", "update_nccl", "vllm_sampler")} == \
        {k: {"skipped": "no CUDA device"} for k in ("copy", "pack", "update_nccl", "vllm_sampler")}
    assert weights["update_gloo"]["rc"] == 0 and weights["update_gloo"]["gbps"] > 0
    assert weights["lora_adapter"]["rc"] == 0 and 0 < weights["lora_adapter"]["adapter_over_full_bytes"] < 0.1
    env = report["env"]
    assert any(name.startswith("deepspeed-") for name in env["carried"])
    assert not any(name.startswith(("transformers-", "numpy-", "torch-")) for name in env["carried"])
    assert env["commit"] == (carry / "dschat" / "COMMIT").read_text().split()[1]
    for log in ("part-setup", "part-grpo", "part-stages", "part-ppo", "part-weights", "part-decode", "stage1",
                "grpo-dschat", "ppo", "weights-gloo-send", "weights-gloo-recv"):
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


# ---------------------------------------------------------------------------------------------- the weights part
WEIGHT_ROWS = ("copy", "pack", "update_gloo", "update_nccl", "lora_adapter", "vllm_sampler")
TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)


def test_weights_arithmetic_by_hand() -> None:
    check = load_check()
    assert check.gbps(2e9, 0.5) == 4.0 and check.gbps(123456789, 1.0) == 0.1235  # four significant digits
    assert check.gbps(3e9, 0) is None and check.gbps(3e9, None) is None and check.gbps(3e9, -1.0) is None
    assert check.ratio(3, 4) == 0.75 and check.ratio(1, 3) == 0.3333 and check.ratio(12.0, 48.0) == 0.25
    assert check.ratio(None, 2) is None and check.ratio(1, 0) is None and check.ratio(1, None) is None
    full = dict(kind="full", bytes=2_000_000_000)
    updates = [dict(full, s=9.0, stream_s=8.0, verdict_s=0.5, pack_s=1.0),  # the warm-up: left out
               dict(full, s=1.0, stream_s=0.5, verdict_s=0.1, pack_s=0.2),
               dict(full, s=2.0, stream_s=1.0, verdict_s=0.3, pack_s=0.4),
               dict(full, s=4.0, stream_s=2.0, verdict_s=0.2, pack_s=0.3)]
    assert check.timed_updates(updates, "full") == {
        "bytes": 2_000_000_000, "timed": 3, "s": 2.0, "stream_s": 1.0, "verdict_s": 0.2, "pack_s": 0.3,
        "gbps": 1.0, "stream_gbps": 2.0}  # 2 GB in 2 s; in 1 s
    assert check.timed_updates(updates[:1], "full")["s"] == 9.0  # one update alone: it is all there is
    assert check.timed_updates(updates, "adapter") == {}
    lora = [dict(kind="full", bytes=1000, s=3.0), dict(kind="full", bytes=1000, s=2.0),
            dict(kind="adapter", bytes=30, s=5.0), dict(kind="adapter", bytes=30, s=0.5),
            dict(kind="adapter", bytes=30, s=0.3)]
    assert check.lora_row(lora) == {"full_bytes": 1000, "full_s": 2.0, "full_gbps": 5e-07, "adapter_bytes": 30,
                                    "adapter_s": 0.4, "adapter_over_full_bytes": 0.03, "adapter_over_full_s": 0.2}
    argv = ["train", "--generation-backend", "auto", "--seed", "1"]
    assert check.with_flag(argv, "--generation-backend", "vllm") == ["train", "--generation-backend", "vllm",
                                                                     "--seed", "1"]
    assert check.with_flag(argv, "--dtype", "bf16") == [*argv, "--dtype", "bf16"]


def test_weights_rows_say_why_a_device_cannot_measure_them() -> None:
    check = load_check()
    cpu = check.weights_plan(cuda=False, gpus=0, vllm=True)
    assert list(cpu) == list(WEIGHT_ROWS)
    assert cpu == {"copy": "no CUDA device", "pack": "no CUDA device", "update_gloo": None,
                   "update_nccl": "no CUDA device", "lora_adapter": None, "vllm_sampler": "no CUDA device"}
    one = check.weights_plan(cuda=True, gpus=1, vllm=True)
    assert one == {"copy": None, "pack": None, "update_gloo": None,
                   "update_nccl": "NCCL needs two GPUs; this device has 1", "lora_adapter": None,
                   "vllm_sampler": "a vLLM sampler on a second GPU needs two GPUs; this device has 1"}
    assert check.weights_plan(cuda=True, gpus=2, vllm=False) == {**dict.fromkeys(WEIGHT_ROWS),
                                                                 "vllm_sampler": "vLLM is not installed"}
    assert check.weights_plan(cuda=True, gpus=4, vllm=True) == dict.fromkeys(WEIGHT_ROWS)
    assert "weights" in check.PARTS and check.parse(["--parts", "weights"]).parts == "weights"


def weights_report() -> dict:
    rows = {"copy": {"bytes": 2_000_000_000, "s": 0.001, "gbps": 2000.0},
            "pack": {"gbps": 500.0, "over_copy": 0.25},
            "update_gloo": {"rc": 0, "s": 1.25, "gbps": 1.6},
            "update_nccl": {"skipped": "NCCL needs two GPUs; this device has 1"},
            "lora_adapter": {"rc": 0, "full_bytes": 1000, "full_s": 2.0, "adapter_bytes": 30, "adapter_s": 0.4,
                             "adapter_over_full_bytes": 0.03},
            "vllm_sampler": {"skipped": "vLLM is not installed"}}
    return {"parts": {"setup": {"rc": 0, "log": "l"}, "weights": {"rc": 0, "log": "l"}},
            "setup": {"policy_params": 10}, "weights": {"gpus": 1, **rows}}


def test_problems_knows_the_weights_figures() -> None:
    check = load_check()
    report = weights_report()
    assert check.problems(report, ["setup", "weights"], smoke=True) == []
    del report["weights"]["update_gloo"]["gbps"]
    report["weights"]["lora_adapter"]["adapter_over_full_bytes"] = None
    del report["weights"]["vllm_sampler"]
    assert check.problems(report, ["weights"], smoke=True) == [
        "weights.update_gloo: no gbps", "weights.lora_adapter: no adapter_over_full_bytes",
        "weights.vllm_sampler: no result"]
    report = weights_report()
    report["weights"]["update_gloo"] = {"rc": 1, "tail": ["boom"]}
    report["weights"]["pack"] = {"error": "RuntimeError: out of memory"}
    assert check.problems(report, ["weights"], smoke=False) == ["weights.pack: RuntimeError: out of memory",
                                                                "weights.update_gloo: exit code 1"]
    assert check.problems(report, ["weights"], smoke=True)[-1] == "weights.update_gloo: no gbps"


def test_weights_summary_lines() -> None:
    check = load_check()
    assert check.summary(weights_report()) == [
        "weights copy: 2000.0 GB/s",
        "weights pack: 500.0 GB/s (0.25 of the copy)",
        "weights update_gloo: 1.25 s/update, 1.6 GB/s",
        "weights update_nccl: skipped: NCCL needs two GPUs; this device has 1",
        "weights lora_adapter: full 1000 B in 2.0 s, adapters 30 B in 0.4 s: 0.03 of the bytes",
        "weights vllm_sampler: skipped: vLLM is not installed"]


def test_copy_and_pack_rates_measure_what_they_say_on_a_cpu() -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dschat.generation import weight_plane as W

    check = load_check()
    copy = check.copy_rate(1 << 20, torch.device("cpu"), 3)
    assert copy["bytes"] == 1 << 20 and copy["reps"] == 3 and copy["gbps"] > 0
    assert copy["gbps"] == pytest.approx((1 << 20) / copy["s"] / 1e9, rel=1e-3)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    probe = W.probe_logprobs
    pack = check.pack_rate(model, 2, staging="device")  # off a GPU the staging is on the host
    assert W.probe_logprobs is probe  # put back
    assert pack["bytes"] == sum(p.numel() for p in model.parameters()) * 4 == W.plan_layout(model, "full").nbytes
    assert pack["gbps"] == pytest.approx(pack["bytes"] / pack["s"] / 1e9, rel=1e-3) and pack["staging"] == "cpu"
    assert pack["staging_bytes"] == pack["bytes"]  # one update's staging, made once and reused


def test_a_weights_pair_whose_side_fails_is_a_row_with_its_exit_code(tmp_path: Path) -> None:
    import time

    check = load_check()
    (tmp_path / "logs").mkdir()
    c = check.Check(tmp_path, tmp_path, time.time() + 120, smoke=True, compile_variants=False)
    side = {"device": "cpu", "dtype": "fp32"}
    row = check.weight_pair(c, "weights-broken", {"model": str(tmp_path / "nothing"), "nccl": False,
                                                  "kinds": ["full"], "send": side, "recv": side}, 60)
    assert row["rc"] not in (0, 124) and "updates" not in row, row
    assert any("nothing" in line for line in row["tail"]), row["tail"]
    assert check.problems({"parts": {"weights": {"rc": 0, "log": "l"}}, "weights": {"update_gloo": row}},
                          ["weights"], smoke=False) == [f"weights.update_gloo: exit code {row['rc']}"]


@pytest.mark.slow
def test_the_weights_part_on_a_cpu(tmp_path: Path) -> None:
    """The part end to end off a GPU (``--smoke``): the rows a GPU measures say why they are not, the gloo pair and
    the LoRA pair run between two processes of a CPU trainer and a CPU receiver, with the figures the layout
    gives by hand (the tiny preset: 586,048 parameters, fp32; r = 8 adapters on its 2 layers)."""
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke", "--parts", "weights",
                        "--out-dir", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["problems"] == [] and list(report["parts"]) == ["setup", "weights"]
    weights = report["weights"]
    for row in ("copy", "pack", "update_nccl", "vllm_sampler"):
        assert weights[row] == {"skipped": "no CUDA device"}, row
    params = report["setup"]["policy_params"]
    gloo = weights["update_gloo"]
    assert gloo["rc"] == 0 and gloo["group"] == "gloo" and gloo["trainer"] == gloo["receiver"] == "cpu fp32"
    assert gloo["bytes"] == params * 4 and gloo["timed"] == 1 and len(gloo["updates"]) == 2
    assert gloo["gbps"] == check_gbps(gloo["bytes"], gloo["s"]) > 0 and gloo["stream_s"] <= gloo["s"]
    lora = weights["lora_adapter"]
    adapters = 2 * 8 * (64 + 64 + 64 + 32 + 64 + 32 + 64 + 64 + 64 + 128 + 64 + 128 + 128 + 64)  # A r x in, B out x r
    assert lora["rc"] == 0 and lora["r"] == 8 and [u["kind"] for u in lora["updates"]] == ["full", "adapter", "adapter"]
    assert lora["full_bytes"] == (params + adapters) * 4 and lora["adapter_bytes"] == adapters * 4 == 65536
    assert lora["adapter_over_full_bytes"] == float(f"{adapters / (params + adapters):.4g}")
    assert "weights update_gloo: " in p.stdout and "weights update_nccl: skipped: no CUDA device" in p.stdout
    for log in ("part-weights", "weights-gloo-send", "weights-gloo-recv", "weights-lora-send", "weights-lora-recv"):
        assert (out / "logs" / f"{log}.log").is_file(), log


def check_gbps(nbytes: float, seconds: float) -> float:
    return float(f"{nbytes / seconds / 1e9:.4g}")
