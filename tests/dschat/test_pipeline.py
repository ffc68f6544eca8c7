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


def test_pipeline_dpo_stages_and_folders(tmp_path):
    from dschat.demo import demo_files
    from dschat.pipeline import stage_argv

    assert parse_stages("dpo") == ["sft", "rm", "dpo"]
    assert parse_stages("sft,rm") == ["sft", "rm"]
    with pytest.raises(UserError, match="separate runs"):
        parse_stages("sft,rm,ppo,dpo")
    names = parse_stages("dpo")
    # SFT and RM are the PPO pipeline's, flag for flag, so a finished `dschat pipeline all` folder is reused.
    for stage in ("sft", "rm"):
        assert stage_argv(stage, tmp_path, "tiny", "", [], True, {}, names) == \
            stage_argv(stage, tmp_path, "tiny", "", [], True, {}, parse_stages("all"))
    dpo = stage_argv("dpo", tmp_path, "tiny", "", [], True, {}, names)
    assert dpo[dpo.index("--actor-model") + 1] == str(tmp_path / "step1_sft" / "model")
    assert dpo[dpo.index("--reward-model") + 1] == str(tmp_path / "step2_reward" / "model")
    assert dpo[dpo.index("--data") + 1] == str(demo_files()["pairwise"])
    assert dpo[dpo.index("--output-dir") + 1] == str(tmp_path / "step3_dpo")
    assert dpo.count("--algo") == 1 and dpo[dpo.index("--algo") + 1] == "dpo"
    online = stage_argv("dpo", tmp_path, "tiny", "", [], True, {"dpo": ["--algo", "online_dpo", "--max-steps", "3"]},
                        names)
    assert online.count("--algo") == 1 and online[online.index("--algo") + 1] == "online_dpo"
    assert online[online.index("--output-dir") + 1] == str(tmp_path / "step3_online_dpo")
    assert online[-2:] == ["--max-steps", "3"] and "--num-generations" in online
    with pytest.raises(UserError, match="--algo dpo or online_dpo"):
        stage_argv("dpo", tmp_path, "tiny", "", [], True, {"dpo": ["--algo=grpo"]}, names)


@pytest.mark.slow
def test_pipeline_dpo_and_online_dpo_report(tmp_path):
    out = tmp_path / "pipe"
    fast = ["--sft-args", "--max-steps 20 --no-progress", "--rm-args", "--max-steps 20 --no-progress"]
    rl = "--max-steps 2 --max-eval-rows 8 --max-answer-seq-len 12 --per-device-generation-batch-size 4 --no-progress"
    proc = run_cli("pipeline", "dpo", "--output-dir", str(out), *fast, "--rl-args", rl, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "DPO   implicit acc." in proc.stdout and "RM reward" in proc.stdout
    report = read_json(out / "pipeline.json")
    assert report["dpo_algo"] == "dpo" and report["dpo_eval_pairs_after"] == 8
    assert report["dpo_implicit_accuracy_before"] == pytest.approx(0.5) and report["dpo_reward_gain_se"] is not None
    assert set(report["seconds"]) == {"sft", "rm", "dpo"}
    proc = run_cli("pipeline", "dpo", "--output-dir", str(out), *fast, "--rl-args", f"--algo online_dpo {rl}",
                   timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("already finished; skipped") == 2  # SFT and RM reused
    assert "ODPO  implicit acc." in proc.stdout and "pairs trained" in proc.stdout
    report = read_json(out / "pipeline.json")
    assert report["dpo_algo"] == "online_dpo" and report["dpo_pairs"] > 0 and set(report["seconds"]) == {"dpo"}
    assert read_json(out / "step3_online_dpo" / "args.json")["reward_model"] == str(out / "step2_reward" / "model")
