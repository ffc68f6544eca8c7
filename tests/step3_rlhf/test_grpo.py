"""Stage 3 with --algo grpo: the GRPO family on the tiny preset, its helpers, and the GRPO pipeline's wiring.

The loss formulas (grpo/dr_grpo/dapo/gspo aggregation, clipping, k3) are unit-tested in tests/dschat/test_losses.py;
here: the loop runs for every loss type and at actor ZeRO 3, beta 0 loads no reference, dynamic sampling drops
all-equal groups, and old log-probs are cached exactly when the policy moves between generation and training.
"""


import pytest
import torch

from dschat import engine as E
from dschat.config import build_config, flag_specs
from dschat.demo import demo_files
from dschat.errors import UserError
from dschat.rewards.names import source_label
from dschat.rlhf.config import RLHFConfig, check_config, check_reward_data
from dschat.rlhf.engines import build_models
from dschat.rlhf.grpo import mask_truncated, needs_old_logprobs, optimizer_step_normalizers, select_groups
from dschat.rlhf.rollout import Rollout, repeat_prompts
from dschat.rlhf.scoring import reward_weights
from dschat.training.pipeline import GRPO_SFT_FOLDER, parse_stages, stage_argv
from tests.helpers import fraction_changed as _moved
from tests.helpers import read_json, read_jsonl
from tests.helpers import run_stage as run

# A user reward function: the completion's length in characters, so completions of one prompt (almost always)
# differ and the random tiny actor gets a gradient. It also checks that the row fields arrive aligned.
USER_REWARD = '''
def length(prompts, completions, answer=None, completion_lengths=None, **row_fields):
    assert len(prompts) == len(completions) == len(answer) == len(completion_lengths)
    assert all(a is not None for a in answer) and all(n > 0 for n in completion_lengths)
    return [len(c) / 10 for c in completions]
'''


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("rewards") / "user_rewards.py"
    path.write_text(USER_REWARD, encoding="utf-8")
    return f"{path}:length"


def grpo_cfg(out, reward_file, **kw):
    base = {"algo": "grpo", "actor_model": "tiny", "data": [str(demo_files()["prompts"])], "output_dir": str(out),
            "max_steps": 2, "max_answer_seq_len": 12, "num_generations": 2, "per_device_generation_batch_size": 2,
            "per_device_training_batch_size": 2, "max_eval_rows": 4, "per_device_eval_batch_size": 4,
            "reward_funcs": ["format", reward_file], "reward_weights": ["1", "0.5"], "progress": False,
            "force": True}
    base.update(kw)
    return build_config(RLHFConfig, base)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "gspo"])
def test_grpo_short_run_each_loss_type(tmp_path, reward_file, loss_type):
    out = tmp_path / loss_type
    metrics = run(grpo_cfg(out, reward_file, loss_type=loss_type))
    assert metrics["steps"] == 2 and metrics["algo"] == "grpo" and metrics["loss_type"] == loss_type
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "train/actor_loss" in r]
    assert len(rows) == 2
    for key in ("train/reward", "train/reward/format", f"train/reward/{source_label(reward_file)}",
                "train/reward_std",
                "train/frac_reward_zero_std", "train/kl", "train/clip_ratio_low", "train/clip_ratio_high",
                "train/answer_length", "time/generation_s", "time/training_s", "time/tokens_per_s"):
        assert key in rows[0], key
    assert all(abs(r["train/actor_loss"]) < 1e6 for r in rows)
    ev = read_json(out / "eval.json")
    for key in ("reward_before", "reward_after", "reward_before_se", "reward_gain_se", "reward_format_before",
                f"reward_{source_label(reward_file)}_after", "kl_after"):
        assert ev[key] is not None, key
    assert ev["kl_before"] == pytest.approx(0.0, abs=1e-5)  # actor == reference before training
    extra = ["overlong"] if loss_type == "dapo" else []  # dapo's soft overlong penalty, weight 1
    assert ev["reward_funcs"] == ["format", source_label(reward_file), *extra]  # the labels of the sources
    assert ev["reward_weights"] == [1.0, 0.5] + [1.0] * len(extra)
    assert _moved(out) > 0.9  # the actor trained
    assert not (out / "critic").exists()  # GRPO has no critic


def test_grpo_actor_zero3_with_iterations_and_dynamic_sampling(tmp_path, reward_file):
    out = tmp_path / "z3"
    # mu = 2 caches old log-probs; dynamic sampling on; the reference follows the actor to ZeRO 3
    metrics = run(grpo_cfg(out, reward_file, actor_zero_stage=3, num_iterations=2, dynamic_sampling=True,
                           max_resample_rounds=1, mask_truncated_completions=False))
    assert metrics["steps"] == 2 and metrics["reward_after"] is not None
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "train/actor_loss" in r]
    assert len(rows) == 2 and all("train/groups_kept" in r for r in rows)
    assert _moved(out) > 0.9


