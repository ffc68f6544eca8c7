"""Stage 1 end to end on the tiny preset: the loss falls and the saved model loads and generates."""

import json

import pytest
import torch

from dschat.config import SFTConfig, build_config
from tests.helpers import (
    assert_cuda_only_world,
    cuda_only_world,
    kill_when_state_saved,
    losses,
    read_json,
    read_jsonl,
    run_cli,
)
from tests.helpers import run_stage as run


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
    ext = tmp_path / "torch_extensions"  # gloo ranks need no JIT-built DeepSpeed op either
    proc = run_cli("train", "--step", "1", "--num-gpus", "2", "--model", "tiny", "--zero-stage", "3",
                   "--output-dir", str(out), "--max-steps", "6", "--no-progress", timeout=900,
                   env={"TORCH_EXTENSIONS_DIR": str(ext), **cuda_only_world(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_cuda_only_world(tmp_path)  # dschat's collectives ran on a world group with no CPU backend, as NCCL
    assert not ext.exists() or not any(ext.iterdir())
    args = read_json(out / "args.json")
    assert args["world_size"] == 2 and args["zero_stage"] == 3
    ev = read_json(out / "eval.json")
    assert ev["perplexity"] < ev["perplexity_before"]

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "model")
    assert sum(p.numel() for p in model.parameters()) > 1_000_000  # full weights, not ZeRO-3 shards


@pytest.mark.slow
def test_kill_9_then_resume_matches_uninterrupted_run(tmp_path):
    common = ["train", "--step", "1", "--max-steps", "12", "--save-interval", "3", "--no-progress",
              "--per-device-train-batch-size", "4"]
    ref = tmp_path / "ref"
    assert run_cli(*common, "--output-dir", str(ref)).returncode == 0
    out = tmp_path / "killed"
    kill_when_state_saved([*common, "--output-dir", str(out)], out)
    assert not (out / "eval.json").exists()
    saved = (out / "checkpoints" / "latest").read_text().strip()
    proc = run_cli(*common, "--output-dir", str(out))  # without --resume: refuses to clobber the state
    assert proc.returncode == 2 and "--resume" in proc.stderr
    proc = run_cli(*common, "--output-dir", str(out), "--resume")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"resumed from {out / 'checkpoints' / saved}" in proc.stderr
    want, got = losses(ref, "train/loss"), losses(out, "train/loss")
    assert sorted(got) == list(range(1, 13))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-6), step
    assert read_json(out / "eval.json")["perplexity"] == pytest.approx(read_json(ref / "eval.json")["perplexity"],
                                                                       rel=1e-5)


@pytest.mark.slow
def test_ctrl_c_saves_a_state_and_exits_cleanly(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "int"
    # The child gets Ctrl-C's default disposition whatever this process has: a suite started in the background
    # (`cmd &`, nohup) runs with SIGINT ignored, which a child inherits and dschat rightly respects.
    proc = subprocess.Popen([sys.executable, "-c", "from dschat.cli.main import cli; cli()", "train", "--step", "1",
                             "--max-steps", "400", "--no-progress", "--output-dir", str(out)],
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 300
    while not (out / "metrics.jsonl").exists() or len(losses(out, "train/loss")) < 2:
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted: saved" in err and "Traceback" not in err
    assert (out / "checkpoints" / "latest").exists()


def test_sft_with_lora_saves_a_plain_merged_folder(tmp_path):
    out = tmp_path / "lora"
    run(build_config(SFTConfig, {"output_dir": str(out), "max_steps": 3, "lora_dim": 8, "progress": False,
                                 "save_adapter": True}))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "model")  # no peft needed
    assert not any("lora" in n for n, _ in model.named_parameters())
    assert (out / "model" / "adapter" / "adapter_config.json").exists()


def test_a_finished_run_trains_on_from_its_final_state(tmp_path):
    out = tmp_path / "run"
    common = ["train", "--step", "1", "--no-progress", "--per-device-train-batch-size", "4", "--output-dir", str(out)]
    assert run_cli(*common, "--max-steps", "4").returncode == 0
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000004"  # the final state
    proc = run_cli(*common, "--max-steps", "4")
    assert proc.returncode == 2 and "--resume" in proc.stderr  # finished: not overwritten silently
    proc = run_cli(*common, "--max-steps", "6", "--resume")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(losses(out, "train/loss")) == list(range(1, 7))
    assert read_json(out / "eval.json")["steps"] == 6
