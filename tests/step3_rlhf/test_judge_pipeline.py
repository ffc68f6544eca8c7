"""The generative judge in stage 3 and the pipeline: the reward function `judge` (flags, checks, a short GRPO run
scored by a judge), `dschat pipeline judge` (stages, folders, report) and launch/rm_r1_judge.sh."""

import os
import subprocess
import sys

import pytest

from dschat.config import build_config
from dschat.demo import demo_files
from dschat.errors import UserError
from dschat.rewards.judge import JUDGE, parse_verdict
from dschat.rlhf.config import RLHFConfig, check_config, check_reward_data
from dschat.rlhf.scoring import build_scorer
from dschat.training.pipeline import FOLDERS, JUDGE_SFT_FOLDER, parse_stages, stage_argv, summarize
from dschat.utils import write_json
from tests.helpers import ROOT, read_json, read_jsonl
from tests.helpers import run_stage as run


def test_judge_reward_flags_and_checks():
    base = {"algo": "grpo", "actor_model": "tiny", "reward_funcs": [JUDGE]}
    with pytest.raises(UserError, match="'judge' needs --judge-model"):
        check_config(build_config(RLHFConfig, base))
    check_config(build_config(RLHFConfig, {**base, "judge_model": "tiny"}))
    # PPO takes reward sources too; without a reward model its critic needs its own initialisation
    ppo = {"actor_model": "tiny", "reward_funcs": [JUDGE], "judge_model": "tiny"}
    with pytest.raises(UserError, match="--critic-model"):
        check_config(build_config(RLHFConfig, ppo))
    check_config(build_config(RLHFConfig, {**ppo, "critic_model": "tiny"}))
    with pytest.raises(UserError, match="'rm' needs --reward-model"):
        check_config(build_config(RLHFConfig, {**ppo, "critic_model": "tiny", "reward_funcs": ["rm", JUDGE]}))
    with pytest.raises(UserError, match="reward 'judge' needs a ground truth, but 1 of 2"):
        check_reward_data([JUDGE], [{"answer": "ref"}, {"answer": None}])


def test_build_scorer_loads_the_judge_as_a_reward_function(tmp_path):
    cfg = build_config(RLHFConfig, {"algo": "grpo", "actor_model": "tiny", "judge_model": "tiny",
                                    "reward_funcs": ["format", JUDGE], "judge_max_new_tokens": 3})
    scorer = build_scorer(cfg, models=None)
    assert scorer.mixer.names == ["format", JUDGE]
    judge = scorer.mixer.funcs[JUDGE]
    prompts = ["\n\nHuman: Where is my order?\n\nAssistant:"] * 2
    # The untrained tiny judge writes no verdict in 3 tokens: unparseable in both orders, so 0 for both.
    values = judge(prompts, [" It ships today.", " no"], answer=["Sorry, it ships today.", "ok"], prompt=prompts)
    assert values == [0.0, 0.0]


def test_pipeline_judge_stages_folders_and_demo_data(tmp_path):
    assert parse_stages("judge") == ["sft", "judge"]
    with pytest.raises(UserError, match="separate runs"):
        parse_stages("sft,grpo,judge")
    with pytest.raises(UserError, match="separate runs"):
        parse_stages("rm,judge")
    names = parse_stages("judge")
    sft = stage_argv("sft", tmp_path, "tiny", "", [], demo_files(), {}, names)
    assert sft[sft.index("--output-dir") + 1] == str(tmp_path / JUDGE_SFT_FOLDER)
    assert sft[sft.index("--data") + 1] == str(demo_files()["judge_sft"])
    rl = stage_argv("judge", tmp_path, "tiny", "", [], demo_files(), {"judge": ["--max-steps", "3"]}, names)
    assert rl[rl.index("--actor-model") + 1] == str(tmp_path / JUDGE_SFT_FOLDER / "model")
    assert rl[rl.index("--data") + 1] == str(demo_files()["judge"])
    assert rl[rl.index("--output-dir") + 1] == str(tmp_path / FOLDERS["judge"])
    assert rl[rl.index("--algo") + 1] == "grpo" and rl[rl.index("--reward-funcs") + 1] == "judge_match"
    assert rl[-2:] == ["--max-steps", "3"]
    user = stage_argv("judge", tmp_path, "my-model", "", ["mine.jsonl"], None, {}, names)
    assert user[user.index("--data") + 1] == "mine.jsonl" and "--reward-funcs" in user
    # the demo files: cold-start rows ending in the true winner's verdict, held-out rows of their own seed
    cold = read_jsonl(demo_files()["judge_sft"])
    assert len(cold) == 1000 and all(parse_verdict(r["response"]) == r["winner"][-1].upper() for r in cold)
    held = {r["context_messages"][-1]["content"] for r in read_jsonl(demo_files()["judge_eval"])}
    train = {r["context_messages"][-1]["content"] for r in read_jsonl(demo_files()["judge"])}
    assert len(held) == 300 and not held & train and not held & {r["context_messages"][-1]["content"] for r in cold}


