"""Flags are declared once (dataclasses) and reach the stage through the CLI and --config files."""

import json

import pytest

from dschat.cli.options import stage_command
from dschat.config import SFTConfig, build_config, flag_specs
from dschat.errors import UserError
from tests.helpers import run_cli


def capture(argv):
    seen = {}
    cmd = stage_command("t", SFTConfig, lambda cfg: seen.setdefault("cfg", cfg), help="")
    cmd.main(args=argv, standalone_mode=False)
    return seen["cfg"]


def test_flags_generated_from_dataclasses_with_both_spellings():
    cfg = capture(["--per_device_train_batch_size", "3", "--learning-rate", "0.01", "--gradient-checkpointing",
                   "--data", "a.jsonl", "--data", "b.jsonl:2", "--zero-stage", "3"])
    assert cfg.optim.per_device_train_batch_size == 3
    assert cfg.optim.learning_rate == 0.01
    assert cfg.model.gradient_checkpointing is True
    assert cfg.data.data == ["a.jsonl", "b.jsonl:2"]
    assert cfg.engine.zero_stage == 3
    assert cfg.run.seed == 1234  # untouched default


def test_config_file_fills_flags_and_command_line_wins(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 0.5\nmax-seq-len: 64\nrun:\n  seed: 7\n", encoding="utf-8")
    cfg = capture(["--config", str(path), "--learning-rate", "0.25"])
    assert cfg.optim.learning_rate == 0.25  # command line beats the file
    assert cfg.data.max_seq_len == 64 and cfg.run.seed == 7
    js = tmp_path / "c.json"
    js.write_text(json.dumps({"bogus_flag": 1}), encoding="utf-8")
    with pytest.raises(UserError, match="unknown option.*--bogus-flag"):
        capture(["--config", str(js)])


def test_config_file_types_are_checked():
    with pytest.raises(UserError, match="--max-seq-len expects int"):
        build_config(SFTConfig, {"max_seq_len": "lots"})
    with pytest.raises(UserError, match="--dtype must be one of"):
        build_config(SFTConfig, {"dtype": "fp8"})


def test_flag_names_are_unique():
    names = [s.name for s in flag_specs(SFTConfig)]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("args,needle", [
    (["--data", "/nonexistent/file.jsonl"], "/nonexistent/file.jsonl: file not found"),
    (["--model", "chinese-llama-2-7b"], "hfl/chinese-llama-2-7b"),
    (["--model", "./no/such/folder"], "model folder not found"),
    (["--data-split", "1,2"], "--data-split '1,2'"),
])
def test_user_errors_are_one_line_exit_2(tmp_path, args, needle):
    proc = run_cli("train", "--step", "1", "--output-dir", str(tmp_path / "o"), *args, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("dschat: error:")]
    assert len(lines) == 1 and needle in lines[0], proc.stderr


def test_plan_steps_counts_accumulation_windows_across_epochs():
    from dschat.config import OptimArgs
    from dschat.errors import UserError
    from dschat.training.stage import plan_steps

    # 10 micro-batches per epoch, 4 per optimizer step: windows run on over the epoch boundary
    assert plan_steps(10, OptimArgs(gradient_accumulation_steps=4, num_train_epochs=1)) == (2, 1)
    assert plan_steps(10, OptimArgs(gradient_accumulation_steps=4, num_train_epochs=2)) == (5, 2)
    # --max-steps 3 needs 12 micro-batches: two epochs, not one
    assert plan_steps(10, OptimArgs(gradient_accumulation_steps=4, max_steps=3)) == (3, 2)
    assert plan_steps(10, OptimArgs(max_steps=25)) == (25, 3)
    with pytest.raises(UserError, match="no optimizer step"):
        plan_steps(3, OptimArgs(gradient_accumulation_steps=4))


def test_per_model_flags_come_from_one_prefixed_declaration():
    from dschat.config import LoraArgs
    from dschat.rlhf.config import RLHFConfig

    specs = {s.name: s for s in flag_specs(RLHFConfig)}
    lora = {f"actor_{n}" for n in LoraArgs.__dataclass_fields__} - {"actor_save_adapter"}
    assert lora <= set(specs) and {n.replace("actor", "critic") for n in lora} <= set(specs)
    assert specs["actor_lora_dim"].help.startswith("Actor: LoRA rank")
    cfg = build_config(RLHFConfig, {"model": "m", "actor_lora_dim": 4, "critic_lora_alpha": 8, "save_adapter": True,
                                    "per_device_training_batch_size": 3, "actor_learning_rate": 1e-5,
                                    "critic_weight_decay": 0.1, "critic_zero_stage": 3, "offload": True})
    assert cfg.actor.model == "m"  # --model is the actor's, as in the other stages
    assert cfg.lora_of("actor") == LoraArgs(lora_dim=4, save_adapter=True)
    assert cfg.lora_of("critic").lora_alpha == 8 and cfg.lora_of("critic").lora_dim == 0
    actor, critic = cfg.optim_of("actor"), cfg.optim_of("critic")
    assert actor.learning_rate == 1e-5 and actor.weight_decay == 0.0 and critic.weight_decay == 0.1
    # the shared schedule: one batch-size flag (old spelling kept), stage 3's own warmup default (none)
    assert actor.per_device_train_batch_size == critic.per_device_train_batch_size == 3
    assert actor.warmup_ratio == critic.warmup_ratio == 0.0 and build_config(SFTConfig, {}).optim.warmup_ratio == 0.05
    assert cfg.engine_of("critic").zero_stage == 3 and cfg.engine_of("actor").zero_stage == 0
    assert cfg.engine_of("actor").offload and cfg.engine_of("critic").offload


@pytest.mark.parametrize("values,needle", [
    ({"algo": "grpo", "kl_ctl": 0.2}, "--kl-ctl has no effect with --algo grpo"),
    ({"algo": "grpo", "critic_lora_dim": 8}, "--critic-lora-dim has no effect with --algo grpo"),
    ({"algo": "grpo", "missing_eos_penalty": 1.0}, "--missing-eos-penalty has no effect with --algo grpo"),
    ({"algo": "ppo", "loss_type": "dapo"}, "--loss-type has no effect with --algo ppo"),
    ({"num_generations": 8}, "--num-generations has no effect with --algo ppo"),
    ({"actor_lora_alpha": 8.0}, "--actor-lora-alpha has no effect without --actor-lora-dim > 0"),
    ({"judge_max_new_tokens": 8}, "--judge-max-new-tokens has no effect without the reward source 'judge'"),
    ({"ema_decay": 0.9}, "--ema-decay has no effect without --enable-ema"),
    ({"packing": True}, "--packing has no effect with --algo ppo"),
    ({"algo": "grpo", "group_by_length": True}, "--group-by-length has no effect with --algo grpo"),
    ({"algo": "dpo", "packing": True, "group_by_length": True}, "--group-by-length has no effect with --packing"),
])
def test_flags_without_effect_in_the_chosen_mode_are_refused(values, needle):
    from dschat.config import refuse_inert
    from dschat.rlhf.config import RLHFConfig

    cfg = build_config(RLHFConfig, values)
    with pytest.raises(UserError, match=needle):
        refuse_inert(cfg, set(values))
    refuse_inert(cfg, {"algo"})  # the same values as defaults (not given) pass


def test_given_flags_that_do_act_pass():
    from dschat.config import refuse_inert
    from dschat.rlhf.config import RLHFConfig

    for values in ({"algo": "grpo", "beta": 0.0, "loss_type": "dapo", "overlong_buffer": 4},
                   {"kl_ctl": 0.2, "critic_lora_dim": 8, "critic_lora_alpha": 4.0, "reward_model": "r"},
                   {"algo": "grpo", "reward_funcs": ["judge"], "judge_model": "j", "judge_max_new_tokens": 3},
                   {"enable_ema": True, "ema_decay": 0.9}, {"algo": "dpo", "packing": True},
                   {"algo": "dpo", "group_by_length": True}):
        refuse_inert(build_config(RLHFConfig, values), set(values))
    with pytest.raises(UserError, match="--lora-alpha has no effect without --lora-dim > 0"):
        refuse_inert(build_config(SFTConfig, {"lora_alpha": 4.0}), {"lora_alpha"})
    refuse_inert(build_config(SFTConfig, {"lora_alpha": 4.0, "lora_dim": 2}), {"lora_alpha", "lora_dim"})
    for given in ({"packing": True}, {"group_by_length": True}):
        refuse_inert(build_config(SFTConfig, given), set(given))
    with pytest.raises(UserError, match="--group-by-length has no effect with --packing"):
        both = {"packing": True, "group_by_length": True}
        refuse_inert(build_config(SFTConfig, both), set(both))


@pytest.mark.parametrize("values,needle", [
    ({"per_device_train_batch_size": 0}, "--per-device-train-batch-size must be >= 1, got 0"),
    ({"learning_rate": -1}, "--learning-rate must be > 0, got -1"),
    ({"max_seq_len": 0}, "--max-seq-len must be >= 2, got 0"),
    ({"warmup_ratio": float("nan")}, "--warmup-ratio must be a finite number"),
])
def test_out_of_range_values_stop_before_anything_loads(values, needle):
    with pytest.raises(UserError, match=needle):
        build_config(SFTConfig, values)


@pytest.mark.parametrize("args,needle", [
    (["--algo", "grpo", "--kl-ctl", "0.2"], "--kl-ctl has no effect with --algo grpo"),
    (["--algo", "ppo", "--loss-type", "dapo"], "--loss-type has no effect with --algo ppo"),
    (["--max-answer-seq-len", "0"], "--max-answer-seq-len must be >= 1"),
])
def test_stage3_refuses_in_seconds_with_one_line(tmp_path, args, needle):
    proc = run_cli("train", "--step", "3", "--actor-model", "tiny", "--output-dir", str(tmp_path / "o"), *args,
                   timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("dschat: error:")]
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert not (tmp_path / "o").exists()  # stopped before the output folder was made


def test_config_file_mapping_outside_a_section_names_the_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("a:\n  b: 1\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"c.yaml: 'a' holds a mapping, but only a section \(.*optim.*\) may"):
        capture(["--config", str(path)])
    path.write_text("optim:\n  learning_rate:\n    x: 1\n", encoding="utf-8")
    with pytest.raises(UserError, match="'optim.learning_rate' holds a mapping"):
        capture(["--config", str(path)])


def test_a_refused_choice_names_the_flag_that_takes_it(tmp_path):
    """Each algorithm declares its own loss flag: ``--algo dpo --loss-type ipo`` (GRPO's flag) is refused with a
    line that names DPO's ``--dpo-loss-type``, exit code 2, before anything loads."""
    proc = run_cli("train", "--step", "3", "--algo", "dpo", "--actor-model", "tiny", "--output-dir",
                   str(tmp_path / "o"), "--loss-type", "ipo", timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "'ipo' is not one of 'grpo', 'dr_grpo', 'dapo', 'gspo'; --dpo-loss-type takes 'ipo'" in proc.stderr
    proc = run_cli("train", "--step", "3", "--algo", "dpo", "--actor-model", "tiny", "--output-dir",
                   str(tmp_path / "o"), "--loss-type", "nonsense", timeout=120)
    assert proc.returncode == 2 and "takes" not in proc.stderr  # no flag takes it: the plain refusal
