"""Stage 3 with the critic-free estimators (--algo rloo | reinforce_pp | reinforce_pp_baseline | remax) on the tiny
preset: each runs two steps, trains the actor and loads no critic; each refuses exactly the flags it does not read.

The estimators are unit-tested against hand-worked numbers in tests/dschat/test_losses.py.
"""

import pytest

from dschat.config import build_config, refuse_inert
from dschat.errors import UserError
from dschat.rlhf.algorithms import ALGORITHMS
from dschat.rlhf.config import RLHFConfig, check_config
from tests.helpers import read_json, read_jsonl
from tests.helpers import run_stage as run
from tests.step3_rlhf.test_grpo import _moved, grpo_cfg, reward_file  # noqa: F401 (a fixture)

CRITIC_FREE = ("rloo", "reinforce_pp", "reinforce_pp_baseline", "remax")


def _given(algo: str, **values):
    refuse_inert(build_config(RLHFConfig, {"algo": algo, **values}), set(values))


@pytest.mark.parametrize(("algo", "reads", "refused"), [
    ("rloo", {"num_generations": 3, "beta": 0.0, "loss_type": "dapo", "epsilon_high": 0.3, "num_iterations": 2,
              "dynamic_sampling": True, "max_resample_rounds": 1, "kl_estimator": "k1"},
     ["scale_rewards", "kl_ctl", "gamma", "critic_model"]),
    ("reinforce_pp", {"num_generations": 3, "kl_ctl": 0.05, "gamma": 0.9, "clip_reward_value": 2.0, "epsilon": 0.1,
                      "mask_truncated_completions": True},
     ["beta", "kl_estimator", "loss_type", "scale_rewards", "dynamic_sampling", "lam", "cliprange", "ppo_epochs",
      "critic_model"]),
    ("reinforce_pp_baseline", {"kl_ctl": 0.0, "gamma": 0.9, "num_iterations": 2},
     ["beta", "loss_type", "whiten_advantages"]),
    ("remax", {"num_generations": 2, "beta": 0.0, "loss_type": "dr_grpo", "overlong_penalty": True},
     ["scale_rewards", "dynamic_sampling", "max_resample_rounds", "kl_ctl", "gamma"]),
])
def test_each_estimator_refuses_exactly_the_flags_it_does_not_read(algo, reads, refused):
    _given(algo, **reads)  # its own flags pass
    for name in refused:
        value = {"critic_model": "x", "scale_rewards": "none", "loss_type": "dapo", "kl_estimator": "k1",
                 "dynamic_sampling": True, "whiten_advantages": False}.get(name, 0.5 if name != "ppo_epochs" else 2)
        with pytest.raises(UserError, match=f"--{name.replace('_', '-')} has no effect with --algo {algo}"):
            _given(algo, **{name: value})
    # GRPO and PPO still refuse the flags the estimators borrowed from the other
    with pytest.raises(UserError, match="--gamma has no effect with --algo grpo"):
        _given("grpo", gamma=0.9)
    with pytest.raises(UserError, match="--num-generations has no effect with --algo ppo"):
        _given("ppo", num_generations=3)


def test_estimators_need_a_reference_only_for_their_kl():
    cfg = lambda algo, **kw: build_config(RLHFConfig, {"algo": algo, "actor_model": "tiny", **kw})  # noqa: E731
    assert ALGORITHMS["reinforce_pp"].needs(cfg("reinforce_pp")) == {"reference"}  # --kl-ctl 0.1
    assert ALGORITHMS["reinforce_pp"].needs(cfg("reinforce_pp", kl_ctl=0.0)) == set()
    assert ALGORITHMS["rloo"].needs(cfg("rloo", beta=0.0)) == set()
    assert ALGORITHMS["remax"].needs(cfg("remax")) == {"reference"}  # --beta 0.04
    for algo in CRITIC_FREE:
        check_config(cfg(algo))  # rule rewards: no reward model needed
        assert "critic" not in ALGORITHMS[algo].needs(cfg(algo))
    with pytest.raises(UserError, match="--num-generations must be >= 2"):
        check_config(cfg("rloo", num_generations=1))


def _short_run(tmp_path, reward_file, algo, **kw):  # noqa: F811 (the fixture's name)
    out = tmp_path / algo
    metrics = run(grpo_cfg(out, reward_file, algo=algo, max_answer_seq_len=8, max_eval_rows=2, **kw))
    assert metrics["steps"] == 2 and metrics["algo"] == algo and metrics["reward_after"] is not None
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "train/actor_loss" in r]
    assert len(rows) == 2 and all(abs(r["train/actor_loss"]) < 1e6 for r in rows)
    assert read_json(out / "eval.json")["reward_funcs"] == ["format", reward_file]
    assert _moved(out) > 0.9  # the actor trained
    assert not (out / "critic").exists()
    return rows


def test_rloo_short_run(tmp_path, reward_file):  # noqa: F811
    rows = _short_run(tmp_path, reward_file, "rloo", num_generations=3)
    assert "train/kl" in rows[0] and "train/reward_std" in rows[0]


@pytest.mark.parametrize("algo", ["reinforce_pp", "reinforce_pp_baseline"])
def test_reinforce_pp_short_run(tmp_path, reward_file, algo):  # noqa: F811
    rows = _short_run(tmp_path, reward_file, algo, kl_ctl=0.05, gamma=0.99)
    assert "train/kl" in rows[0]  # the reference's log-probs are there for the KL reward


def test_remax_short_run(tmp_path, reward_file):  # noqa: F811
    rows = _short_run(tmp_path, reward_file, "remax", beta=0.0)
    assert "train/reward_baseline" in rows[0] and "train/kl" not in rows[0]  # the greedy answers' mean reward
