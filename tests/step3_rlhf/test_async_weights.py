"""Stage 3's weights on the weight plane with a sampler (``dschat.generation.weight_plane``), as users run it:

- ``--generation-backend hf`` under a sampler trains on the log-probs the sampler computed (the decoupled loss's
  weights stay near 1 with a sampler that holds the trainer's weights), not on zeros;
- ``--actor-lora-dim 8`` sends the base once, then the adapters alone: a later update is under a tenth of the full;
- two trainer ranks at ZeRO-3 share a sampler at K = 1 (on a world group without a CPU backend, as NCCL);
- a sampler killed in the middle of a weight update stops the trainer in one line with the state of its last
  completed step saved (exit 4), on one rank and on every rank of two loopback "nodes";
- where a spawned sampler runs: ``cuda:N`` its own GPU (``CUDA_VISIBLE_DEVICES``), no launcher variable, the secret
  in its environment; every ``--vllm-*`` engine flag on its command line; a trainer rank's GPU refused unless shared;
- a vLLM sampler (vLLM's CPU build) fed by the plane trains GRPO with the run's ``--vllm-*`` flags.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dschat.config import build_config
from dschat.demo import demo_files
from dschat.errors import UserError
from dschat.generation.vllm_engine import vllm_installed
from dschat.rlhf.config import RLHFConfig
from tests.helpers import ROOT, assert_cuda_only_world, cuda_only_world, read_jsonl, run_cli, run_two_nodes
from tests.helpers import fraction_changed as moved
from tests.helpers import run_stage as run
from tests.step3_rlhf.test_async_rollouts import LENGTH, cfg_of

needs_vllm = pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed")


def async_rows(out: Path) -> list[dict]:
    return [r for r in read_jsonl(out / "metrics.jsonl") if "async/lag_max" in r]


@pytest.mark.slow
def test_hf_under_a_sampler_trains_on_the_log_probs_the_sampler_computed(tmp_path):
    out = tmp_path / "hf"
    run(cfg_of(out, async_rollouts=True, max_staleness=1, max_steps=3, generation_backend="hf"))
    rows = async_rows(out)
    assert len(rows) == 3 and rows[-1]["async/lag_max"] == 1
    # one update behind, a few 1e-3 apart; zeros for log-probs would give weights of about 4e-4
    assert all(abs(r["async/is_weight_mean"] - 1) <= 0.05 for r in rows), [r["async/is_weight_mean"] for r in rows]
    assert all(r["async/kl_behaviour_prox"] < 0.05 for r in rows)
    assert moved(out) > 0.5


def _tiny_bytes(lora_dim: int) -> tuple[int, int]:
    """The tiny preset's bytes in fp32: the whole model, and its rank-``lora_dim`` adapters on every linear layer."""
    from dschat.config import LoraArgs
    from dschat.models.loading import create_causal_lm, resolve_model
    from dschat.models.lora import apply_lora

    model = apply_lora(create_causal_lm(resolve_model("tiny")), LoraArgs(lora_dim=lora_dim))
    adapters = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    return (sum(p.numel() for p in model.parameters()) - adapters) * 4, adapters * 4


@pytest.mark.slow
def test_lora_sends_the_base_once_then_the_adapters_alone(tmp_path):
    out = tmp_path / "lora"
    run(cfg_of(out, async_rollouts=True, max_staleness=1, max_steps=3, actor_lora_dim=8))
    rows = async_rows(out)
    whole, adapters = _tiny_bytes(8)
    sent = [r["sync/bytes"] for r in rows if "sync/bytes" in r]
    assert sent and sent[-1] == adapters  # a later update: the adapters and nothing else (all the rest is frozen)
    assert adapters <= 0.1 * whole  # under a tenth of the full update (the merged model, as sent before)
    assert all(abs(r["async/is_weight_mean"] - 1) <= 0.05 for r in rows)  # the sampler's merge is the model
    assert moved(out) > 0.5  # the saved actor, merged: every adapted layer moved


