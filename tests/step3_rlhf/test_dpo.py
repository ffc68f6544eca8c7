"""Stage 3 with --algo dpo: offline DPO on the tiny preset and the demo's pairs.

The loss formulas (sigmoid, cdpo, ipo, simpo) are unit-tested by hand in tests/dschat/test_losses.py; here: the
loop trains on the phase-3 pairs (loss falls, implicit-reward accuracy rises, parameters move), the reference's
log-probs are computed once, simpo loads no reference, and DPO's flags are refused where they do nothing.
"""

import math
from pathlib import Path

import pytest
import torch

from dschat.config import build_config, refuse_inert
from dschat.demo import demo_files
from dschat.errors import UserError
from dschat.rlhf.config import RLHFConfig, check_config
from tests.helpers import fraction_changed as _moved
from tests.helpers import read_json, read_jsonl
from tests.helpers import run_stage as run


def test_ipo_reports_rewards_on_summed_log_ratios_as_trl():
    """IPO's loss takes length-averaged log-ratios (the paper's), its reported rewards, accuracy and margin the
    summed ones (TRL's, the same as the other DPO losses report), so they can disagree by design."""
    from dschat.rlhf.dpo import DPOArgs, pair_loss

    # one pair: chosen log-ratio -8 - (-10) = +2 over 10 tokens (mean 0.2), rejected -3 - (-4) = +1 over 2 (0.5)
    logps, ref, lengths = torch.tensor([-8.0, -3.0]), torch.tensor([-10.0, -4.0]), torch.tensor([10, 2])
    out = pair_loss(DPOArgs(dpo_loss_type="ipo", dpo_beta=0.1), logps, lengths, ref)
    # loss on the means: h = 0.2 - 0.5 = -0.3; (h - 1 / (2 * 0.1))^2 = (-5.3)^2 = 28.09
    assert out.loss.item() == pytest.approx(28.09, abs=1e-5)
    # rewards on the sums: 0.1 * 2 = 0.2 and 0.1 * 1 = 0.1, accuracy 1 (on the means it would be 0), margin 0.1
    assert out.chosen_rewards.tolist() == pytest.approx([0.2]) and out.rejected_rewards.tolist() == pytest.approx([0.1])
    assert out.reward_accuracy.item() == 1.0 and out.reward_margin.item() == pytest.approx(0.1)


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / "model.safetensors"))


def dpo_cfg(out, **kw):
    base = {"algo": "dpo", "actor_model": "tiny", "data": [str(demo_files()["pairwise"])], "output_dir": str(out),
            "data_split": "18,1,1", "max_steps": 6, "per_device_training_batch_size": 4,
            "gradient_accumulation_steps": 2,
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
    metrics = run(dpo_cfg(out, packing=True, max_steps=4, per_device_training_batch_size=2))
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "train/actor_loss" in r]
    assert len(rows) == 4 and all(math.isfinite(r["train/actor_loss"]) for r in rows)
    assert _moved(out) > 0.5
    assert metrics["implicit_margin_after"] > metrics["implicit_margin_before"]