def test_pipeline_judge_report_gives_accuracy_gain_with_paired_se(tmp_path):
    write_json(tmp_path / JUDGE_SFT_FOLDER / "eval.json", {"perplexity_before": 9.0, "perplexity": 2.0})
    write_json(tmp_path / FOLDERS["judge"] / "eval.json", {"reward_before": -0.1, "reward_after": 0.5})
    write_json(tmp_path / "judge_eval_before.json", {"accuracy": 0.5, "n": 4, "correct": [1, 0, 1, 0]})
    write_json(tmp_path / "judge_eval_after.json", {"accuracy": 1.0, "n": 4, "correct": [1, 1, 1, 1]})
    report = summarize(tmp_path, {"sft": 1.0}, ["sft", "judge"])
    # diffs 0 1 0 1: mean 0.5, sample variance 1/3, se sqrt(1/3 / 4)
    assert report["judge_accuracy_gain"] == pytest.approx(0.5)
    assert report["judge_accuracy_gain_se"] == pytest.approx((1 / 3 / 4) ** 0.5)
    assert report["judge_match_reward_after"] == 0.5 and report["judge_n_after"] == 4
    # with format weighed in (the demo's recipe), judge_match is its own source, not the total
    write_json(tmp_path / FOLDERS["judge"] / "eval.json", {
        "reward_before": 0.7, "reward_after": 1.9, "reward_funcs": ["judge_match", "format"],
        "reward_judge_match_before": -0.2, "reward_judge_match_after": 0.9, "reward_judge_match_gain_se": 0.1,
        "reward_format_before": 0.9, "reward_format_after": 1.0})
    report = summarize(tmp_path, {"sft": 1.0}, ["sft", "judge"])
    assert report["judge_match_reward_before"] == -0.2 and report["judge_match_reward_after"] == 0.9
    assert report["judge_match_reward_gain_se"] == 0.1 and report["judge_reward_format_after"] == 1.0
    assert report["judge_reward_after"] == 1.9


