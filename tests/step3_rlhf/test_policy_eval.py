"""``dschat eval --step 1|3`` (dschat/apps/saved_policy.py, dschat/evaluation/lm.py, dschat/cli/eval.py): the metrics
from hand-made per-prompt values, the refusal of flags that do nothing, and end to end on the tiny preset, where
the command must reproduce a stage's own eval.json."""

import json
import math

import pytest

from dschat.apps.saved_policy import judge_win_metrics, ks_for, model_metrics, paired_metrics, pass_fail
from dschat.demo import demo_files
from dschat.errors import UserError
from dschat.stats import paired_se
from tests.helpers import read_json, run_cli
from tests.helpers import run_stage as run


def fake_run(scores, format_, rm, length, eos, kl=()):
    """One ``evaluate(..., detail=True)`` result over three prompts (one sample each)."""
    return {"scores": scores, "per_prompt": {"reward/format": format_, "reward/rm": rm, "kl": list(kl),
                                             "length": length, "eos": eos, "prompts": [], "completions": []}}


# Two samples of three prompts; total reward = format + rm.
POLICY = [fake_run([1.5, 1.0, -1.0], [1, 0, 0], [0.5, 1.0, -1.0], [3, 4, 5], [1, 1, 0], kl=[0.2, 0.0, 0.4]),
          fake_run([2.5, 1.0, -1.0], [1, 1, 0], [1.5, 0.0, -1.0], [5, 4, 3], [1, 0, 0], kl=[0.6, 0.0, 0.2])]
BASELINE = [fake_run([1.0, 1.0, 0.0], [0, 0, 0], [1.0, 1.0, 0.0], [2, 2, 2], [1, 1, 1]),
            fake_run([1.0, 1.0, 0.0], [0, 0, 0], [1.0, 1.0, 0.0], [2, 2, 2], [1, 1, 1])]
NAMES = ["format", "rm"]


def test_model_metrics_by_hand():
    m = model_metrics(POLICY, NAMES)
    # per-prompt mean rewards over the 2 samples: [2, 1, -1]; mean 2/3; deviations [4/3, 1/3, -5/3], squares
    # 16/9 + 1/9 + 25/9 = 42/9, unbiased variance 21/9, se sqrt(21/9) / sqrt(3)
    assert m["reward"] == pytest.approx(2 / 3)
    assert m["reward_se"] == pytest.approx(math.sqrt(21 / 9) / math.sqrt(3), rel=1e-6)
    assert m["reward/format"] == pytest.approx(3 / 6) and m["reward/rm"] == pytest.approx(1 / 6)
    assert m["answer_length"] == 4.0 and m["eos_rate"] == 0.5
    assert m["kl"] == pytest.approx(1.4 / 6)  # mean over all six samples
    # pass@k of the pass/fail source only (rm is graded): passes per prompt c = [2, 1, 0] of n = 2;
    # pass@1 = mean(c / n) = (1 + .5 + 0) / 3; pass@2 = mean(c > 0) = 2/3
    assert list(m["pass_at_k"]) == ["format"]
    assert m["pass_at_k"]["format"]["pass@1"]["value"] == pytest.approx(0.5)
    assert m["pass_at_k"]["format"]["pass@2"]["value"] == pytest.approx(2 / 3)
    assert model_metrics(BASELINE, NAMES)["kl"] is None  # no reference: no KL
    assert "pass_at_k" not in model_metrics(POLICY[:1], NAMES)  # one sample: pass@1 is just reward/format


def test_paired_gain_se_and_win_rate_agree_with_dschat_stats():
    p = paired_metrics(POLICY, BASELINE, NAMES)
    # per prompt: policy [2, 1, -1], baseline [1, 1, 0] -> differences [1, 0, -1]: gain 0, se 1 / sqrt(3)
    assert p["reward_gain"] == pytest.approx(0.0, abs=1e-12)
    assert p["reward_gain_se"] == pytest.approx(1 / math.sqrt(3), rel=1e-6)
    assert p["reward_gain_se"] == paired_se([1, 1, 0], [2, 1, -1])
    # win, tie, loss -> 0.5
    assert (p["wins"], p["ties"], p["losses"]) == (1, 1, 1) and p["win_rate"] == 0.5
    # format per prompt [1, .5, 0] vs [0, 0, 0]: gain .5, se std([1, .5, 0]) / sqrt(3) = .5 / sqrt(3)
    assert p["reward/format_gain"] == pytest.approx(0.5)
    assert p["reward/format_gain_se"] == pytest.approx(0.5 / math.sqrt(3), rel=1e-6)


