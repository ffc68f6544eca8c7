"""`dschat pipeline` chains the stages, skips finished ones, and reports; `dschat data inspect` shows samples."""

import pytest

from dschat.errors import UserError
from dschat.pipeline import parse_stages
from tests.helpers import read_json, run_cli


def test_parse_stages():
    assert parse_stages("all") == ["sft", "rm", "ppo"]
    assert parse_stages("ppo,sft") == ["sft", "ppo"]
    with pytest.raises(UserError, match="unknown pipeline stage"):
        parse_stages("sft,dpo2")


def test_data_inspect_shows_decoded_samples_and_masks():
    proc = run_cli("data", "inspect", "--phase", "2", "-n", "1")
    assert proc.returncode == 0, proc.stderr
    assert "format pairwise" in proc.stdout
    assert "chosen (" in proc.stdout and "rejected (" in proc.stdout and "attention_mask" in proc.stdout
    proc = run_cli("data", "inspect", "--phase", "1", "-n", "1")
    assert "masked  (" in proc.stdout and "trained (" in proc.stdout and "labels:" in proc.stdout
    assert "1 trained span(s)" in proc.stdout  # the demo's pairwise rows: one answer each


@pytest.mark.slow
def test_pipeline_all_runs_each_stage_on_the_previous_output_and_skips_finished(tmp_path):
    out = tmp_path / "pipe"
    args = ["pipeline", "all", "--output-dir", str(out), "--sft-args", "--max-steps 20 --no-progress",
            "--rm-args", "--max-steps 20 --no-progress",
            "--rl-args", "--max-steps 3 --max-eval-rows 16 --max-answer-seq-len 16 --no-progress"]
    proc = run_cli(*args, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dschat pipeline report" in proc.stdout
    report = read_json(out / "pipeline.json")
    assert report["sft_perplexity"] < report["sft_perplexity_before"]
    assert report["rm_accuracy"] > report["rm_accuracy_before"]
    assert report["ppo_reward_after"] is not None and set(report["seconds"]) == {"sft", "rm", "ppo"}
    assert read_json(out / "step2_reward" / "args.json")["model"] == str(out / "step1_sft" / "model")
    assert read_json(out / "step3_rlhf" / "args.json")["reward_model"] == str(out / "step2_reward" / "model")
    again = run_cli("pipeline", "sft,rm", "--output-dir", str(out), timeout=300)
    assert again.returncode == 0 and again.stderr.count("already finished; skipped") == 2