def test_rm_r1_launch_script_dry_run(tmp_path):
    path = ROOT / "launch" / "rm_r1_judge.sh"
    assert os.access(path, os.X_OK) and "set -euo pipefail" in path.read_text()
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    env = {**os.environ, "DRY_RUN": "1", "PYTHON": sys.executable}
    proc = subprocess.run([str(path), "--save-interval", "50"], cwd=tmp_path, capture_output=True, text=True,
                          env={**env, "MODEL": "my/judge-7b", "DATA": "a.jsonl,b.jsonl", "NUM_GPUS": "8",
                               "EVAL_DATA": "held.jsonl"}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    grpo = next(line for line in proc.stderr.splitlines() if "--step 3" in line)
    for part in ("--num-gpus 8", "--algo grpo", "--actor-model my/judge-7b", "--data a.jsonl", "--data b.jsonl",
                 "--reward-funcs judge_match", "--num-generations 7", "--beta 0.001", "--kl-estimator k3",
                 "--actor-learning-rate 1e-6", "--save-interval 50"):
        assert part in grpo, (part, grpo)
    assert "eval --judge" in proc.stderr and "held.jsonl" in proc.stderr
    proc = subprocess.run([str(path)], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2 and "MODEL" in proc.stderr  # a real run needs a model and data
    proc = subprocess.run([str(path), "--tiny"], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--step 1 --model tiny" in proc.stderr and "--reward-funcs judge_match" in proc.stderr
    assert "--reward-funcs format --reward-weights 1 --reward-weights 1" in proc.stderr  # as the pipeline's demo


@pytest.mark.slow
def test_ppo_with_a_judge_reward_and_no_reward_model(tmp_path):
    """PPO scored by the (untrained) tiny judge against the prompts' reference answers: no reward model loads,
    the critic starts from --critic-model."""

    cfg = build_config(RLHFConfig, {
        "actor_model": "tiny", "critic_model": "tiny", "judge_model": "tiny", "reward_funcs": [JUDGE, "format"],
        "judge_max_new_tokens": 4, "data": [str(demo_files()["prompts"])], "data_split": "0,0,1",
        "output_dir": str(tmp_path / "o"), "max_steps": 2, "max_answer_seq_len": 8,
        "per_device_generation_batch_size": 2, "per_device_training_batch_size": 2, "max_eval_rows": 2,
        "progress": False, "force": True})
    metrics = run(cfg)
    assert metrics["algo"] == "ppo" and metrics["steps"] == 2 and metrics["reward_funcs"] == [JUDGE, "format"]
    assert metrics[f"reward_{JUDGE}_after"] == 0.0 and metrics["reward_format_after"] == 0.0
    rows = [r for r in read_jsonl(tmp_path / "o" / "metrics.jsonl") if "train/critic_loss" in r]
    assert len(rows) == 2 and all(r["train/reward"] == 0.0 for r in rows)


@pytest.mark.slow
def test_grpo_with_a_judge_reward_runs_end_to_end(tmp_path):
    """Two GRPO steps whose only reward is the (untrained) tiny judge: the wiring from --reward-funcs judge to
    eval.json, with the reference answers of prompt-only rows."""

    cfg = build_config(RLHFConfig, {
        "algo": "grpo", "actor_model": "tiny", "judge_model": "tiny", "reward_funcs": [JUDGE],
        "judge_max_new_tokens": 4, "data": [str(demo_files()["prompts"])], "output_dir": str(tmp_path / "o"),
        "max_steps": 2, "max_answer_seq_len": 8, "num_generations": 2, "per_device_generation_batch_size": 2,
        "per_device_training_batch_size": 4, "max_eval_rows": 2, "progress": False, "force": True, "beta": 0.0})
    metrics = run(cfg)
    assert metrics["steps"] == 2 and metrics["reward_funcs"] == [JUDGE]
    assert metrics[f"reward_{JUDGE}_after"] == 0.0  # unparseable in both orders
    rows = [r for r in read_jsonl(tmp_path / "o" / "metrics.jsonl") if f"train/reward/{JUDGE}" in r]
    assert len(rows) == 2
    assert read_json(tmp_path / "o" / "args.json")["judge_model"] == "tiny"


@pytest.mark.slow
def test_pipeline_judge_runs_sft_grpo_and_both_evals(tmp_path):
    from dschat.demo.corpus import generate_judge_pairs
    from dschat.utils import write_jsonl
    from tests.helpers import run_cli

    held = write_jsonl(generate_judge_pairs(4, seed=9), tmp_path / "held.jsonl")
    out = tmp_path / "pipe"
    proc = run_cli("pipeline", "judge", "--output-dir", str(out), "--sft-args", "--max-steps 4 --no-progress",
                   "--rl-args", "--max-steps 1 --max-eval-rows 4 --max-answer-seq-len 8 --no-progress",
                   "--eval-data", str(held), "--eval-args", "--max-new-tokens 4", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "JUDGE accuracy" in proc.stdout and "position bias" in proc.stdout
    report = read_json(out / "pipeline.json")
    assert set(report["seconds"]) == {"sft", "judge", "eval_before", "eval_after"}
    assert report["judge_n_before"] == report["judge_n_after"] == 4
    assert report["judge_accuracy_gain"] is not None
    assert read_json(out / "judge_eval_after.json")["model"] == str(out / FOLDERS["judge"] / "actor")
    args = read_json(out / FOLDERS["judge"] / "args.json")
    assert args["reward_funcs"] == ["judge_match", "format"] and args["reward_weights"] == ["1", "1"]
    assert args["actor_model"] == str(out / JUDGE_SFT_FOLDER / "model")
    assert "well-formed" in proc.stdout
