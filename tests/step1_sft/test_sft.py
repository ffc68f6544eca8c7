"""Stage 1 end to end on the tiny preset: the loss falls and the saved model loads and generates."""

import json

import pytest
import torch

from dschat.config import build_config
from step1_sft.main import SFTConfig, run
from tests.helpers import read_json, read_jsonl, run_cli


def test_sft_loss_falls_and_model_loads(tmp_path):
    out = tmp_path / "sft"
    cfg = build_config(SFTConfig, {"model": "tiny", "output_dir": str(out), "max_steps": 25,
                                   "per_device_train_batch_size": 8, "progress": False, "eval_interval": 10})
    metrics = run(cfg)
    assert metrics["perplexity"] < 0.5 * metrics["perplexity_before"]
    assert metrics["train_loss_last"] < metrics["train_loss_first"] - 1.0
    ev = read_json(out / "eval.json")
    for key in ("perplexity", "perplexity_before", "train_rows", "eval_rows"):
        assert key in ev
    steps = read_jsonl(out / "metrics.jsonl")
    assert any("eval/perplexity" in r and r["step"] == 10 for r in steps)  # --eval-interval
    assert sum(1 for r in steps if "train/loss" in r) == 25
    assert json.loads((out / "args.json").read_text())["max_steps"] == 25
    assert any((out / "tensorboard").iterdir())

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out / "model")
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    ids = tok("\n\nHuman: 我的快递到哪了？\n\nAssistant:", return_tensors="pt")
    gen = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert gen.shape[1] > ids["input_ids"].shape[1]
    assert torch.isfinite(model(**ids).logits).all()


def test_finished_run_is_not_overwritten_without_force(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "eval.json").write_text("{}")
    proc = run_cli("train", "--step", "1", "--output-dir", str(out), "--max-steps", "1")
    assert proc.returncode == 2 and "already holds a finished run" in proc.stderr


@pytest.mark.slow
def test_sft_two_ranks_zero3_under_deepspeed_launcher(tmp_path):
    out = tmp_path / "z3"
    proc = run_cli("train", "--step", "1", "--num-gpus", "2", "--model", "tiny", "--zero-stage", "3",
                   "--output-dir", str(out), "--max-steps", "6", "--no-progress", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    args = read_json(out / "args.json")
    assert args["world_size"] == 2 and args["zero_stage"] == 3
    ev = read_json(out / "eval.json")
    assert ev["perplexity"] < ev["perplexity_before"]

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "model")
    assert sum(p.numel() for p in model.parameters()) > 1_000_000  # full weights, not ZeRO-3 shards