def test_dpo_flags_checked_and_refused():
    def cfg(**kw):
        return build_config(RLHFConfig, {"algo": "dpo", "actor_model": "tiny", **kw})

    for flag, value in (("kl_ctl", 0.2), ("num_generations", 4), ("loss_type", "dapo"), ("beta", 0.1),
                        ("label_smoothing", 0.1), ("simpo_gamma", 1.0), ("temperature", 0.7),
                        ("critic_model", "tiny"), ("min_answer_len", 3), ("eval_samples", 4)):
        with pytest.raises(UserError, match="has no effect"):
            refuse_inert(cfg(**{flag: value}), {flag})
    refuse_inert(cfg(dpo_loss_type="cdpo", label_smoothing=0.1), {"algo", "dpo_loss_type", "label_smoothing"})
    refuse_inert(cfg(dpo_loss_type="simpo", simpo_gamma=1.0), {"dpo_loss_type", "simpo_gamma"})
    refuse_inert(cfg(reward_funcs=["format"], temperature=0.7), {"reward_funcs", "temperature"})
    refuse_inert(cfg(reward_funcs=["format"], eval_samples=4), {"reward_funcs", "eval_samples"})
    with pytest.raises(UserError, match="has no effect"):
        refuse_inert(cfg(dpo_loss_type="simpo", offload_reference_model=True), {"offload_reference_model"})
    with pytest.raises(UserError, match="has no effect"):  # DPO's flags under GRPO
        refuse_inert(build_config(RLHFConfig, {"algo": "grpo", "dpo_beta": 0.2}), {"dpo_beta"})
    # pairs per update as TRL counts them: train batch x accumulation (the sampling flag does nothing here)
    with pytest.raises(UserError, match="--per-device-generation-batch-size has no effect with --algo dpo .an "
                                        "update takes --per-device-train-batch-size x --gradient-accumulation-steps"):
        refuse_inert(cfg(per_device_generation_batch_size=8), {"per_device_generation_batch_size"})
    from dschat.rlhf.dpo import DPO

    c = cfg(per_device_train_batch_size=4, gradient_accumulation_steps=3)
    assert DPO.batch_size(c) == 12 and DPO.plan(c, 10) == (10, 3)  # 12 pairs, 3 micro-batches, 1 optimizer step
    with pytest.raises(UserError, match="label-smoothing > 0"):
        check_config(cfg(dpo_loss_type="cdpo"))
    with pytest.raises(UserError, match=r"\[0, 0.5\)"):
        check_config(cfg(dpo_loss_type="cdpo", label_smoothing=0.5))
    assert cfg().dpo.beta == 0.1 and cfg(dpo_loss_type="simpo").dpo.beta == 2.0
    assert cfg().algorithm.needs(cfg()) == {"reference"}
    assert cfg(dpo_loss_type="simpo").algorithm.needs(cfg(dpo_loss_type="simpo")) == set()


def test_rpo_alpha_adds_the_chosen_per_token_nll():
    from dschat.rlhf.dpo import DPOArgs, pair_loss

    # Two pairs, policy == reference: the sigmoid DPO loss is log 2. Chosen answers: -6 over 3 tokens and -2 over
    # 4 tokens, NLL per token over the batch (TRL's) (6 + 2) / 7 = 8 / 7 (the mean of per-answer means would be
    # 1.25); alpha 0.4 adds 0.4 * 8 / 7. The rejected answers do not enter it.
    logps = torch.tensor([-6.0, -2.0, -1.0, -9.0])
    lengths = torch.tensor([3, 4, 1, 2])
    plain = pair_loss(DPOArgs(), logps, lengths, logps.clone())
    rpo = pair_loss(DPOArgs(rpo_alpha=0.4), logps, lengths, logps.clone())
    assert plain.loss.item() == pytest.approx(math.log(2), abs=1e-6)
    assert rpo.loss.item() == pytest.approx(math.log(2) + 0.4 * 8 / 7, abs=1e-6)
    assert torch.equal(rpo.chosen_rewards, plain.chosen_rewards)  # the implicit rewards are DPO's
    simpo = pair_loss(DPOArgs(dpo_loss_type="simpo", simpo_gamma=0.0, rpo_alpha=1.0), logps, lengths, None)
    # simpo, beta 2: avg c = -2, -0.5; avg x = -1, -4.5 -> -logsigmoid(2 * (-1)) and -logsigmoid(2 * 4)
    want = (math.log1p(math.exp(2.0)) + math.log1p(math.exp(-8.0))) / 2 + 8 / 7
    assert simpo.loss.item() == pytest.approx(want, abs=1e-5)


def test_dpo_with_actor_lora_trains_only_the_adapters(tmp_path):
    from transformers import AutoModelForCausalLM

    from dschat.models.loading import resolve_model

    out = tmp_path / "lora"
    metrics = run(dpo_cfg(out, max_steps=3, actor_lora_dim=4, actor_lora_learning_rate=1e-2,
                          actor_lora_module_name="q_proj,v_proj", save_adapter=True))
    assert metrics["steps"] == 3
    # The reference is the frozen base, so the implicit margin moves only through the adapters.
    assert metrics["implicit_margin_after"] != pytest.approx(metrics["implicit_margin_before"], abs=1e-6)
    start = _weights(resolve_model("tiny"))
    actor = AutoModelForCausalLM.from_pretrained(out / "actor")  # merged: plain transformers, no peft
    merged = {k: v for k, v in actor.state_dict().items() if k in start}
    moved = [k for k in start if not torch.equal(start[k], merged[k])]
    assert moved and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in moved)
    assert (out / "actor" / "adapter" / "adapter_config.json").exists()


