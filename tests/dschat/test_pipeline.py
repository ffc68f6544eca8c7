"""`dschat pipeline` chains the stages, skips finished ones, and reports; `dschat data inspect` shows samples."""

import pytest

from dschat.errors import UserError
from dschat.training.pipeline import parse_stages
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
    # the pictures of every stage (dschat report), one section each, a self-contained page
    assert f"pictures: {out / 'report' / 'report.html'}" in proc.stdout
    for stage, plot in (("step1_sft", "perplexity"), ("step2_reward", "accuracy"), ("step3_rlhf", "reward")):
        assert (out / "report" / stage / f"{plot}.png").stat().st_size > 5000
    page = (out / "report" / "report.html").read_text()
    assert page.count("<h2>") == 3 and "http://" not in page and "https://" not in page
    again = run_cli("pipeline", "sft,rm", "--output-dir", str(out), timeout=300)
    assert again.returncode == 0 and again.stderr.count("already finished; skipped") == 2


def test_pipeline_dpo_stages_and_folders(tmp_path):
    from dschat.demo import demo_files
    from dschat.training.pipeline import stage_argv

    assert parse_stages("dpo") == ["sft", "rm", "dpo"]
    assert parse_stages("sft,rm") == ["sft", "rm"]
    with pytest.raises(UserError, match="separate runs"):
        parse_stages("sft,rm,ppo,dpo")
    names = parse_stages("dpo")
    # SFT and RM are the PPO pipeline's, flag for flag, so a finished `dschat pipeline all` folder is reused.
    for stage in ("sft", "rm"):
        assert stage_argv(stage, tmp_path, "tiny", "", [], demo_files(), {}, names) == \
            stage_argv(stage, tmp_path, "tiny", "", [], demo_files(), {}, parse_stages("all"))
    dpo = stage_argv("dpo", tmp_path, "tiny", "", [], demo_files(), {}, names)
    assert dpo[dpo.index("--actor-model") + 1] == str(tmp_path / "step1_sft" / "model")
    assert dpo[dpo.index("--reward-model") + 1] == str(tmp_path / "step2_reward" / "model")
    assert dpo[dpo.index("--data") + 1] == str(demo_files()["pairwise"])
    assert dpo[dpo.index("--output-dir") + 1] == str(tmp_path / "step3_dpo")
    assert dpo.count("--algo") == 1 and dpo[dpo.index("--algo") + 1] == "dpo"
    online = stage_argv("dpo", tmp_path, "tiny", "", [], demo_files(),
                        {"dpo": ["--algo", "online_dpo", "--max-steps", "3"]}, names)
    assert online.count("--algo") == 1 and online[online.index("--algo") + 1] == "online_dpo"
    assert online[online.index("--output-dir") + 1] == str(tmp_path / "step3_online_dpo")
    assert online[-2:] == ["--max-steps", "3"] and "--num-generations" in online
    with pytest.raises(UserError, match="--algo dpo or online_dpo"):
        stage_argv("dpo", tmp_path, "tiny", "", [], demo_files(), {"dpo": ["--algo=grpo"]}, names)


