"""Flags are declared once (dataclasses) and reach the stage through the CLI and --config files."""

import json

import pytest

from dschat.cli import stage_command
from dschat.config import build_config, flag_specs
from dschat.errors import UserError
from step1_sft.main import SFTConfig
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
    from dschat.stage import plan_steps

    # 10 micro-batches per epoch, 4 per optimizer step: windows run on over the epoch boundary
    assert plan_steps(10, OptimArgs(gradient_accumulation_steps=4, num_train_epochs=1)) == (2, 1)
    assert plan_steps(10, OptimArgs(gradient_accumulation_steps=4, num_train_epochs=2)) == (5, 2)
    # --max-steps 3 needs 12 micro-batches: two epochs, not one
    assert plan_steps(10, OptimArgs(gradient_accumulation_steps=4, max_steps=3)) == (3, 2)
    assert plan_steps(10, OptimArgs(max_steps=25)) == (25, 3)
    with pytest.raises(UserError, match="no optimizer step"):
        plan_steps(3, OptimArgs(gradient_accumulation_steps=4))
