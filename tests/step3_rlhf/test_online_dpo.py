"""Stage 3 with --algo online_dpo: the policy samples, a reward source picks best vs worst, DPO learns.

The pairing rule (ties, all-equal groups, padded answers) is tested by hand in tests/dschat/test_losses.py; here:
the pairs' log-probs ignore padding, the held-out pairs are offline DPO's, a short run trains and logs what it
should (pairs, ties, implicit rewards, KL, sampled reward before/after), and the flags are checked.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from dschat.config import DataArgs, build_config, refuse_inert
from dschat.data import load_phase
from dschat.data.phases import pairs_of
from dschat.demo import demo_files
from dschat.errors import UserError
from dschat.models.loading import load_tokenizer, resolve_model
from dschat.rlhf.config import RLHFConfig, check_config
from dschat.rlhf.online_dpo import rollout_logps
from dschat.rlhf.rollout import make_rollout
from tests.helpers import fraction_changed, read_json, read_jsonl
from tests.helpers import run_stage as run


class ConstantLM(torch.nn.Module):
    """Every position predicts token k with probability (k + 1) / 10 (vocabulary of 4)."""

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
        return SimpleNamespace(logits=probs.log().expand(*input_ids.shape, 4))


def test_pair_logps_sum_answer_tokens_only():
    # Prompts left-padded to 2 columns (pad 0), answers of 4 columns; EOS is 2.
    #   row 0: answer 3, 1, EOS, then padding -> log .4 + log .2 + log .3, 3 tokens (the pad after EOS is out)
    #   row 1: answer 1, 1, 1, 3, no EOS       -> 3 log .2 + log .4, 4 tokens
    prompt = torch.tensor([[0, 1], [1, 3]])
    prompt_mask = torch.tensor([[0, 1], [1, 1]])
    sequences = torch.tensor([[0, 1, 3, 1, 2, 3], [1, 3, 1, 1, 1, 3]])  # row 0's last token is after its EOS
    rollout, dropped = make_rollout(prompt, prompt_mask, sequences, eos_token_id=2, pad_token_id=0)
    assert dropped == 0 and rollout.sequences[0, -1].item() == 0  # masked to pad after the EOS
    logps, lengths = rollout_logps(ConstantLM(), rollout)
    want = [math.log(0.4) + math.log(0.2) + math.log(0.3), 3 * math.log(0.2) + math.log(0.4)]
    torch.testing.assert_close(logps, torch.tensor(want), atol=1e-6, rtol=0)
    assert lengths.tolist() == [3, 4]


def test_held_out_pairs_are_offline_dpos():
    # Online DPO trains on the prompts of the phase-3 part and evaluates on the pairs behind its held-out rows:
    # exactly the rows offline DPO (the same part tokenized as pairs) evaluates on.
    tok = load_tokenizer(resolve_model("tiny"))
    data = DataArgs(data=[str(demo_files()["pairwise"])], data_split="18,1,1", eval_fraction=0.2,
                    max_eval_rows=12)
    prompts = load_phase(data, 3, tok, seed=3, use_cache=False, log=lambda _: None)
    pairs = load_phase(data, 3, tok, seed=3, use_cache=False, log=lambda _: None, tokenize_as=2)
    assert pairs_of(prompts.eval, tok, data) == pairs.eval and len(pairs.eval) == 12
    only_prompts = DataArgs(data=[str(demo_files()["prompts"])], data_split="0,0,1", max_eval_rows=4)
    assert pairs_of(load_phase(only_prompts, 3, tok, 3, use_cache=False, log=lambda _: None).eval, tok,
                    only_prompts) == []


def online_cfg(out, reward, **kw):
    base = {"algo": "online_dpo", "actor_model": "tiny", "data": [str(demo_files()["pairwise"])],
            "output_dir": str(out), "data_split": "18,1,1", "reward_funcs": [reward], "max_steps": 3,
            "num_generations": 4, "per_device_generation_batch_size": 4, "per_device_train_batch_size": 2,
            "max_answer_seq_len": 12, "actor_learning_rate": 1e-3, "max_eval_rows": 8,
            "per_device_eval_batch_size": 8, "progress": False, "force": True}
    base.update(kw)
    return build_config(RLHFConfig, base)


def test_online_dpo_short_run(tmp_path):
    # A coarse reward (distinct characters mod 3) so that some groups tie.
    (tmp_path / "coarse.py").write_text("def reward(prompts, completions, **fields):\n"
                                        "    return [float(len(set(c)) % 3) for c in completions]\n")
    out = tmp_path / "run"
    metrics = run(online_cfg(out, f"{tmp_path / 'coarse.py'}:reward"))
    assert metrics["algo"] == "online_dpo" and metrics["steps"] == 3 and metrics["loss_type"] == "sigmoid"
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "train/reward" in r]
    assert len(rows) == 3
    for key in ("train/pairs", "train/tie_groups", "train/unpaired_groups", "train/reward_std",
                "train/rewards_chosen", "train/rewards_rejected", "train/implicit_margin", "train/implicit_accuracy",
                "train/kl", "train/actor_loss", "time/generation_s"):
        assert all(key in r for r in rows if r["train/pairs"] > 0), key
    for r in rows:  # each group gives a pair, a tie or nothing: 4 prompts per step
        assert r["train/pairs"] + r["train/tie_groups"] + r["train/unpaired_groups"] == 4
        if r["train/pairs"]:  # the chosen sample of a pair always out-scored its rejected one
            assert r["train/reward_chosen_sample"] > r["train/reward_rejected_sample"]
    ev = read_json(out / "eval.json")
    for key in ("pairs", "tie_groups", "unpaired_groups"):  # run totals = the sum of the steps
        assert ev[key] == sum(r[f"train/{key}"] for r in rows), key
    assert ev["pairs"] > 0
    # Sampled reward before/after with its paired s.e., as the sampling algorithms report it ...
    assert ev["eval_prompts"] == 8 and ev["reward_gain_se"] is not None and ev["kl_after"] is not None
    # ... and offline DPO's implicit-reward metrics on the held-out pairs (the actor starts as the reference).
    assert ev["eval_pairs_after"] == 8 and ev["implicit_accuracy_before"] == pytest.approx(0.5)
    assert ev["logratio_before"] == pytest.approx(0.0, abs=1e-4) and ev["logratio_after"] != 0.0
    # Held-out sampled pairs (the initial policy's answers, best vs worst by the reward): the same pairs before and
    # after, every tie counted half before training (policy == reference), and a measured share after.
    assert ev["sampled_pairs_before"] == ev["sampled_pairs_after"] > 0
    assert ev["sampled_implicit_accuracy_before"] == 0.5
    assert 0.0 <= ev["sampled_implicit_accuracy_after"] <= 1.0
    # On-policy pairs (the evaluated policy's own answers, same seeds): before training the policy is the initial
    # one, so they are the same pairs, all ties; after, pairs of the trained policy's answers.
    assert ev["onpolicy_pairs_before"] == ev["sampled_pairs_before"] and ev["onpolicy_implicit_accuracy_before"] == 0.5
    assert ev["onpolicy_pairs_after"] > 0 and 0.0 <= ev["onpolicy_implicit_accuracy_after"] <= 1.0
    assert fraction_changed(out) > 0.5


def test_online_dpo_flags_checked_and_refused():
    def cfg(**kw):
        return build_config(RLHFConfig, {"algo": "online_dpo", "actor_model": "tiny", **kw})

    for flag, value in (("kl_ctl", 0.2), ("beta", 0.1), ("loss_type", "dapo"), ("scale_rewards", "none"),
                        ("num_iterations", 2), ("critic_model", "tiny"), ("label_smoothing", 0.1)):
        with pytest.raises(UserError, match="has no effect"):
            refuse_inert(cfg(**{flag: value}), {flag})
    refuse_inert(cfg(num_generations=8, dpo_beta=0.2, temperature=0.7, min_answer_len=3),
                 {"algo", "num_generations", "dpo_beta", "temperature", "min_answer_len"})
    refuse_inert(cfg(dpo_loss_type="cdpo", label_smoothing=0.1), {"dpo_loss_type", "label_smoothing"})
    with pytest.raises(UserError, match="has no effect"):
        refuse_inert(cfg(dpo_loss_type="simpo", reference_zero_stage=3), {"reference_zero_stage"})
    with pytest.raises(UserError, match="label-smoothing > 0"):
        check_config(cfg(dpo_loss_type="cdpo"))
    with pytest.raises(UserError, match="needs --reward-model"):
        check_config(cfg(reward_funcs=["rm"]))
    assert cfg().reward_func_names() == ["format", "accuracy"]
    assert cfg(reward_model="x").reward_func_names() == ["rm"]
    assert cfg().algorithm.needs(cfg()) == {"reference"}
    assert cfg(dpo_loss_type="simpo").algorithm.needs(cfg(dpo_loss_type="simpo")) == set()