def test_beta_zero_builds_no_reference_and_no_critic(reward_file, tmp_path):
    E.setup_distributed()
    cfg = grpo_cfg(tmp_path / "b0", reward_file, beta=0.0)
    models = build_models(cfg, total_steps=1)
    assert models.ref is None and models.critic is None and models.reward is None
    cfg = grpo_cfg(tmp_path / "b1", reward_file, beta=0.04)
    assert build_models(cfg, total_steps=1).ref is not None


def test_select_groups_drops_all_equal_groups_and_caps_the_room():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0, 0.0, 0.5])  # groups of 2: equal, varied, equal, varied
    assert select_groups(rewards, 2, dynamic=True, room=8).tolist() == [2, 3, 6, 7]
    assert select_groups(rewards, 2, dynamic=True, room=1).tolist() == [2, 3]  # room for one group
    assert select_groups(rewards, 2, dynamic=True, room=0).tolist() == []
    assert select_groups(rewards, 2, dynamic=False, room=8).tolist() == list(range(8))
    assert select_groups(rewards, 4, dynamic=True, room=8).tolist() == list(range(8))  # both groups of 4 vary
    assert select_groups(torch.ones(6), 3, dynamic=True, room=5).tolist() == []


def test_old_logprobs_needed_only_when_the_policy_moves_before_training():
    assert not needs_old_logprobs(1, 1, 1, 0)  # one micro-batch, one step after it: old == current
    assert not needs_old_logprobs(1, 2, 2, 0)  # two micro-batches accumulate into one step
    assert not needs_old_logprobs(1, 1, 2, 1)  # the step falls after this generation's only micro-batch
    assert needs_old_logprobs(1, 2, 1, 0)  # a step after the first micro-batch moves the policy
    assert needs_old_logprobs(1, 2, 2, 1)  # one earlier micro-batch pending: the step falls in the middle
    assert needs_old_logprobs(2, 1, 1, 0)  # mu = 2 reuses the generation after a step


def test_repeat_prompts_keeps_a_groups_completions_consecutive():
    batch = {"prompt": torch.tensor([[0, 5], [6, 7]]), "prompt_att_mask": torch.tensor([[0, 1], [1, 1]]),
             "answer": ["a", "b"], "extra": [{"k": 1}, {"k": 2}]}
    out = repeat_prompts(batch, 3)
    assert out["prompt"].tolist() == [[0, 5]] * 3 + [[6, 7]] * 3
    assert out["prompt_att_mask"][:, 0].tolist() == [0, 0, 0, 1, 1, 1]
    assert out["answer"] == ["a", "a", "a", "b", "b", "b"] and out["extra"][3] == {"k": 2}


def test_mask_truncated_zeroes_only_answers_without_eos():
    amask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    rollout = Rollout(torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5, dtype=torch.long), amask, 2,
                      torch.tensor([True, False]))
    assert mask_truncated(rollout).action_mask.tolist() == [[1, 1, 0], [0, 0, 0]]


def test_grpo_flags_defaults_and_checks(tmp_path):
    names = [s.name for s in flag_specs(RLHFConfig)]  # raises on a duplicate flag
    assert len(names) == len(set(names))
    cfg = build_config(RLHFConfig, {"algo": "grpo", "actor_model": "tiny"})
    check_config(cfg)  # no --reward-model needed for the rule rewards
    assert cfg.grpo.eps_high == 0.2 and not cfg.grpo.dynamic
    dapo = build_config(RLHFConfig, {"algo": "grpo", "loss_type": "dapo"})
    assert dapo.grpo.eps_high == 0.28 and dapo.grpo.dynamic
    dapo = build_config(RLHFConfig, {"algo": "grpo", "loss_type": "dapo", "epsilon_high": 0.3,
                                     "dynamic_sampling": False})
    assert dapo.grpo.eps_high == 0.3 and not dapo.grpo.dynamic
    with pytest.raises(UserError, match="'rm' needs --reward-model"):
        check_config(build_config(RLHFConfig, {"algo": "grpo", "actor_model": "tiny", "reward_funcs": ["rm"]}))
    with pytest.raises(UserError, match="--reward-model"):
        check_config(build_config(RLHFConfig, {"actor_model": "tiny"}))  # PPO still needs it
    with pytest.raises(UserError, match="num-generations"):
        check_config(build_config(RLHFConfig, {"algo": "grpo", "actor_model": "tiny", "num_generations": 1}))
    rows = [{"answer": "3"}, {"answer": None}]
    check_reward_data(["format"], rows)  # format needs no ground truth
    with pytest.raises(UserError, match="'accuracy' needs a ground truth, but 1 of 2"):
        check_reward_data(["format", "accuracy"], rows)