@pytest.mark.slow
def test_two_ranks_at_zero3_share_a_sampler(tmp_path):
    reward = tmp_path / "length_reward.py"
    reward.write_text(LENGTH)
    out = tmp_path / "z3"
    proc = run_cli("train", "--step", "3", "--num-gpus", "2", "--algo", "grpo", "--actor-model", "tiny",
                   "--actor-zero-stage", "3", "--data", str(demo_files()["prompts"]), "--reward-funcs",
                   f"{reward}:length", "--num-generations", "2", "--max-steps", "3", "--max-answer-seq-len", "10",
                   "--per-device-generation-batch-size", "2", "--per-device-train-batch-size", "2",
                   "--max-eval-rows", "2", "--per-device-eval-batch-size", "2", "--no-progress", "--async-rollouts",
                   "--max-staleness", "1", "--output-dir", str(out), timeout=900, env=cuda_only_world(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_cuda_only_world(tmp_path)
    rows = async_rows(out)
    assert len(rows) == 3 and rows[-1]["async/lag_max"] == 1 and all(r["async/lag_max"] <= 1 for r in rows)
    assert all(r["sync/bytes"] > 0 for r in rows if "sync/bytes" in r) and "world 2" in proc.stderr
    assert moved(out) > 0.5


# ------------------------------------------------------------------------------------ a sampler killed mid-update
TOKEN = "a secret the killed sampler's run shares"
# A sampler that kills itself as it is about to take the bucket of its third weight update (the one sent after the
# trainer's second step): the trainer is then in the middle of sending it.
KILLER = ("import os, signal\nimport dschat.generation.weight_plane as W\nseen = []\n"
          "def die(i):\n    seen.append(i)\n    if len(seen) == 3:\n        os.kill(os.getpid(), signal.SIGKILL)\n"
          "W.ON_BUCKET = die\nfrom dschat.cli.main import cli\ncli()\n")


def _killer(port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", KILLER, "sampler", "--model", "tiny", "--listen",
                             f"127.0.0.1:{port}", "--device", "cpu", "--generation-backend", "dschat", "--timeout",
                             "120"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "DSCHAT_SAMPLER_TOKEN": TOKEN})


def _stage3_args(tmp_path: Path, port: int, out: Path) -> list[str]:
    reward = tmp_path / "length_reward.py"
    reward.write_text(LENGTH)
    token = tmp_path / "token"
    token.write_text(TOKEN)
    return ["--algo", "grpo", "--actor-model", "tiny", "--data", str(demo_files()["prompts"]), "--reward-funcs",
            f"{reward}:length", "--num-generations", "2", "--max-steps", "8", "--max-answer-seq-len", "10",
            "--per-device-generation-batch-size", "2", "--per-device-train-batch-size", "2", "--max-eval-rows", "2",
            "--per-device-eval-batch-size", "2", "--no-progress", "--sampler", f"127.0.0.1:{port}",
            "--sampler-token-file", str(token), "--max-staleness", "1", "--sampler-timeout", "30",
            "--output-dir", str(out)]


STOPPED = re.compile(r"dschat: error: the sampler (died|is gone)[^\n]*; the state of step (\d+) is (\S+); continue "
                     r"with --resume once the sampler answers$")


@pytest.mark.slow
def test_a_sampler_killed_mid_update_stops_the_trainer_with_its_state_saved(tmp_path):
    from dschat.utils import free_port

    port = free_port()
    sampler = _killer(port)
    out = tmp_path / "run"
    try:
        proc = run_cli("train", "--step", "3", *_stage3_args(tmp_path, port, out), timeout=300)
    finally:
        sampler.kill()
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 4 and (found := STOPPED.match(last)), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert Path(found.group(3)).is_dir() and int(found.group(2)) >= 1  # the state it names is there


@pytest.mark.slow
def test_a_sampler_killed_mid_update_stops_every_rank_of_two_nodes_with_the_state_saved(tmp_path):
    from dschat.utils import free_port

    port = free_port()
    sampler = _killer(port)
    out = tmp_path / "out"
    args = _stage3_args(tmp_path, port, out)
    try:
        codes, logs = run_two_nodes(tmp_path, lambda rank: args, extra_env={"STEP": "3", **cuda_only_world(tmp_path)})
    finally:
        sampler.kill()
    assert codes == [4, 4], logs[0][-3000:] + logs[1][-3000:]
    steps = set()
    for log in logs:
        lines = [line for line in log.splitlines() if line.startswith("dschat: error: ")]
        assert len(lines) == 1 and (found := STOPPED.search(lines[0])), log[-3000:]
        steps.add(int(found.group(2)))
        assert "Traceback" not in log
    assert len(steps) == 1 and (out / "checkpoints").is_dir()  # one state, of the same step, on every rank


# ----------------------------------------------------------------------------------------------- placement
def _cfg(**kw):
    return build_config(RLHFConfig, {"algo": "grpo", "actor_model": "tiny", "async_rollouts": True, **kw})


def test_a_spawned_sampler_on_cuda_n_gets_that_gpu_alone_and_no_launcher_variables(monkeypatch):
    from dschat.rlhf.async_rollouts import sampler_launch

    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
                 "LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}.items():
        monkeypatch.setenv(k, v)
    cmd, env = sampler_launch(_cfg(sampler_devices="cuda:3"), 4321, "cuda:3", [], "bf16", "the-secret")
    assert env["CUDA_VISIBLE_DEVICES"] == "7"  # the trainer's cuda:3, the only GPU the sampler sees
    assert cmd[cmd.index("--device") + 1] == "cuda:0" and cmd[cmd.index("--listen") + 1] == "127.0.0.1:4321"
    assert not {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"} & set(env)
    assert env["DSCHAT_SAMPLER_TOKEN"] == "the-secret" and "the-secret" not in " ".join(cmd)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    _, env = sampler_launch(_cfg(sampler_devices="cuda:3"), 4321, "cuda:3", [], "bf16", "s")
    assert env["CUDA_VISIBLE_DEVICES"] == "3"


def test_every_vllm_engine_flag_reaches_a_spawned_sampler():
    from dschat.config import VLLM_ENGINE_FLAGS
    from dschat.rlhf.async_rollouts import sampler_launch

    given = {"vllm_gpu_memory_utilization": 0.8, "vllm_kv_cache_memory": 512, "vllm_tensor_parallel_size": 2,
             "vllm_enable_sleep": False}
    assert set(given) == set(VLLM_ENGINE_FLAGS)
    cmd, _ = sampler_launch(_cfg(generation_backend="vllm", sampler_devices="cuda:1", **given), 1, "cuda:1", [],
                            "bf16", "s")
    line = " ".join(cmd)
    assert all(f in line for f in ("--vllm-gpu-memory-utilization 0.8", "--vllm-kv-cache-memory 512",
                                   "--vllm-tensor-parallel-size 2", "--no-vllm-enable-sleep"))
    cmd, _ = sampler_launch(_cfg(generation_backend="vllm", sampler_devices="cuda:0", sampler_share_gpu=True), 1,
                            "cuda:0", [], "bf16", "s")  # sharing a trainer's GPU: today's colocated settings
    assert "--vllm-gpu-memory-utilization 0.3" in " ".join(cmd) and "--vllm-enable-sleep" in cmd
    cmd, _ = sampler_launch(_cfg(sampler_devices="cuda:1"), 1, "cuda:1", [], "bf16", "s")
    assert not any(c.startswith("--vllm") for c in cmd)  # the dschat backend takes none


def test_a_gpu_a_trainer_rank_uses_is_refused_unless_shared(monkeypatch):
    from dschat.rlhf.config import check_sampler_start

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # a launcher's four ranks on this node: GPUs 0-3
    with pytest.raises(UserError) as caught:
        check_sampler_start(_cfg(sampler_devices="cuda:3"))
    assert str(caught.value) == ("--sampler-devices cuda:3: a trainer rank of this node trains on it (GPUs 0, 1, 2, "
                                 "3); name another GPU, or pass --sampler-share-gpu")
    check_sampler_start(_cfg(sampler_devices="cuda:3", sampler_share_gpu=True))
    check_sampler_start(_cfg(sampler_devices="cuda:4"))


# ------------------------------------------------------------------------------------------------- vLLM
@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
def test_a_vllm_sampler_fed_by_the_plane_trains_with_the_run_s_vllm_flags(tmp_path, lora):
    from tests.families import build_family

    model = build_family("llama3", tmp_path, heads=2)  # 32-wide heads, as vLLM's CPU attention needs
    reward = tmp_path / "length_reward.py"
    reward.write_text(LENGTH)
    out = tmp_path / "vllm"
    proc = run_cli("train", "--step", "3", "--algo", "grpo", "--actor-model", str(model), "--data",
                   str(demo_files()["prompts"]), "--reward-funcs", f"{reward}:length", "--num-generations", "2",
                   "--max-steps", "2", "--max-answer-seq-len", "10", "--per-device-generation-batch-size", "2",
                   "--per-device-train-batch-size", "2", "--max-eval-rows", "2", "--per-device-eval-batch-size", "2",
                   "--no-progress", "--generation-backend", "vllm", "--vllm-kv-cache-memory", "96",
                   "--async-rollouts", "--max-staleness", "1", "--output-dir", str(out),
                   *(["--actor-lora-dim", "8", "--actor-lora-module-name", "q_proj,v_proj"] if lora else []),
                   timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[sampler] vLLM torch.float32 | max length " in proc.stderr and "KV cache 96 MiB" in proc.stderr
    assert ("LoRA rank 8 x 2 adapters" in proc.stderr) == lora  # vLLM's own adapters, K + 1 of them
    rows = async_rows(out)
    assert len(rows) == 2 and all(r["sync/bytes"] > 0 for r in rows if "sync/bytes" in r)
    if lora:  # after the first, the adapters alone
        assert rows[-1]["sync/bytes"] < 0.1 * max(r["sync/bytes"] for r in rows) or len(rows) < 2
    assert all(abs(r["async/is_weight_mean"] - 1) <= 0.05 for r in rows)  # vLLM's log-probs are the trainer's
    assert torch.cuda.is_available() or "GPU memory share" not in proc.stderr
