"""``dschat generate`` (docs/cli.md, Commands): best/pairs selection by hand (ties), the flags it refuses, resume
after an interruption (the same bytes as an uninterrupted run), and end to end: its ``--keep best`` output trains
stage 1 and its ``--keep pairs`` output trains DPO, unchanged."""

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

import dschat.rlhf.rollout as R
from dschat.apps.best_of_n import (
    GenerateConfig,
    Sample,
    best_and_worst,
    check_generate_config,
    generate,
    prompt_rows,
)
from dschat.config import SFTConfig, build_config, refuse_inert
from dschat.demo import demo_files
from dschat.errors import UserError
from dschat.rlhf.config import RLHFConfig
from tests.helpers import ROOT, read_json, read_jsonl, run_cli
from tests.helpers import run_stage as run

LENGTH_FN = "def length(prompts, completions, **kw):\n    return [float(len(c.split())) for c in completions]\n"


def s(text, score, truncated=False):
    return Sample(text, score, {}, truncated)


# ------------------------------------------------------------------------------------------- selection
def test_best_and_worst_take_the_first_of_equal_scores_and_skip_empty_text():
    assert best_and_worst([s("a", 1.0), s("b", 3.0), s("c", 3.0), s("d", -2.0), s("e", -2.0)]) == (1, 3)
    assert best_and_worst([s("  ", 9.0), s("b", 1.0), s("", -9.0)]) == (1, 1)  # blank texts are never picked
    assert best_and_worst([s("", 1.0), s(" ", 2.0)]) is None


def test_prompt_rows_best_pairs_and_all_by_hand():
    counts: Counter = Counter()
    samples = [s("ok", 0.5), s("great", 2.0), s("bad", -1.0), s("also great", 2.0)]
    assert prompt_rows("Q?", "42", samples, "best", counts, 7) == [
        {"prompt": "Q?", "response": "great", "score": 2.0, "answer": "42"}]  # the first of the two 2.0s
    assert prompt_rows("Q?", None, samples, "pairs", counts, 7) == [
        {"prompt": "Q?", "chosen": "great", "rejected": "bad", "score_chosen": 2.0, "score_rejected": -1.0}]
    messages = [{"role": "user", "content": "hi"}]
    rows = prompt_rows(messages, None, [s("x", 1.0, True), s("y", 0.0)], "all", counts, 3)
    assert rows == [{"prompt": messages, "response": "x", "score": 1.0, "prompt_index": 3, "sample": 0,
                     "truncated": True},
                    {"prompt": messages, "response": "y", "score": 0.0, "prompt_index": 3, "sample": 1,
                     "truncated": False}]
    assert not counts
    # ties: every sample scores the same -> no pair, counted; best still writes the first
    tied = [s("a", 1.0), s("b", 1.0), s("c", 1.0)]
    assert prompt_rows("Q", None, tied, "pairs", counts, 0) == [] and counts["ties"] == 1
    assert prompt_rows("Q", None, tied, "best", counts, 0)[0]["response"] == "a"
    # best and worst differ in score but not in text: no pair either
    assert prompt_rows("Q", None, [s("same", 1.0), s("same", 0.0)], "pairs", counts, 0) == []
    assert counts["identical"] == 1
    # fewer than two samples with text: no pair; none with text: no best
    assert prompt_rows("Q", None, [s("a", 1.0), s(" ", 0.0)], "pairs", counts, 0) == []
    assert prompt_rows("Q", None, [s("", 1.0)], "best", counts, 0) == []
    assert counts["skipped_empty"] == 2
    # --min-score: a best below the threshold is skipped and counted
    assert prompt_rows("Q", None, samples, "best", counts, 0, min_score=2.5) == []
    assert prompt_rows("Q", None, samples, "best", counts, 0, min_score=2.0)[0]["response"] == "great"
    assert counts["below_min_score"] == 1
    # unscored (--keep all without a reward source): no score field
    assert "score" not in prompt_rows("Q", None, [Sample("a", None, {}, False)], "all", counts, 0)[0]


