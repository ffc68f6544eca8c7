"""Stage 3: rollout masking, the hybrid engine's generation, and short PPO runs on the tiny preset."""

import json

import pytest
import torch

from dschat import engine as E
from dschat.config import EngineArgs, OptimArgs, build_config
from dschat.generation.decode import GenerationConfig
from dschat.generation.hybrid_engine import HybridEngine
from dschat.models.loading import create_causal_lm, load_tokenizer, resolve_model
from dschat.rlhf.config import RLHFConfig
from dschat.rlhf.rollout import answer_logprobs, make_rollout, positions_from_mask
from tests.helpers import assert_cuda_only_world, cuda_only_world, read_json, read_jsonl, run_cli
from tests.helpers import run_stage as run

EOS, PAD = 2, 3


def test_rollout_masks_after_first_eos_and_drops_short_answers():
    prompt = torch.tensor([[PAD, 1, 10], [1, 11, 12], [PAD, 1, 13]])
    prompt_mask = (prompt != PAD).long()
    answers = torch.tensor([[20, 21, EOS, 22, 23],  # stops early: 3 real tokens (EOS included)
                            [24, 25, 26, 27, 28],  # never reaches EOS: all 5 count
                            [EOS, PAD, PAD, PAD, PAD]])  # length 1 < 2: dropped
    rollout, dropped = make_rollout(prompt, prompt_mask, torch.cat([prompt, answers], 1), EOS, PAD)
    assert dropped == 1
    assert rollout.action_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]]
    assert rollout.sequences[0, 3:].tolist() == [20, 21, EOS, PAD, PAD]  # tokens after EOS become padding
    assert rollout.reached_eos.tolist() == [True, False, True]
    assert rollout.attention_mask[0].tolist() == [0, 1, 1, 1, 1, 1, 0, 0]
    assert rollout.prompt_len == 3


def test_retokenized_answers_get_eos_only_when_they_ended(tiny):
    from dschat.rlhf.scoring import Retokenizer

    _, tok = tiny
    prompt = torch.tensor([[1, 100, 101], [1, 102, 103]])
    answers = torch.tensor([[200, 201, tok.eos_token_id, PAD], [202, 203, 204, 205]])  # ended / cut off
    rollout, _ = make_rollout(prompt, torch.ones_like(prompt), torch.cat([prompt, answers], 1), tok.eos_token_id,
                              tok.pad_token_id)
    ids, mask = Retokenizer(tok, tok, 64)(rollout)
    last = [row[m.bool()][-1].item() for row, m in zip(ids, mask, strict=True)]
    assert last[0] == tok.eos_token_id and last[1] != tok.eos_token_id


def test_positions_ignore_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert positions_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]


@pytest.fixture(scope="module")
def tiny():
    E.setup_distributed()
    path = resolve_model("tiny")
    return path, load_tokenizer(path)


@pytest.mark.parametrize("stage", [0, 3])
def test_hybrid_engine_greedy_equals_plain_generate(tiny, stage):
    path, tok = tiny
    plain = create_causal_lm(path).eval()
    actor = create_causal_lm(path)
    engine = E.build_train_engine(actor, engine=EngineArgs(zero_stage=stage), optim=OptimArgs(
        learning_rate=1e-3, per_device_train_batch_size=2), dtype=torch.float32, total_steps=1)
    hybrid = HybridEngine(engine, tok.pad_token_id, tok.eos_token_id)
    texts = ["\n\nHuman: 我的快递到哪了？\n\nAssistant:", "\n\nHuman: Where is my refund?\n\nAssistant:"]
    enc = [tok(t)["input_ids"] for t in texts]
    width = max(map(len, enc))
    prompt = torch.tensor([[tok.pad_token_id] * (width - len(e)) + e for e in enc])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(e) for e in enc])[:, None]).long()
    cfg = GenerationConfig(max_new_tokens=12, do_sample=False)
    engine.train()
    out = hybrid.generate(prompt, mask, cfg)
    assert engine.module.training  # flipped back to training after generating
    expected = plain.generate(prompt, attention_mask=mask, max_new_tokens=12, do_sample=False,
                              pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    assert torch.equal(out, expected)
    # log-probs of the same rollout agree between the engine (ZeRO-3 partitioned or not) and the plain model
    rollout, _ = make_rollout(prompt, mask, out, tok.eos_token_id, tok.pad_token_id)
    engine.eval()
    with torch.no_grad():
        a = answer_logprobs(engine, rollout)
        b = answer_logprobs(plain, rollout)
    m = rollout.action_mask.bool()
    assert torch.allclose(a[m], b[m], atol=1e-5)
    # the sampling pass's own log-probs (PPO's old log-probs) equal the engine's forward, ZeRO-3 included
    torch.manual_seed(0)
    sampled = hybrid.sample(prompt, mask, GenerationConfig(max_new_tokens=12, temperature=0.8, logprobs=True))
    rollout, _ = make_rollout(prompt, mask, sampled.sequences, tok.eos_token_id, tok.pad_token_id,
                              logprobs=sampled.logprobs)
    with torch.no_grad():
        forward = answer_logprobs(engine, rollout, temperature=0.8)
    m = rollout.action_mask.bool()
    assert m.any() and torch.allclose(rollout.logprobs[m], forward[m], atol=1e-5)


def ppo_cfg(out, **kw):
    base = {"actor_model": "tiny", "reward_model": "tiny", "output_dir": str(out), "max_steps": 3,
            "max_answer_seq_len": 16, "per_device_generation_batch_size": 4, "per_device_training_batch_size": 2,
            "max_eval_rows": 8, "progress": False, "force": True}
    base.update(kw)
    return build_config(RLHFConfig, base)


def test_ppo_short_run_updates_actor_and_critic_and_logs(tmp_path):
    out = tmp_path / "ppo"
    metrics = run(ppo_cfg(out, enable_ema=True, ema_decay=0.5, ppo_epochs=2))
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "train/actor_loss" in r]
    assert len(rows) == 3
    for key in ("train/reward", "train/kl", "train/return", "train/actor_loss", "train/critic_loss",
                "train/actor_clip_frac", "train/critic_clip_frac", "train/answer_length", "time/generation_s",
                "time/training_s", "time/tokens_per_s"):
        assert key in rows[0], key
    assert all(abs(r["train/critic_loss"]) < 1e6 for r in rows)
    ev = read_json(out / "eval.json")
    for key in ("reward_before", "reward_after", "kl_after", "answer_length_before", "answer_length_after"):
        assert ev[key] is not None, key
    assert ev["kl_before"] == pytest.approx(0.0, abs=1e-5)  # actor == reference before training

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    start = load_file(str(resolve_model("tiny")) + "/model.safetensors")
    actor = load_file(str(out / "actor" / "model.safetensors"))
    ema = load_file(str(out / "actor_ema" / "model.safetensors"))
    moved = [k for k in start if not torch.equal(start[k], actor[k])]
    assert len(moved) >= len(start) - 1  # the actor trained
    k = moved[0]
    # EMA lies between the start and the final weights: decay 0.5 over 6 steps is not the final copy
    assert not torch.equal(ema[k], actor[k]) and not torch.equal(ema[k], start[k])
    model = AutoModelForCausalLM.from_pretrained(out / "actor")
    tok = load_tokenizer(str(out / "actor"))
    ids = tok("\n\nHuman: 发票怎么开？\n\nAssistant:", return_tensors="pt")
    assert model.generate(**ids, max_new_tokens=8, do_sample=False).shape[1] > ids["input_ids"].shape[1]
    critic = AutoModelForSequenceClassification.from_pretrained(out / "critic")
    assert critic.config.num_labels == 1
    assert metrics["steps"] == 3