def test_pipeline_grpo_stages_and_folders(tmp_path):
    assert parse_stages("grpo") == ["sft", "grpo"]
    assert parse_stages("grpo,sft") == ["sft", "grpo"]
    assert parse_stages("all") == ["sft", "rm", "ppo"]
    with pytest.raises(UserError, match="separate runs"):
        parse_stages("sft,rm,grpo")
    names = parse_stages("sft,grpo")
    sft = stage_argv("sft", tmp_path, "tiny", "", [], demo_files(), {}, names)
    assert sft[sft.index("--output-dir") + 1] == str(tmp_path / GRPO_SFT_FOLDER)
    assert sft[sft.index("--data") + 1] == str(demo_files()["sums_sft"])
    grpo = stage_argv("grpo", tmp_path, "tiny", "", [], demo_files(), {"grpo": ["--loss-type", "dapo"]}, names)
    assert grpo[grpo.index("--actor-model") + 1] == str(tmp_path / GRPO_SFT_FOLDER / "model")
    assert grpo[grpo.index("--data") + 1] == str(demo_files()["sums"])
    assert grpo[grpo.index("--output-dir") + 1] == str(tmp_path / "step3_grpo")
    assert grpo[-2:] == ["--loss-type", "dapo"] and "--reward-model" not in grpo
    # the demo SFT file holds prompt/response rows with worked completions of other prompts than GRPO's
    sft_rows = read_jsonl(demo_files()["sums_sft"])
    assert set(sft_rows[0]) == {"prompt", "response"} and sft_rows[0]["response"].strip().startswith("<think>")
    assert not {r["prompt"] for r in sft_rows} & {r["prompt"] for r in read_jsonl(demo_files()["sums"])}


@pytest.mark.parametrize("algo", ["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax"])
def test_the_grpo_demo_recipe_runs_under_every_sampling_algorithm(tmp_path, algo):
    """The critic-free estimators are compared on the GRPO demo with `--rl-args "--algo X"`: the recipe holds no
    flag that one of them refuses."""
    from dschat.cli.options import stage_command

    argv = stage_argv("grpo", tmp_path, "tiny", "", [], demo_files(), {"grpo": ["--algo", algo]}, parse_stages("grpo"))
    assert argv[:2] == ["--step", "3"]
    cmd = stage_command("step3", RLHFConfig, run=lambda cfg: cfg, help="")
    cfg = cmd.main(args=argv[2:], standalone_mode=False)  # parses, builds and refuses inert flags; runs nothing
    assert cfg.rl.algo == algo and cfg.optim.max_steps == 100