def test_judge_win_rate_by_hand():
    # two samples of three prompts, each the mean over both orders of +1/-1/0
    m = judge_win_metrics([[1.0, 0.0, -1.0], [1.0, -0.5, 0.0]])
    # per prompt s = [1, -.25, -.5]; (s + 1) / 2 = [1, .375, .25] -> mean 1.625 / 3
    assert m["judge_win_rate"] == pytest.approx(1.625 / 3)
    assert (m["judge_wins"], m["judge_ties"], m["judge_losses"]) == (1, 0, 2)


def test_pass_fail_sources_and_the_ks_reported():
    assert pass_fail([0.0, 1.0, 1.0]) and pass_fail([-1.0, 1.0]) and pass_fail([0.0])
    assert not pass_fail([0.5, 1.0]) and not pass_fail([-1.0, 0.0, 1.0]) and not pass_fail([])
    assert ks_for(1) == [1] and ks_for(4) == [1, 2, 4] and ks_for(6) == [1, 2, 4, 6]


@pytest.mark.parametrize("argv, message", [
    (["--step", "1", "--baseline", "x"], "--baseline has no effect with --step 1"),
    (["--step", "1", "--reward-funcs", "format"], "--reward-funcs has no effect with --step 1"),
    (["--step", "2", "--data", "x.jsonl", "--num-samples", "2"], "--num-samples has no effect with --step 2"),
    (["--step", "3", "--max-seq-len", "9"], "--max-seq-len has no effect with --step 3"),
    (["--step", "3", "--votes", "3"], "--votes has no effect with --step 3"),
    (["--judge", "--data", "x.jsonl", "--baseline", "y"], "--baseline has no effect with --judge"),
    (["--step", "3", "--reward-funcs", "format", "--judge-max-new-tokens", "8"],
     "--judge-max-new-tokens has no effect without --judge-model"),
    (["--step", "3", "--reward-funcs", "format", "--judge-model", "tiny"],
     "--judge-model has no effect without --baseline"),
    (["--step", "3", "--reward-funcs", "format", "--reward-model", "r"],
     "--reward-model has no effect without the reward source 'rm'"),
    (["--step", "3", "--reward-funcs", "format", "--overlong-buffer", "4"],
     "--overlong-buffer has no effect without the reward source 'overlong'"),
    (["--step", "3"], "needs something to score the answers with"),
    (["--step", "3", "--reward-funcs", "rm"], "reward function 'rm' needs --reward-model"),
    (["--step", "2"], "dschat eval --step 2 needs --data"),
])
def test_flags_that_do_nothing_are_refused_before_anything_loads(argv, message):
    from dschat.cli.eval import eval_command

    with pytest.raises(UserError, match=message):
        eval_command.main(["--model", "tiny", *argv], standalone_mode=False)


