"""Stage 3 with --algo dpo: offline DPO on the tiny preset and the demo's pairs.

The loss formulas (sigmoid, cdpo, ipo, simpo) are unit-tested by hand in tests/dschat/test_losses.py; here: the
loop trains on the phase-3 pairs (loss falls, implicit-reward accuracy rises, parameters move), the reference's
log-probs are computed once, simpo loads no reference, and DPO's flags are refused where they do nothing.
"""

import math

import pytest

from dschat.config import build_config, refuse_inert
from dschat.demo import demo_files
from dschat.errors import UserError
from dschat.rlhf.config import RLHFConfig, check_config
from tests.helpers import fraction_changed as _moved
from tests.helpers import read_json, read_jsonl
from tests.helpers import run_stage as run


def dpo_cfg(out, **kw):
    base = {"algo": "dpo", "actor_model": "tiny", "data": [str(demo_files()["pairwise"])], "output_dir": str(out),
            "data_split": "18,1,1", "max_steps": 6, "per_device_generation_batch_size": 8,
            "per_device_training_batch_size": 4,
            "actor_learning_rate": 1e-3, "max_eval_rows": 16, "per_device_eval_batch_size": 16, "progress": False,
            "force": True}
    base.update(kw)
    return build_config(RLHFConfig, base)


@pytest.mark.parametrize("loss_type", ["sigmoid", pytest.param("simpo", marks=pytest.mark.slow)])
def test_dpo_short_run_learns_the_pairs(tmp_path, capsys, loss_type):
    out = tmp_path / loss_type
    metrics = run(dpo_cfg(out, dpo_loss_type=loss_type))
    assert metrics["algo"] == "dpo" and metrics["steps"] == 6 and metrics["loss_type"] == loss_type
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "train/actor_loss" in r]
    assert len(rows) == 6
    for key in ("train/rewards_chosen", "train/rewards_rejected", "train/implicit_margin", "train/implicit_accuracy",
                "train/logps_chosen", "train/logps_rejected", "time/pairs_per_s"):
        assert key in rows[0], key
    assert ("train/logratio" in rows[0]) == (loss_type != "simpo")  # simpo has no reference
    first, last = rows[0], rows[-1]
    assert last["train/actor_loss"] < first["train/actor_loss"] or \
        last["train/implicit_accuracy"] > first["train/implicit_accuracy"]
    assert _moved(out) > 0.5
    ev = read_json(out / "eval.json")
    assert ev["eval_pairs_after"] > 0 and ev["reward_before"] is None  # no reward source: nothing sampled
    if loss_type == "sigmoid":
        # The actor starts as the reference: every implicit reward is 0 (ties), accuracy 1/2.
        assert ev["implicit_accuracy_before"] == pytest.approx(0.5)
        assert ev["logratio_before"] == pytest.approx(0.0, abs=1e-4)
        assert ev["implicit_margin_after"] > ev["implicit_margin_before"]
        assert capsys.readouterr().out.count("reference log-probs of") == 1  # once, not per step
    assert (out / "actor").is_dir()


def test_dpo_with_packed_pairs_learns(tmp_path):
    """--packing: updates of 4 packed sequences (several pairs each) in micro-batches of 2; evaluation unpacked."""
    out = tmp_path / "packed"
    metrics = run(dpo_cfg(out, packing=True, max_steps=4, per_device_generation_batch_size=4,
                          per_device_training_batch_size=2))
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "train/actor_loss" in r]
    assert len(rows) == 4 and all(math.isfinite(r["train/actor_loss"]) for r in rows)
    assert _moved(out) > 0.5
    assert metrics["implicit_margin_after"] > metrics["implicit_margin_before"]


def test_dpo_flags_checked_and_refused():
    def cfg(**kw):
        return build_config(RLHFConfig, {"algo": "dpo", "actor_model": "tiny", **kw})

    for flag, value in (("kl_ctl", 0.2), ("num_generations", 4), ("loss_type", "dapo"), ("beta", 0.1),
                        ("label_smoothing", 0.1), ("simpo_gamma", 1.0), ("temperature", 0.7),
                        ("critic_model", "tiny"), ("min_answer_len", 3)):
        with pytest.raises(UserError, match="has no effect"):
            refuse_inert(cfg(**{flag: value}), {flag})
    refuse_inert(cfg(dpo_loss_type="cdpo", label_smoothing=0.1), {"algo", "dpo_loss_type", "label_smoothing"})
    refuse_inert(cfg(dpo_loss_type="simpo", simpo_gamma=1.0), {"dpo_loss_type", "simpo_gamma"})
    refuse_inert(cfg(reward_funcs=["format"], temperature=0.7), {"reward_funcs", "temperature"})
    with pytest.raises(UserError, match="has no effect"):
        refuse_inert(cfg(dpo_loss_type="simpo", offload_reference_model=True), {"offload_reference_model"})
    with pytest.raises(UserError, match="has no effect"):  # DPO's flags under GRPO
        refuse_inert(build_config(RLHFConfig, {"algo": "grpo", "dpo_beta": 0.2}), {"dpo_beta"})
    with pytest.raises(UserError, match="label-smoothing > 0"):
        check_config(cfg(dpo_loss_type="cdpo"))
    with pytest.raises(UserError, match=r"\[0, 0.5\)"):
        check_config(cfg(dpo_loss_type="cdpo", label_smoothing=0.5))
    assert cfg().dpo.beta == 0.1 and cfg(dpo_loss_type="simpo").dpo.beta == 2.0
    assert cfg().algorithm.needs(cfg()) == {"reference"}
    assert cfg(dpo_loss_type="simpo").algorithm.needs(cfg(dpo_loss_type="simpo")) == set()
