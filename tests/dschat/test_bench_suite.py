"""benchmarks/bench_stages.py: the workload builder, the bare-loop ceilings' batches and steps (tiny sizes, one
step each), and the timed window read from step times."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_suite():
    spec = importlib.util.spec_from_file_location("bench_stages", ROOT / "benchmarks" / "bench_stages.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_window_and_metrics_times(tmp_path):
    b = load_suite()
    # ends of 4 steps, 2 of them warm-up: the window runs from the end of step 2 (t=2) to the end of step 4 (t=7)
    w = b.window([1.0, 2.0, 4.0, 7.0], steps=2)
    assert w["wall_s"] == 5.0 and w["step_s"] == [2.0, 3.0]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(r) for r in (
        {"step": 0, "time": 0.5, "eval/loss": 1.0},  # evaluation rows are not steps
        {"step": 1, "time": 1.0, "train/loss": 3.0}, {"step": 2, "time": 2.5, "train/actor_loss": 2.0})) + "\n")
    assert b.step_times(metrics) == ({1: 1.0, 2: 2.5}, {1: 3.0, 2: 2.0})
    # the rule reward: two keywords, 40 characters -> 2; no keyword, 60 characters -> -0.5
    assert b.bench_reward([], ["<answer>" + "x" * 23 + "refund" + "y" * 3, "z" * 60]) == [2.0, -0.5]


def test_workload_and_every_ceiling_step(tmp_path):
    b = load_suite()
    sizes = dict(hidden=32, intermediate=64, layers=1, heads=2, pairs=24, prompts=8)
    wl = b.build_workload(tmp_path, **sizes)
    assert b.build_workload(tmp_path, **sizes) == wl  # built once, then read from its manifest
    assert Path(wl["policy"], "model.safetensors").exists() and Path(wl["reward"], "tokenizer.json").exists()
    assert len(Path(wl["pairwise"]).read_text().splitlines()) == 24
    shape = b.Shape(batch=2, grpo_prompts=1, generations=2, new_tokens=4, ppo_epochs=2, max_seq_len=160,
                    max_prompt_len=96)
    for row in b.ROWS:
        batches, step = b.ceiling(row, wl, shape, 1)
        assert len(batches) == 1, row
        batch, units = batches[0]
        if row == "sft":
            assert units == 2 and batch["input_ids"].shape[0] == 2
        elif row == "sft-packed":  # 2 packed sequences holding more than 2 rows
            assert units > 2 and batch["input_ids"].shape[0] == 2 and "segment_ids" in batch
        elif row in ("rm", "dpo"):  # 2 pairs: chosen rows, then rejected rows
            assert units == 2 and batch["input_ids"].shape[0] == 4
        else:  # grpo: 1 prompt x 2 completions; ppo: 2 prompts, one episode each
            assert units == 2 and batch["prompt"].shape[0] == (1 if row == "grpo" else 2)
        assert math.isfinite(step(batch)), row