def test_ppo_actor_zero3_with_mixed_pretraining_loss(tmp_path):
    unsup = tmp_path / "unsup.jsonl"
    unsup.write_text("".join(json.dumps({"prompt": "订单", "response": f"已经发货，单号{i}。"}, ensure_ascii=False)
                             + "\n" for i in range(40)), encoding="utf-8")
    metrics = run(ppo_cfg(tmp_path / "z3", actor_zero_stage=3, critic_zero_stage=3, max_steps=2,
                          unsup_data=[str(unsup)], unsup_coef=1.0))
    assert metrics["steps"] == 2
    rows = [r for r in read_jsonl(tmp_path / "z3" / "metrics.jsonl") if "train/unsup_loss" in r]
    assert len(rows) == 2 and all(r["train/unsup_loss"] > 0 for r in rows)


def test_stage3_requires_models(tmp_path):
    proc = run_cli("train", "--step", "3", "--output-dir", str(tmp_path / "x"))
    assert proc.returncode == 2 and "--actor-model" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_ppo_two_ranks_actor_zero3_under_launcher(tmp_path):
    out = tmp_path / "dist"
    proc = run_cli("train", "--step", "3", "--num-gpus", "2", "--actor-model", "tiny", "--reward-model", "tiny",
                   "--actor-zero-stage", "3", "--output-dir", str(out), "--max-steps", "2", "--max-answer-seq-len",
                   "12", "--per-device-generation-batch-size", "2", "--per-device-training-batch-size", "2",
                   "--max-eval-rows", "4", "--no-progress", timeout=900, env=cuda_only_world(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_cuda_only_world(tmp_path)  # dschat's collectives ran on a world group with no CPU backend, as NCCL
    assert read_json(out / "args.json")["world_size"] == 2
    ev = read_json(out / "eval.json")
    assert ev["steps"] == 2 and ev["reward_after"] is not None
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "actor")
    assert sum(p.numel() for p in model.parameters()) > 1_000_000


def test_stage3_takes_model_for_the_actor_as_every_stage_does(tmp_path):
    proc = run_cli("train", "--step", "3", "--model", "tiny", "--output-dir", str(tmp_path / "x"))
    assert proc.returncode == 2 and "--reward-model" in proc.stderr and "No such option" not in proc.stderr


@pytest.mark.parametrize("stage", [0, 3])
def test_ema_on_own_shards_equals_the_gathered_average(stage):
    """Each rank averages its share in place; gathered at the end it is the former every-step-gathered average,
    bit for bit, and a restored EMA (as --resume loads it) gives it back."""
    from tests.step3_rlhf.ema_check import compare

    r = compare(stage)
    assert r["keys_equal"] and r["all_equal"] and r["restored_equal"], r
    assert r["between"] >= r["tensors"] - 2, r  # every weight's average lies strictly between start and end


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 3])
def test_ema_on_two_ranks_equals_the_gathered_average(tmp_path, stage):
    import os
    import subprocess
    import sys

    from dschat.cli.train import launcher_argv
    from tests.helpers import ROOT

    out = tmp_path / "ema.json"
    cmd = launcher_argv(str(ROOT / "tests" / "step3_rlhf" / "ema_check.py"), [str(stage), str(out)], 2, None, None)
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHON": sys.executable, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = read_json(out)
    assert r["world"] == 2 and r["keys_equal"] and r["restored_equal"], r
    assert r["all_equal"], r
    assert r["between"] >= r["tensors"] - 2, r
