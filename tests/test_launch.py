"""The scripts in ``launch/``: they parse, forward their arguments, and a two-"node" run on this machine works
through ``multi_node_no_ssh.sh`` (two launchers with --no_ssh, one per node rank, meeting at 127.0.0.1)."""

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, assert_cuda_only_world, cuda_only_world, read_json, run_two_nodes

LAUNCH = ROOT / "launch"
SCRIPTS = ["single_process.sh", "single_node.sh", "multi_node_hostfile.sh", "multi_node_no_ssh.sh", "slurm.sbatch"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_parses_and_is_executable(name):
    path = LAUNCH / name
    assert os.access(path, os.X_OK), f"{name} is not executable"
    assert "set -euo pipefail" in path.read_text()
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _dry_run(name: str, *args: str, cwd, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "DRY_RUN": "1", "PYTHON": sys.executable, **env}
    return subprocess.run([str(LAUNCH / name), *args], cwd=cwd, env=full, capture_output=True, text=True,
                          timeout=60)


def test_scripts_forward_arguments_from_any_directory(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=2\nnode-b slots=2\n")
    proc = _dry_run("multi_node_no_ssh.sh", "--model", "tiny", "--output-dir", "out dir", cwd=tmp_path,
                    STEP="3", NODE_RANK="1", MASTER_ADDR="10.0.0.1", MASTER_PORT="29555", HOSTFILE=str(hostfile))
    assert proc.returncode == 0, proc.stderr
    for part in ("-m deepspeed.launcher.runner", f"--hostfile {hostfile}", "--no_ssh", "--node_rank 1",
                 "--master_addr 10.0.0.1", "--master_port 29555", f"{ROOT}/step3_rlhf/main.py --model tiny",
                 "--output-dir out\\ dir"):
        assert part in proc.stderr, (part, proc.stderr)

    proc = _dry_run("single_process.sh", "--max-steps", "3", cwd=tmp_path, STEP="2")
    assert proc.returncode == 0 and f"{ROOT}/step2_reward/main.py --max-steps 3" in proc.stderr

    proc = _dry_run("single_node.sh", "--model", "tiny", cwd=tmp_path, NUM_GPUS="4", MASTER_PORT="29556")
    assert proc.returncode == 0
    assert "dschat train --step 1 --num-gpus 4 --master-port 29556 --model tiny" in proc.stderr

    proc = _dry_run("multi_node_hostfile.sh", "--model", "tiny", cwd=tmp_path, HOSTFILE=str(hostfile),
                    DSCHAT_CACHE="/shared/dschat cache", NUM_NODES="2")
    assert proc.returncode == 0, proc.stderr
    assert "--launcher pdsh" in proc.stderr and "--num_nodes 2" in proc.stderr
    assert "DSCHAT_CACHE=/shared/dschat\\ cache" in proc.stderr  # reaches the other nodes through DS_ENV_FILE


def test_scripts_reject_missing_settings(tmp_path):
    proc = _dry_run("multi_node_no_ssh.sh", cwd=tmp_path, MASTER_ADDR="10.0.0.1", HOSTFILE="/nonexistent",
                    NODE_RANK="")
    assert proc.returncode == 2 and "NODE_RANK" in proc.stderr
    proc = _dry_run("multi_node_no_ssh.sh", cwd=tmp_path, NODE_RANK="0", MASTER_ADDR="10.0.0.1",
                    HOSTFILE=str(tmp_path / "missing"))
    assert proc.returncode == 2 and "hostfile" in proc.stderr
    proc = _dry_run("single_process.sh", cwd=tmp_path, STEP="4")
    assert proc.returncode == 2 and "STEP" in proc.stderr


@pytest.mark.slow
def test_two_nodes_without_ssh_on_localhost(tmp_path):
    """Two launchers, as if on two nodes, each starting one CPU rank; they meet at 127.0.0.1 (gloo)."""
    out = tmp_path / "out"
    args = ["--model", "tiny", "--output-dir", str(out), "--max-steps", "4", "--no-progress", "--force"]
    codes, logs = run_two_nodes(tmp_path, lambda rank: args, extra_env=cuda_only_world(tmp_path))
    tails = "\n".join(log[-3000:] for log in logs)
    assert codes == [0, 0], tails
    assert_cuda_only_world(tmp_path)  # dschat's collectives ran on a world group with no CPU backend, as NCCL

    assert read_json(out / "args.json")["world_size"] == 2
    assert (out / "eval.json").exists()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "model")
    assert sum(p.numel() for p in model.parameters()) > 0


@pytest.mark.parametrize("script", sorted(p.relative_to(ROOT).as_posix()
                                          for p in (ROOT / "step1_sft" / "training_scripts").glob("*/*.sh")))
def test_stage1_training_scripts_pass_only_known_flags(script):
    from dschat.config import SFTConfig, flag_specs

    args = ["MODEL", "OUT"] if "multi_node" in script else ["OUT"]
    proc = subprocess.run(["bash", str(ROOT / script), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "DRY_RUN": "1", "HOSTFILE": str(ROOT / "launch" / "hostfile.example")})
    assert proc.returncode == 0, proc.stderr
    known = {s.name.replace("_", "-") for s in flag_specs(SFTConfig)}
    flags = [w[2:] for w in proc.stderr.split() if w.startswith("--")]
    launcher = {"step", "num-gpus", "hostfile", "master-port", "master-addr", "num-nodes", "include", "launcher",
                "no-ssh", "node-rank", "ssh-port", "no_ssh", "node_rank", "master_addr", "master_port", "ssh_port"}
    unknown = [f for f in flags if f.split("=")[0] not in known | launcher]
    assert "--output-dir" in proc.stderr and not unknown, unknown
