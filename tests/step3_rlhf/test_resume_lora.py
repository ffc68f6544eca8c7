"""Stage 3 operations: kill -9 / Ctrl-C and --resume reproduce the uninterrupted run; per-model LoRA."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from dschat.config import build_config
from dschat.errors import UserError
from dschat.models.loading import resolve_model
from dschat.rlhf.config import RLHFConfig
from dschat.rlhf.grpo import GRPO
from dschat.training.stage import Interrupted
from tests.helpers import kill_when_state_saved, losses, read_json, read_jsonl, run_cli
from tests.helpers import run_stage as run


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / "model.safetensors"))


def _same_weights(a, b):
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.allclose(wa[k], wb[k], rtol=1e-5, atol=1e-6), k


@pytest.mark.slow
def test_ppo_kill_9_then_resume_matches_uninterrupted_run(tmp_path):
    # Every piece of PPO state that crosses steps: actor and critic engines, EMA, the adaptive KL coefficient,
    # the prompt position (two generation batches per update), the minibatch shuffle and the sampling RNG.
    common = ["train", "--step", "3", "--actor-model", "tiny", "--reward-model", "tiny", "--max-steps", "6",
              "--save-interval", "2", "--max-answer-seq-len", "12", "--per-device-generation-batch-size", "4",
              "--per-device-training-batch-size", "2", "--generation-batches", "2", "--max-eval-rows", "8",
              "--enable-ema", "--ema-decay", "0.5", "--kl-target", "0.01", "--kl-horizon", "50", "--no-progress"]
    ref = tmp_path / "ref"
    proc = run_cli(*common, "--output-dir", str(ref))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = tmp_path / "killed"
    kill_when_state_saved([*common, "--output-dir", str(out)], out)
    assert not (out / "eval.json").exists()
    saved = (out / "checkpoints" / "latest").read_text().strip()
    assert {p.name for p in (out / "checkpoints" / saved).iterdir()} >= {"actor", "critic", "trainer.json",
                                                                          "tensors.pt"}
    proc = run_cli(*common, "--output-dir", str(out), "--resume")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"resumed from {out / 'checkpoints' / saved}" in proc.stderr
    for key in ("train/actor_loss", "train/critic_loss", "train/reward", "train/kl_ctl"):
        want, got = losses(ref, key), losses(out, key)
        assert sorted(got) == list(range(1, 7)), key
        for step in want:
            assert got[step] == pytest.approx(want[step], rel=1e-4, abs=1e-6), (key, step)
    assert losses(out, "train/kl_ctl")[6] != pytest.approx(0.1)  # the adaptive coefficient moved and was restored
    assert read_json(out / "eval.json")["reward_after"] == pytest.approx(read_json(ref / "eval.json")["reward_after"],
                                                                         rel=1e-4, abs=1e-6)
    for folder in ("actor", "critic", "actor_ema"):
        _same_weights(ref / folder, out / folder)


def grpo_cfg(out, reward, **kw):
    base = {"algo": "grpo", "actor_model": "tiny", "output_dir": str(out), "max_steps": 5, "save_interval": 0,
            "max_answer_seq_len": 10, "per_device_generation_batch_size": 2, "per_device_training_batch_size": 4,
            "num_generations": 4, "loss_type": "dapo", "reward_funcs": [reward],
            "max_eval_rows": 4, "progress": False, "force": True, "beta": 0.04}
    base.update(kw)
    return build_config(RLHFConfig, base)


@pytest.mark.parametrize("zero", [0, pytest.param(3, marks=pytest.mark.slow)])
def test_grpo_ctrl_c_saves_after_the_step_and_resume_matches(tmp_path, monkeypatch, zero, ctrl_c):
    # Dynamic sampling (dapo) draws a varying number of prompt batches per step: the stream position must be
    # the batch count, not the step. Ctrl-C lands mid-step; the state is saved once the step has finished.
    (tmp_path / "length.py").write_text("def reward(prompts, completions, **fields):\n"
                                        "    return [float(len(set(c)) % 2) for c in completions]\n")
    reward = f"{tmp_path / 'length.py'}:reward"  # coarse, so some groups tie and dynamic sampling refills
    ref = tmp_path / "ref"
    run(grpo_cfg(ref, reward, actor_zero_stage=zero))
    real_step = GRPO.step
    calls = {"n": 0}

    def interrupted_step(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGINT)  # arrives during step 3, which still runs to its end
        return real_step(*args, **kwargs)

    out = tmp_path / "int"
    monkeypatch.setattr(GRPO, "step", interrupted_step)
    with pytest.raises(Interrupted, match="interrupted: saved .*step-00000003"):
        run(grpo_cfg(out, reward, force=False, actor_zero_stage=zero))
    assert calls["n"] == 3 and not (out / "eval.json").exists()
    proc = run_cli("export", "--checkpoint", str(out), "--output", str(tmp_path / "exported"), "--engine", "actor")
    assert proc.returncode == 0, proc.stderr[-2000:]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(tmp_path / "exported").config.vocab_size > 0
    monkeypatch.setattr(GRPO, "step", real_step)
    # the kept before-training evaluation sampled one answer per prompt: the after one must too
    with pytest.raises(UserError, match="sampled 1 answer.* resume with --eval-samples 1"):
        run(grpo_cfg(out, reward, force=False, resume=True, actor_zero_stage=zero, eval_samples=2))
    run(grpo_cfg(out, reward, force=False, resume=True, actor_zero_stage=zero))
    assert max(losses(ref, "train/resample_rounds").values()) > 0  # the stream ran ahead of the step count
    for key in ("train/actor_loss", "train/reward", "train/kl", "train/resample_rounds"):
        want, got = losses(ref, key), losses(out, key)
        assert sorted(got) == sorted(want) and len(want) >= 4, key
        for step in want:
            assert got[step] == pytest.approx(want[step], rel=1e-4, abs=1e-6), (key, step)
    _same_weights(ref / "actor", out / "actor")


def test_ppo_with_actor_and_critic_lora_saves_plain_folders(tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    out = tmp_path / "lora"
    cfg = build_config(RLHFConfig, {"actor_model": "tiny", "reward_model": "tiny", "output_dir": str(out),
                                    "max_steps": 2, "max_answer_seq_len": 12, "per_device_generation_batch_size": 4,
                                    "per_device_training_batch_size": 4, "max_eval_rows": 4, "progress": False,
                                    "actor_lora_dim": 8, "critic_lora_dim": 4, "actor_lora_learning_rate": 1e-2,
                                    "critic_lora_module_name": "q_proj,v_proj", "save_adapter": True,
                                    "actor_zero_stage": 3, "actor_gradient_checkpointing": True})
    assert run(cfg)["steps"] == 2
    start = _weights(resolve_model("tiny"))
    actor = AutoModelForCausalLM.from_pretrained(out / "actor")  # merged: plain transformers, no peft
    merged = {k: v for k, v in actor.state_dict().items() if k in start}
    assert merged.keys() == start.keys()
    moved = [k for k in start if not torch.equal(start[k], merged[k])]
    # Only the adapted projections changed after merging: embeddings, norms and the LM head are frozen.
    assert moved and all(k.endswith("proj.weight") for k in moved)
    assert (out / "actor" / "adapter" / "adapter_config.json").exists()
    critic = AutoModelForSequenceClassification.from_pretrained(out / "critic")
    assert critic.config.num_labels == 1
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "train/actor_loss" in r]
    assert len(rows) == 2
    proc = run_cli("chat", "--model", str(out), "--prompt", "发票怎么开？", "--max-new-tokens", "8", "--greedy")
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr[-2000:]  # the stage folder means its actor/


def test_stage3_lora_flags_on_the_command_line(tmp_path):
    proc = run_cli("train", "--step", "3", "--help")
    assert proc.returncode == 0
    for flag in ("--actor-lora-dim", "--critic-lora-dim", "--actor-lora-module-name", "--critic-lora-learning-rate",
                 "--actor-only-optimize-lora", "--save-adapter"):
        assert flag in proc.stdout, flag