@pytest.mark.slow
def test_pipeline_dpo_and_online_dpo_report(tmp_path):
    out = tmp_path / "pipe"
    fast = ["--sft-args", "--max-steps 20 --no-progress", "--rm-args", "--max-steps 20 --no-progress"]
    rl = "--max-steps 2 --max-eval-rows 8 --max-answer-seq-len 12 --no-progress"
    proc = run_cli("pipeline", "dpo", "--output-dir", str(out), *fast, "--rl-args",
                   f"{rl} --per-device-train-batch-size 4", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "DPO   implicit acc." in proc.stdout and "RM reward" in proc.stdout
    report = read_json(out / "pipeline.json")
    assert report["dpo_algo"] == "dpo" and report["dpo_eval_pairs_after"] == 8
    assert report["dpo_implicit_accuracy_before"] == pytest.approx(0.5) and report["dpo_reward_gain_se"] is not None
    assert set(report["seconds"]) == {"sft", "rm", "dpo"}
    proc = run_cli("pipeline", "dpo", "--output-dir", str(out), *fast, "--rl-args",
                   f"--algo online_dpo {rl} --per-device-generation-batch-size 4", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("already finished; skipped") == 2  # SFT and RM reused
    assert "ODPO  implicit acc." in proc.stdout and "pairs trained" in proc.stdout
    report = read_json(out / "pipeline.json")
    assert report["dpo_algo"] == "online_dpo" and report["dpo_pairs"] > 0 and set(report["seconds"]) == {"dpo"}
    assert read_json(out / "step3_online_dpo" / "args.json")["reward_model"] == str(out / "step2_reward" / "model")


REPORT = {"sft_perplexity_before": 4155.889, "sft_perplexity": 9.3211, "rm_accuracy_before": 0.5, "rm_accuracy": 1.0,
          "dpo_algo": "online_dpo", "dpo_loss_type": "sigmoid", "dpo_beta": 0.5, "dpo_implicit_accuracy_before": 0.5,
          "dpo_implicit_accuracy_after": 0.594, "dpo_eval_pairs_after": 256, "dpo_reward_before": 3.228,
          "dpo_reward_after": 3.919, "dpo_reward_gain": 0.691, "dpo_reward_gain_se": 0.064, "dpo_eval_prompts": 256,
          "dpo_eval_samples": 8, "dpo_kl_after": 1.181, "dpo_pairs": 1600, "dpo_tie_groups": 0,
          "dpo_sampled_implicit_accuracy_before": 0.5, "dpo_sampled_implicit_accuracy_after": 0.68,
          "dpo_sampled_pairs_after": 250, "dpo_onpolicy_implicit_accuracy_before": None,
          "dpo_onpolicy_implicit_accuracy_after": 0.695, "dpo_onpolicy_pairs_after": 0,
          "judge_reward_funcs": ["judge_match", "format"], "judge_match_reward_before": -0.2,
          "judge_match_reward_after": 0.4,
          "judge_reward_format_before": 0.1, "judge_reward_format_after": 0.9, "judge_accuracy_before": 0.55,
          "judge_accuracy_before_se": 0.05, "judge_accuracy_after": 0.7, "judge_accuracy_after_se": 0.045,
          "judge_accuracy_gain": 0.15, "judge_accuracy_gain_se": 0.04, "judge_n_after": 100,
          "judge_unparseable_rate_before": 0.3, "judge_unparseable_rate_after": 0.05, "judge_position_bias_before": 0.2,
          "judge_position_bias_after": -0.05, "judge_format_rate_before": 0.4, "judge_format_rate_after": None,
          "seconds": {"sft": 14.2, "dpo": 61.0}}


def test_report_lines_of_the_online_dpo_and_judge_pipelines():
    """The printed report, line by line, from a report dict: values to 3 decimals, '-' for a missing one, each
    reward source of the judge pipeline but judge_match on a line of its own."""
    from dschat.training.pipeline import report_lines

    assert report_lines(REPORT, ["sft", "rm", "dpo"], "online_dpo") == [
        'SFT   perplexity        4155.89 -> 9.32',
        'RM    accuracy          0.500 -> 1.000',
        'ODPO  implicit acc.     0.500 -> 0.594 (256 held-out pairs), online_dpo loss sigmoid, beta 0.5',
        '      RM reward         3.228 -> 3.919 (gain 0.691 ± 0.064 s.e., 256 held-out prompts x 8 answers), '
        'KL 1.181',
        "      sampled pairs     implicit acc. 0.500 -> 0.680 (250 held-out pairs of the SFT policy's "
        'answers, best vs worst by reward)',
        "      on-policy pairs   implicit acc. - -> 0.695 (- held-out pairs of the evaluated policy's own "
        'answers)',
        '      pairs trained     1600, tied groups skipped 0',
        'time  sft 14s, dpo 61s',
    ]
    assert report_lines(REPORT, ["sft", "judge"]) == [
        'SFT   perplexity        4155.89 -> 9.32',
        "GRPO  judge_match       -0.200 -> 0.400 (sampled, on GRPO's own held-out rows)",
        '      format            0.100 -> 0.900 (sampled)',
        'JUDGE accuracy          0.550 ± 0.050 -> 0.700 ± 0.045 (gain 0.150 ± 0.040 s.e., 100 held-out rows, '
        'greedy)',
        '      unparseable       0.300 -> 0.050',
        '      position bias     0.200 -> -0.050 (accuracy when A wins minus when B wins)',
        '      well-formed       0.400 -> - (share of completions with <think>..</think> then '
        '<answer>..</answer>)',
        'time  sft 14s, dpo 61s',
    ]