def test_flags_refused_or_checked_before_anything_loads():
    def cfg(**kw):
        return build_config(GenerateConfig, {"model": "tiny", "data": ["p.jsonl"], "output": "o.jsonl", **kw})

    for values, pattern in (({"keep": "best"}, "ranks the samples by score"),
                            ({"keep": "pairs", "num_samples": 1, "reward_funcs": ["format"]}, "num-samples >= 2"),
                            ({"output": ""}, "needs --output"), ({"model": ""}, "needs --model"),
                            ({"reward_funcs": ["judge"]}, "needs --judge-model")):
        with pytest.raises(UserError, match=pattern):
            check_generate_config(cfg(**values))
    for flag, value, extra in (("judge_max_new_tokens", 64, {}), ("overlong_factor", 2.0, {}),
                               ("reward_weights", ["2"], {}),
                               ("reward_model", "rm", {"reward_funcs": ["format"]}),
                               ("min_score", 0.5, {"keep": "pairs", "reward_funcs": ["format"]})):
        with pytest.raises(UserError, match="has no effect"):
            refuse_inert(cfg(**{flag: value}, **extra), {flag, *extra})
    c = cfg(reward_model="rm", judge_model="j")
    assert c.reward_func_names() == ["rm", "judge"]
    refuse_inert(c, {"reward_model", "judge_model", "reward_weights"})
    with pytest.raises(UserError, match="must be one of"):
        cfg(keep="worst")


# ---------------------------------------------------------------------------------------------- running
def gen_cfg(tmp_path, output, **kw):
    fn = tmp_path / "length.py"
    fn.write_text(LENGTH_FN)
    values = {"model": "tiny", "data": [str(demo_files()["prompts"])], "output": str(output), "max_prompts": 7,
              "num_samples": 3, "per_device_generation_batch_size": 3, "max_answer_seq_len": 8,
              "reward_funcs": [f"{fn}:length"], "keep": "all", "progress": False}
    values.update(kw)
    return build_config(GenerateConfig, values)


def test_resume_after_an_interruption_writes_the_uninterrupted_file(tmp_path, monkeypatch):
    whole = tmp_path / "whole.jsonl"
    summary = generate(gen_cfg(tmp_path, whole))
    rows = read_jsonl(whole)
    assert len(rows) == 21 and summary["rows"] == 21 and summary["samples"] == 21
    assert [r["prompt_index"] for r in rows] == [i for i in range(7) for _ in range(3)]
    assert all(r["score"] == float(len(r["response"].split())) for r in rows)
    assert summary["mean_best_score"] >= summary["mean_score"] >= summary["mean_worst_score"]

    out = tmp_path / "cut.jsonl"
    real, calls = R.generate_rollout, []  # best_of_n imports it from here when it runs

    def interrupted_at_second_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(R, "generate_rollout", interrupted_at_second_batch)
    with pytest.raises(KeyboardInterrupt):
        generate(gen_cfg(tmp_path, out))
    partial = tmp_path / "cut.jsonl.partial"
    progress = read_json(tmp_path / "cut.jsonl.progress.json")
    assert not out.exists() and progress["prompts_done"] == 3 and not progress["finished"]
    assert partial.read_bytes() == whole.read_bytes()[: progress["bytes"]]
    with partial.open("ab") as f:  # what a kill in the middle of the next write could leave
        f.write(b'{"prompt": "half a li')

    with pytest.raises(UserError, match="--temperature changed"):
        generate(gen_cfg(tmp_path, out, temperature=0.5))
    calls.clear()
    monkeypatch.setattr(R, "generate_rollout", lambda *a, **k: calls.append(1) or real(*a, **k))
    generate(gen_cfg(tmp_path, out))
    assert len(calls) == 2  # only the batches not yet written (prompts 3-5 and 6)
    assert out.read_bytes() == whole.read_bytes() and not partial.exists()
    calls.clear()
    assert generate(gen_cfg(tmp_path, out))["rows"] == 21 and not calls  # complete: nothing to do
    out.rename(partial)  # as if killed after recording the end, before the rename
    assert generate(gen_cfg(tmp_path, out))["rows"] == 21 and not calls
    assert out.read_bytes() == whole.read_bytes() and not partial.exists()
    with pytest.raises(UserError, match="not the finished output"):
        generate(gen_cfg(tmp_path, tmp_path / "length.py"))  # a file this command did not write
    generate(gen_cfg(tmp_path, out, force=True, max_prompts=2))
    assert len(read_jsonl(out)) == 6