@pytest.mark.slow
def test_pipeline_grpo_runs_sft_then_grpo_and_reports(tmp_path):
    from tests.helpers import run_cli

    out = tmp_path / "pipe"
    proc = run_cli("pipeline", "grpo", "--output-dir", str(out), "--sft-args", "--max-steps 10 --no-progress",
                   "--rl-args", "--max-steps 2 --max-eval-rows 8 --max-answer-seq-len 12 --no-progress",
                   timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "GRPO  reward" in proc.stdout and "format" in proc.stdout
    report = read_json(out / "pipeline.json")
    assert set(report["seconds"]) == {"sft", "grpo"} and report["grpo_reward_after"] is not None
    assert report["grpo_reward_funcs"] == ["format", "accuracy"]
    args = read_json(out / "step3_grpo" / "args.json")
    assert args["algo"] == "grpo" and args["actor_model"] == str(out / GRPO_SFT_FOLDER / "model")
    assert read_json(out / GRPO_SFT_FOLDER / "args.json")["data"] == [str(demo_files()["sums_sft"])]


def test_optimizer_step_normalizers_follow_the_accumulation_windows():
    from types import SimpleNamespace

    def mb(*lengths):
        mask = torch.zeros(len(lengths), 6)
        for i, n in enumerate(lengths):
            mask[i, :n] = 1
        return SimpleNamespace(rollout=SimpleNamespace(action_mask=mask))

    mbs = [mb(2, 3), mb(1, 0), mb(4, 4), mb(5, 1)]  # tokens 5, 1, 8, 6; sequences with tokens 2, 1, 2, 2
    # grad_accum 2, one micro-batch already accumulated: windows [mb0], [mb1, mb2], [mb3]; scale 2 * world 1
    assert optimizer_step_normalizers(mbs, "dapo", 6, micro_steps=3, grad_accum=2) == [5 / 2, 9 / 2, 9 / 2, 6 / 2]
    assert optimizer_step_normalizers(mbs, "grpo", 6, micro_steps=4, grad_accum=2) == [3 / 2, 3 / 2, 4 / 2, 4 / 2]
    assert optimizer_step_normalizers(mbs, "dr_grpo", 6, micro_steps=0, grad_accum=4) == [48 / 4] * 4


def test_dapo_adds_the_soft_overlong_penalty_unless_told_not_to():
    def cfg(**kw):
        return build_config(RLHFConfig, {"algo": "grpo", "actor_model": "tiny", **kw})

    def reward_func_names(c):
        return c.reward_func_names()

    assert reward_func_names(cfg(loss_type="grpo")) == ["format", "accuracy"]
    assert reward_func_names(cfg(loss_type="dapo")) == ["format", "accuracy", "overlong"]
    assert reward_func_names(cfg(loss_type="dapo", overlong_penalty=False)) == ["format", "accuracy"]
    assert reward_func_names(cfg(loss_type="grpo", overlong_penalty=True)) == ["format", "accuracy", "overlong"]
    c = cfg(loss_type="dapo", reward_funcs=["format", "overlong"], reward_weights=["0.5", "2"])
    assert reward_func_names(c) == ["format", "overlong"] and reward_weights(c.rewards, ["format", "overlong"]) == [
        0.5, 2.0]
    c = cfg(loss_type="dapo", reward_funcs=["format"], reward_weights=["0.5"])
    assert reward_weights(c.rewards, reward_func_names(c)) == [0.5, 1.0]


def test_each_reward_source_gets_the_paired_standard_error_of_its_gain():
    from types import SimpleNamespace

    from dschat.rlhf.evaluation import eval_scalars, source_summary

    scorer = SimpleNamespace(mixer=SimpleNamespace(names=["format", "accuracy"], weights=[1.0, 1.0]))
    before = {"reward/format": 0.5, "reward/accuracy": 0.0,
              "source_scores": {"format": [0, 1, 1, 0], "accuracy": [0, 0, 0, 0]}}
    after = {"reward/format": 1.0, "reward/accuracy": 0.75,
             "source_scores": {"format": [1, 1, 1, 1], "accuracy": [1, 1, 1, 0]}}
    out = source_summary(before, after, scorer)
    # format: differences 1 0 0 1, mean 0.5, sample variance (4 * 0.25) / 3 = 1/3, s.e. sqrt(1/3 / 4) = 0.2887
    assert out["reward_format_gain_se"] == pytest.approx((1 / 3 / 4) ** 0.5)
    # accuracy: differences 1 1 1 0, mean 0.75, sample variance (3 * 0.0625 + 0.5625) / 3 = 0.25, s.e. 0.5 / 2
    assert out["reward_accuracy_gain_se"] == pytest.approx(0.25)
    assert out["reward_accuracy_before"] == 0.0 and out["reward_accuracy_after"] == 0.75
    assert "eval/source_scores" not in eval_scalars(after) and eval_scalars(after)["eval/reward/format"] == 1.0
    del before["source_scores"]  # a state saved before the per-source scores existed (resume): no s.e., no error
    assert "reward_format_gain_se" not in source_summary(before, after, scorer)


@pytest.mark.slow
def test_grpo_two_ranks_on_a_world_group_without_a_cpu_backend(tmp_path, reward_file):
    """Two ranks under the launcher with the world group CUDA-only for dschat's collectives, as NCCL is: GRPO's
    loss units, group counts and metric means are all-reduced from CPU tensors, which the engine must route."""
    from tests.helpers import assert_cuda_only_world, cuda_only_world, run_cli

    out = tmp_path / "dist"
    proc = run_cli("train", "--step", "3", "--num-gpus", "2", "--algo", "grpo", "--actor-model", "tiny",
                   "--data", str(demo_files()["prompts"]), "--reward-funcs", reward_file, "--output-dir", str(out),
                   "--max-steps", "2", "--max-answer-seq-len", "12", "--num-generations", "2",
                   "--per-device-generation-batch-size", "2", "--per-device-training-batch-size", "2",
                   "--max-eval-rows", "4", "--no-progress", timeout=900, env=cuda_only_world(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_cuda_only_world(tmp_path)
    assert read_json(out / "args.json")["world_size"] == 2
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "train/actor_loss" in r]
    assert len(rows) == 2 and all(r["time/tokens_per_s"] > 0 and abs(r["train/actor_loss"]) < 1e6 for r in rows)