@pytest.mark.parametrize("algo", ["dpo", pytest.param("online_dpo", marks=pytest.mark.slow)])
def test_dpo_ctrl_c_then_resume_matches_uninterrupted_run(tmp_path, monkeypatch, algo, ctrl_c):
    # A resumed DPO run recomputes the reference's log-probs of the pairs (they are not saved) and continues at the
    # next pair batch; online DPO also restores the sampling RNG and its pair/tie totals.
    import os
    import signal

    from dschat.rlhf.algorithms import ALGORITHMS
    from dschat.training.stage import Interrupted
    from tests.helpers import losses

    Algo = ALGORITHMS[algo].load()  # the run-time class, whose step the run calls
    kw = {"max_steps": 4, "algo": algo}
    if algo == "online_dpo":
        (tmp_path / "r.py").write_text("def reward(prompts, completions, **fields):\n"
                                       "    return [float(len(set(c)) % 3) for c in completions]\n")
        kw.update(reward_funcs=[f"{tmp_path / 'r.py'}:reward"], num_generations=2, max_answer_seq_len=8,
                  per_device_generation_batch_size=4, max_eval_rows=4)
    ref = tmp_path / "ref"
    run(dpo_cfg(ref, **kw))
    real_step = Algo.step
    calls = {"n": 0}

    def interrupted_step(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGINT)  # arrives during step 2, which still runs to its end
        return real_step(*args, **kwargs)

    out = tmp_path / "int"
    monkeypatch.setattr(Algo, "step", interrupted_step)
    with pytest.raises(Interrupted, match="interrupted: saved .*step-00000002"):
        run(dpo_cfg(out, **kw))
    monkeypatch.setattr(Algo, "step", real_step)
    run(dpo_cfg(out, **kw, force=False, resume=True))
    for key in ("train/actor_loss", "train/implicit_margin"):
        want, got = losses(ref, key), losses(out, key)
        assert sorted(got) == sorted(want) == [1, 2, 3, 4], key
        for step in want:
            assert got[step] == pytest.approx(want[step], rel=1e-4, abs=1e-6), (key, step)
    a, b = read_json(ref / "eval.json"), read_json(out / "eval.json")
    assert b["implicit_accuracy_before"] == a["implicit_accuracy_before"]  # kept in the state, not recomputed
    assert b["implicit_margin_after"] == pytest.approx(a["implicit_margin_after"], rel=1e-4, abs=1e-6)
    if algo == "online_dpo":
        assert (b["pairs"], b["tie_groups"]) == (a["pairs"], a["tie_groups"])
    wa, wb = _weights(ref / "actor"), _weights(out / "actor")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_dpo_two_ranks_actor_zero3_under_launcher(tmp_path):
    # Two CPU ranks under the deepspeed launcher, actor and reference at ZeRO-3: the reference log-probs of every
    # pair are computed on all ranks (collective forwards), each rank trains on its own pairs.
    from tests.helpers import assert_cuda_only_world, cuda_only_world, run_cli

    out = tmp_path / "dist"
    proc = run_cli("train", "--step", "3", "--num-gpus", "2", "--algo", "dpo", "--actor-model", "tiny",
                   "--data", str(demo_files()["pairwise"]), "--data-split", "18,1,1", "--actor-zero-stage", "3",
                   "--output-dir", str(out), "--max-steps", "3", "--gradient-accumulation-steps", "2",
                   "--per-device-train-batch-size", "2", "--actor-learning-rate", "1e-3", "--max-eval-rows", "8",
                   "--no-progress", timeout=900, env=cuda_only_world(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_cuda_only_world(tmp_path)  # dschat's collectives ran on a world group with no CPU backend, as NCCL
    assert read_json(out / "args.json")["world_size"] == 2
    ev = read_json(out / "eval.json")
    assert ev["steps"] == 3 and ev["eval_pairs_after"] == 8  # both ranks' shards, gathered
    assert ev["implicit_accuracy_before"] == pytest.approx(0.5) and ev["implicit_margin_after"] != 0.0
    assert _moved(out) > 0.5  # the saved actor (gathered from ZeRO-3 shards) is the trained one