@pytest.mark.slow
def test_keep_best_trains_step1_unchanged(tmp_path):
    """Best-of-4 by a reward model's score (an untrained v_head on the tiny preset: scores that differ), written
    by the CLI, then stage 1 on that file as it is."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from dschat.models.loading import resolve_model

    rm = tmp_path / "rm"
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(resolve_model("tiny"), num_labels=1).save_pretrained(rm)
    AutoTokenizer.from_pretrained(resolve_model("tiny")).save_pretrained(rm)
    best = tmp_path / "best.jsonl"
    proc = run_cli("generate", "--model", "tiny", "--data", str(demo_files()["pairwise"]), "--max-prompts", "24",
                   "--num-samples", "4", "--per-device-generation-batch-size", "8", "--max-answer-seq-len", "12",
                   "--reward-model", str(rm), "--keep", "best", "--output", str(best), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl(best)
    assert len(rows) == 24 and set(rows[0]) == {"prompt", "response", "score"}
    assert "wrote 24 rows (best)" in proc.stderr
    summary = read_json(tmp_path / "best.jsonl.progress.json")["summary"]
    assert summary["mean_best_score"] > summary["mean_score"]  # best-of-4 beats the average sample
    metrics = run(build_config(SFTConfig, {"model": "tiny", "data": [str(best)], "data_split": "10,0,0",
                                           "output_dir": str(tmp_path / "sft"), "max_steps": 3,
                                           "per_device_train_batch_size": 4, "progress": False}))
    assert metrics["train_rows"] + metrics["eval_rows"] == 24 and metrics["steps"] == 3
    assert metrics["sources"][0]["format"] == "sft"


@pytest.mark.slow
def test_keep_pairs_trains_dpo_unchanged(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    summary = generate(gen_cfg(tmp_path, pairs, keep="pairs", max_prompts=24, num_samples=4,
                               per_device_generation_batch_size=8, max_answer_seq_len=12))
    rows = read_jsonl(pairs)
    assert len(rows) == summary["rows"] == 24 - summary.get("ties", 0) - summary.get("identical", 0) > 12
    assert all(r["score_chosen"] > r["score_rejected"] for r in rows)
    metrics = run(build_config(RLHFConfig, {"algo": "dpo", "actor_model": "tiny", "data": [str(pairs)],
                                            "data_split": "0,0,10", "output_dir": str(tmp_path / "dpo"),
                                            "max_steps": 2, "per_device_generation_batch_size": 4,
                                            "per_device_train_batch_size": 4, "progress": False}))
    assert metrics["steps"] == 2 and metrics["sources"][0]["format"] == "pairwise"


@pytest.mark.slow
def test_kill_9_then_run_again_gives_the_uninterrupted_file(tmp_path):
    common = dict(max_prompts=24, num_samples=2, per_device_generation_batch_size=2, max_answer_seq_len=8)
    whole = tmp_path / "whole.jsonl"
    generate(gen_cfg(tmp_path, whole, **common))
    out = tmp_path / "killed.jsonl"
    cfg = gen_cfg(tmp_path, out, **common)
    argv = ["generate", "--model", "tiny", "--data", cfg.data.data[0], "--output", str(out), "--max-prompts", "24",
            "--num-samples", "2", "--per-device-generation-batch-size", "2", "--max-answer-seq-len", "8",
            "--reward-funcs", cfg.rewards.reward_funcs[0], "--no-progress"]
    proc = subprocess.Popen([sys.executable, "-c", "from dschat.cli.main import cli; cli()", *argv], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    progress = tmp_path / "killed.jsonl.progress.json"
    deadline = time.time() + 300
    try:
        while not (progress.exists() and json.loads(progress.read_text())["prompts_done"] >= 4):
            assert proc.poll() is None, "finished before it could be killed"
            assert time.time() < deadline
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not out.exists()
    again = run_cli(*argv)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming" in again.stderr
    assert out.read_bytes() == whole.read_bytes()
    assert not Path(str(out) + ".partial").exists()
