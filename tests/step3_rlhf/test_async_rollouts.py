"""Stage 3 with asynchronous rollouts (``dschat.rlhf.async_rollouts``): a sampler process samples while the trainer
trains, at most ``--max-staleness`` updates behind.

Checked on the tiny preset, each run with a sampler process of its own: K = 0 gives the lockstep run's figures bit
for bit; K = 1 and 2 train every sampling algorithm with no answer older than K (and K reached); a damaged weight
update stops the run in one line; a sampler killed mid-run stops the trainer within the timeout with a state that
resumes; a trainer killed with -9 leaves no sampler behind, and its resumed run equals the uninterrupted one; the
trainer on two loopback "nodes" (on a world group with no CPU backend, as NCCL) with a sampler started apart.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dschat.config import build_config
from dschat.demo import demo_files
from dschat.errors import UserError
from dschat.rlhf.config import RLHFConfig
from tests.helpers import ROOT, assert_cuda_only_world, cuda_only_world, read_json, read_jsonl, run_cli, run_two_nodes
from tests.helpers import fraction_changed as moved
from tests.helpers import run_stage as run

ALGO_FLAGS = {
    "ppo": {"reward_model": "tiny", "generation_batches": 2},  # two prompt batches per step
    "grpo": {"loss_type": "dapo", "num_generations": 2},  # dynamic sampling: steps draw as many batches as needed
    "rloo": {"num_generations": 2},
    "reinforce_pp": {"num_generations": 2},
    "reinforce_pp_baseline": {"num_generations": 2},
    "remax": {"num_generations": 2},  # a greedy call, then the sampled one, per batch
    "online_dpo": {"num_generations": 2},
}
# A reward by length, so the random tiny actor's answers to one prompt (almost always) differ and it has a gradient.
LENGTH = "def length(prompts, completions, **fields):\n    return [len(c) / 10 for c in completions]\n"
POLICY_GRADIENT = ("ppo", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax")
TRAIN_KEYS = ("train/reward", "train/actor_loss", "train/kl", "train/answer_length")


def cfg_of(out: Path, algo: str = "grpo", **kw):
    base = {"algo": algo, "actor_model": "tiny", "output_dir": str(out), "max_steps": 4, "max_answer_seq_len": 10,
            "per_device_generation_batch_size": 2, "per_device_train_batch_size": 2, "max_eval_rows": 2,
            "per_device_eval_batch_size": 2, "progress": False, "force": True, "sampler_timeout": 60.0,
            **ALGO_FLAGS[algo]}
    if algo != "ppo":
        reward = out.parent / "length_reward.py"
        reward.write_text(LENGTH)
        base.update(data=[str(demo_files()["prompts"])], reward_funcs=[f"{reward}:length"])
    base.update(kw)
    return build_config(RLHFConfig, base)


def figures(out: Path) -> list[dict]:
    """Each row of metrics.jsonl without the keys that measure time, memory or the asynchronous machinery."""
    skip = ("time", "memory/", "async/", "sync/", "tokens_per_s")
    return [{k: v for k, v in r.items() if not any(s in k for s in skip)} for r in read_jsonl(out / "metrics.jsonl")]


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_max_staleness_0_is_the_lockstep_run_bit_for_bit(tmp_path, algo):
    run(cfg_of(tmp_path / "lockstep", algo))
    metrics = run(cfg_of(tmp_path / "k0", algo, async_rollouts=True, max_staleness=0))
    want, got = figures(tmp_path / "lockstep"), figures(tmp_path / "k0")
    assert len(got) == len(want) > 4 and got == want
    assert read_json(tmp_path / "k0" / "eval.json")["reward_after"] == metrics["reward_after"] == \
        read_json(tmp_path / "lockstep" / "eval.json")["reward_after"]
    rows = [r for r in read_jsonl(tmp_path / "k0" / "metrics.jsonl") if "async/lag_max" in r]
    assert len(rows) == 4 and all(r["async/lag_max"] == 0 and r["sync/bytes"] > 0 for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("algo", sorted(ALGO_FLAGS))
def test_every_sampling_algorithm_trains_on_answers_at_most_K_updates_old(tmp_path, algo, K):
    out = tmp_path / "run"
    run(cfg_of(out, algo, async_rollouts=True, max_staleness=K, max_steps=K + 2))
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "async/lag_max" in r]
    assert len(rows) == K + 2
    assert all(r["async/lag_max"] <= K for r in rows)
    assert rows[-1]["async/lag_max"] == K  # the sampler ran ahead as far as allowed
    assert rows[-1]["async/wait_s"] >= 0 and rows[-1]["async/sampler_s"] > 0
    assert moved(out) > 0.5  # the actor trained
    if algo in POLICY_GRADIENT:  # the decoupled loss's weights against the trainer's pre-update policy
        late = rows[-1]
        assert 0 < late["async/is_weight_mean"] <= 2.0 and 0 <= late["async/is_truncated_frac"] <= 1
        assert late["async/kl_behaviour_prox"] >= 0


def test_a_damaged_weight_update_stops_the_run_in_one_line(tmp_path):
    from dschat.generation import weight_plane as W

    W.CORRUPT = lambda flat: flat[:1].add_(1)  # one byte of each bucket, after its checksum was taken
    try:
        with pytest.raises(UserError) as caught:
            run(cfg_of(tmp_path / "bad", async_rollouts=True, max_staleness=1))
    finally:
        W.CORRUPT = None
    message = str(caught.value)
    assert "\n" not in message and re.match(r"weight update 0: the sampler refused it: the bucket holding \S+ "
                                            r"arrived damaged", message), message


def _sampler_pid(log: Path, deadline: float) -> int:
    while time.time() < deadline:
        if found := re.search(r"started a sampler on \S+ \(pid (\d+)\)", log.read_text(errors="replace")):
            return int(found.group(1))
        time.sleep(0.1)
    raise AssertionError("no sampler started:\n" + log.read_text(errors="replace")[-2000:])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped by its dead parent) is gone too
        return f.read().split(")")[-1].split()[0] != "Z"


def cli_args(tmp_path: Path) -> list[str]:
    reward = tmp_path / "length_reward.py"
    reward.write_text(LENGTH)
    return ["train", "--step", "3", "--algo", "grpo", "--actor-model", "tiny", "--max-answer-seq-len", "10",
            "--per-device-generation-batch-size", "2", "--per-device-train-batch-size", "2", "--num-generations",
            "2", "--max-eval-rows", "2", "--per-device-eval-batch-size", "2", "--no-progress", "--async-rollouts",
            "--reward-funcs", f"{reward}:length"]


@pytest.mark.slow
def test_a_sampler_killed_mid_run_stops_the_trainer_with_its_state_saved_then_resume_goes_on(tmp_path):
    out, log, cli = tmp_path / "run", tmp_path / "trainer.log", cli_args(tmp_path)
    args = [*cli, "--max-steps", "400", "--sampler-timeout", "20", "--output-dir", str(out)]
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", "from dschat.cli.main import cli; cli()", *args], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        sampler = _sampler_pid(log, time.time() + 120)
        while not (out / "metrics.jsonl").exists() or len(read_jsonl(out / "metrics.jsonl")) < 4:
            assert proc.poll() is None, log.read_text()[-2000:]
            time.sleep(0.1)
        os.kill(sampler, signal.SIGKILL)
        t0 = time.monotonic()
        code = proc.wait(60)
        assert time.monotonic() - t0 < 20 + 10
    finally:
        if proc.poll() is None:
            proc.kill()
    last = log.read_text().strip().splitlines()[-1]
    assert code == 4, log.read_text()[-3000:]
    assert re.match(r"dschat: error: the sampler (died|is gone).*; the state of step (\d+) is \S+; continue with "
                    r"--resume once the sampler answers$", last), last
    step = int(re.search(r"the state of step (\d+)", last).group(1))
    assert step >= 2
    again = run_cli(*cli, "--max-steps", str(step + 2), "--output-dir", str(out), "--resume")
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resumed from {out / 'checkpoints'}" in again.stderr
    assert max(r["step"] for r in read_jsonl(out / "metrics.jsonl")) == step + 2


@pytest.mark.slow
def test_kill_9_then_resume_equals_the_uninterrupted_run_and_leaves_no_sampler(tmp_path):
    common = [*cli_args(tmp_path), "--max-staleness", "2", "--max-steps", "6", "--save-interval", "3"]
    ref = tmp_path / "ref"
    proc = run_cli(*common, "--output-dir", str(ref))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out, log = tmp_path / "killed", tmp_path / "killed.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", "from dschat.cli.main import cli; cli()", *common,
                                 "--output-dir", str(out)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        sampler = _sampler_pid(log, time.time() + 120)
        while not (out / "checkpoints" / "latest").exists():
            assert proc.poll() is None, log.read_text()[-2000:]
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.time() + 30
    while _alive(sampler) and time.time() < deadline:  # its trainer gone, the sampler exits by itself
        time.sleep(0.1)
    assert not _alive(sampler)
    resumed = run_cli(*common, "--output-dir", str(out), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stderr
    want = {r["step"]: r for r in figures(ref) if "train/actor_loss" in r}
    got = {r["step"]: r for r in figures(out) if "train/actor_loss" in r}
    assert sorted(got) == sorted(want) == list(range(1, 7))
    for step in range(4, 7):  # the steps the resumed run made, on answers the killed run had sampled ahead
        assert got[step] == want[step], step
    lags = {r["step"]: r["async/lag_max"] for r in read_jsonl(out / "metrics.jsonl") if "async/lag_max" in r}
    assert lags[6] == 2


@pytest.mark.slow
def test_a_trainer_on_two_loopback_nodes_samples_from_a_sampler_started_apart(tmp_path):
    from dschat.utils import free_port

    port = free_port()
    token = tmp_path / "sampler.token"  # the secret both sides prove: a file for the trainer, the variable here
    token.write_text("the run's shared secret, 2026\n")
    sampler = subprocess.Popen([sys.executable, "-m", "dschat.cli", "sampler", "--model", "tiny", "--listen",
                                f"127.0.0.1:{port}", "--device", "cpu", "--generation-backend", "dschat",
                                "--timeout", "120"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env={**os.environ, "DSCHAT_SAMPLER_TOKEN": "the run's shared secret, 2026"})
    out = tmp_path / "out"
    args = ["--algo", "grpo", "--actor-model", "tiny", "--data", str(demo_files()["prompts"]), "--max-steps", "3",
            "--max-answer-seq-len", "10", "--per-device-generation-batch-size", "2", "--num-generations", "2",
            "--per-device-train-batch-size", "2", "--max-eval-rows", "4", "--per-device-eval-batch-size", "2",
            "--no-progress", "--sampler", f"127.0.0.1:{port}", "--sampler-token-file", str(token),
            "--max-staleness", "1", "--output-dir", str(out)]
    try:
        codes, logs = run_two_nodes(tmp_path, lambda rank: args, extra_env={"STEP": "3", **cuda_only_world(tmp_path)})
        assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
        assert sampler.wait(60) == 0  # told to stop at the end
    finally:
        sampler.kill()
    assert_cuda_only_world(tmp_path)
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "async/lag_max" in r]
    assert len(rows) == 3 and rows[-1]["async/lag_max"] == 1 and all(r["async/lag_max"] <= 1 for r in rows)
    assert "world 2" in logs[0] and "sampling on a sampler process (at 127.0.0.1:" in logs[0]
    assert moved(out) > 0.5


def test_flags_of_asynchronous_rollouts_refused_where_they_do_nothing():
    from dschat.config import refuse_inert
    from dschat.rlhf.config import check_config

    def refused(given: dict, algo: str = "grpo") -> str:
        cfg = build_config(RLHFConfig, {"algo": algo, "actor_model": "tiny", **given})
        with pytest.raises(UserError) as e:
            refuse_inert(cfg, set(given))
            check_config(cfg)
        return str(e.value)

    assert "without --async-rollouts or --sampler" in refused({"max_staleness": 2})
    assert "with --sampler" in refused({"sampler": "127.0.0.1:5", "sampler_devices": "cpu:1"})
    assert "pick one" in refused({"sampler": "127.0.0.1:5", "async_rollouts": True})
    assert "not HOST:PORT" in refused({"sampler": "nowhere"})
    assert "expected cpu, cpu:CORES" in refused({"async_rollouts": True, "sampler_devices": "gpu0"})
    assert "with --algo dpo" in refused({"async_rollouts": True}, algo="dpo")
    assert "without --generation-backend vllm" in refused({"vllm_importance_sampling": "sequence"})
    cfg = build_config(RLHFConfig, {"algo": "grpo", "actor_model": "tiny", "async_rollouts": True,
                                    "vllm_importance_sampling": "sequence"})
    refuse_inert(cfg, {"async_rollouts", "vllm_importance_sampling"})  # the decoupled loss weighs by them


ENV = ("class Forever:\n    def reset(self, row):\n        return 'start'\n"
       "    def step(self, text):\n        return 'more', float(len(text) % 3), False\n")


@pytest.mark.slow
def test_episodes_run_in_the_sampler_with_tools_and_environments(tmp_path):
    # the calculator runs in the process that samples: K = 0 is still the lockstep run, episode counts and all
    tools = {"tools": ["calculator"], "max_turns": 2, "max_answer_seq_len": 24}
    run(cfg_of(tmp_path / "lockstep", max_steps=2, **tools))
    run(cfg_of(tmp_path / "k0", max_steps=2, async_rollouts=True, max_staleness=0, **tools))
    want, got = figures(tmp_path / "lockstep"), figures(tmp_path / "k0")
    assert got == want and any("episode/turns" in r for r in got)
    # an environment (in the sampler's worker processes) answers each turn; its reward comes back with the answers
    env = tmp_path / "forever_env.py"
    env.write_text(ENV)
    out = tmp_path / "env"
    run(cfg_of(out, max_steps=3, async_rollouts=True, max_staleness=1, env=[f"{env}:Forever"], max_turns=3,
               reward_funcs=["env"], max_answer_seq_len=48))
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "async/lag_max" in r]
    assert len(rows) == 3 and rows[-1]["async/lag_max"] == 1 and all(r["async/lag_max"] <= 1 for r in rows)
    assert all(r["episode/masked_token_frac"] > 0 for r in rows)  # the environment's 'start', fed as context
    assert "train/reward/env" in rows[0]