@pytest.mark.slow
def test_eval_step1_reproduces_the_stage_perplexity(tmp_path):
    from dschat.config import SFTConfig, build_config

    out = tmp_path / "sft"
    run(build_config(SFTConfig, {"model": "tiny", "output_dir": str(out), "max_steps": 2, "max_eval_rows": 8,
                                 "per_device_train_batch_size": 4, "progress": False}))
    proc = run_cli("eval", "--step", "1", "--model", str(out), "--max-eval-rows", "8", "--batch-size", "3",
                   "--output", str(tmp_path / "m.json"), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    stage, m = read_json(out / "eval.json"), read_json(tmp_path / "m.json")
    assert m["eval_rows"] == 8 and m["model"] == str(out / "model")
    # the same rows, the same sums (another batch size: the sums are exact either way)
    assert m["perplexity"] == pytest.approx(stage["perplexity"], rel=1e-5)
    assert m["loss"] == pytest.approx(stage["eval_loss"], rel=1e-5)
    assert f"perplexity: {m['perplexity']:.4f}" in proc.stdout


USER_REWARD = '''
def length(prompts, completions, **row_fields):
    return [len(c) / 10 for c in completions]
'''


@pytest.mark.slow
def test_eval_step3_reproduces_a_grpo_stage_and_compares_a_model_with_itself(tmp_path):
    """A one-step GRPO run evaluated with 2 answers per held-out prompt (--eval-samples 2), then `dschat eval --step
    3 --num-samples 2` of its actor against the tiny start on the same held-out prompts: the stage's rewards before
    and after, its paired gain and standard error and its KL come back. A model
    against itself: every prompt a tie (by reward and by a judge), no gain, no KL."""
    from dschat.config import build_config
    from dschat.rlhf.config import RLHFConfig

    user = tmp_path / "rewards.py"
    user.write_text(USER_REWARD, encoding="utf-8")
    funcs = ["format", f"{user}:length"]
    prompts = str(demo_files()["prompts"])
    out = tmp_path / "grpo"
    run(build_config(RLHFConfig, {
        "algo": "grpo", "actor_model": "tiny", "data": [prompts], "output_dir": str(out), "max_steps": 1,
        "max_answer_seq_len": 12, "num_generations": 2, "per_device_generation_batch_size": 4,
        "per_device_train_batch_size": 8, "actor_learning_rate": 1e-2, "max_eval_rows": 6,
        "per_device_eval_batch_size": 4, "reward_funcs": funcs, "reward_weights": ["1", "0.5"],
        "eval_samples": 2, "progress": False}))
    stage = read_json(out / "eval.json")
    assert stage["eval_samples"] == 2
    common = ["--data", prompts, "--max-eval-rows", "6", "--batch-size", "4", "--max-new-tokens", "12",
              "--reward-funcs", funcs[0], "--reward-funcs", funcs[1], "--reward-weights", "1",
              "--reward-weights", "0.5", "--no-progress"]
    proc = run_cli("eval", "--step", "3", "--model", str(out), "--baseline", "tiny", "--num-samples", "2", *common,
                   "--output", str(tmp_path / "m.json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = read_json(tmp_path / "m.json")
    assert m["prompts"] == stage["eval_prompts"] == 6 and m["policy_model"] == str(out / "actor")
    assert m["policy"]["reward"] == pytest.approx(stage["reward_after"], abs=1e-5)
    assert m["baseline"]["reward"] == pytest.approx(stage["reward_before"], abs=1e-5)
    assert m["paired"]["reward_gain"] == pytest.approx(stage["reward_gain"], abs=1e-5)
    assert m["paired"]["reward_gain_se"] == pytest.approx(stage["reward_gain_se"], abs=1e-5)
    assert m["policy"]["kl"] == pytest.approx(stage["kl_after"], rel=1e-4, abs=1e-5)  # the reference is tiny
    assert m["policy"]["reward/format"] == pytest.approx(stage["reward_format_after"], abs=1e-6)
    assert m["policy"]["answer_length"] == pytest.approx(stage["answer_length_after"])
    assert "win rate (reward)" in proc.stdout and "policy - baseline" in proc.stdout

    proc = run_cli("eval", "--step", "3", "--model", "tiny", "--baseline", "tiny", "--num-samples", "2", *common,
                   "--judge-model", "tiny", "--judge-max-new-tokens", "4", "--output", str(tmp_path / "same.json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    same = read_json(tmp_path / "same.json")
    assert same["num_samples"] == 2 and same["paired"]["ties"] == 6 and same["paired"]["win_rate"] == 0.5
    assert same["paired"]["reward_gain"] == 0.0 and same["policy"]["kl"] == 0.0
    assert same["policy"] == {**same["baseline"], "kl": 0.0, "kl_se": 0.0}
    # the untrained tiny judge writes no verdict in 4 tokens: every pair is a tie, win rate 1/2
    assert same["paired"]["judge_ties"] == 6 and same["paired"]["judge_win_rate"] == 0.5
    assert "win rate (judge)" in proc.stdout
    assert set(same["policy"]["pass_at_k"]) == {"format"}  # the length reward is graded, not pass/fail
    assert set(same["policy"]["pass_at_k"]["format"]) == {"pass@1", "pass@2"}
    json.dumps(same, allow_nan=False)  # standard errors of too few prompts are null, not NaN
