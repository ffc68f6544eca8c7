"""Stage 3 with the critic-free estimators (--algo rloo | reinforce_pp | reinforce_pp_baseline | remax) on the tiny
preset: each runs two steps, trains the actor and loads no critic; each refuses exactly the flags it does not read;
REINFORCE++'s whitening over two gloo ranks equals the whole batch's.

The estimators are unit-tested against hand-worked numbers in tests/dschat/test_losses.py.
"""

import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dschat import losses as L
from dschat.config import build_config, refuse_inert
from dschat.errors import UserError
from dschat.rewards.names import source_label
from dschat.rlhf.algorithms import ALGORITHMS
from dschat.rlhf.config import RLHFConfig, check_config
from dschat.rlhf.reinforce_pp import ReinforcePP, ReinforcePPBaseline
from dschat.rlhf.rollout import Rollout
from tests.helpers import fraction_changed as _moved
from tests.helpers import read_json, read_jsonl
from tests.helpers import run_stage as run
from tests.step3_rlhf.test_grpo import grpo_cfg, reward_file  # noqa: F401 (a fixture)

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
    assert read_json(out / "eval.json")["reward_funcs"] == ["format", source_label(reward_file)]  # the labels
    assert _moved(out) > 0.9  # the actor trained
    assert not (out / "critic").exists()
    return rows


def test_rloo_short_run(tmp_path, reward_file):  # noqa: F811
    rows = _short_run(tmp_path, reward_file, "rloo", num_generations=3)
    assert "train/kl" in rows[0] and "train/reward_std" in rows[0]


def test_rloo_kl_in_reward_short_run(tmp_path, reward_file):  # noqa: F811
    rows = _short_run(tmp_path, reward_file, "rloo", num_generations=3, kl_in_reward=True, beta=0.1)
    assert "train/kl" in rows[0]  # measured still, now charged in the reward


def test_rloo_kl_in_reward_by_hand():
    """TRL's and OpenRLHF's placement: the summed k1 KL of each completion leaves its reward before the leave-one-out
    baseline; dschat's default keeps it in the loss (``--kl-in-reward`` off)."""
    from dschat.rlhf.rloo import kl_folded_rewards

    rewards = torch.tensor([1.0, 0.0, 2.0])  # one prompt, k = 3
    old = torch.tensor([[-1.0, -2.0], [-1.0, -1.0], [-3.0, 0.0]])
    ref = torch.tensor([[-2.0, -2.0], [-1.5, -1.0], [-1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])  # the third answer has one token
    # per-answer k1 sums: (1 + 0) = 1, (0.5 + 0) = 0.5, (-2) = -2 -> rewards - 0.5 * kl = 0.5, -0.25, 3.0
    folded = kl_folded_rewards(rewards, old, ref, mask, beta=0.5)
    assert folded.tolist() == pytest.approx([0.5, -0.25, 3.0])
    # leave-one-out: 0.5 - (-0.25 + 3) / 2 = -0.875; -0.25 - (0.5 + 3) / 2 = -2.0; 3 - (0.5 - 0.25) / 2 = 2.875
    assert L.rloo_advantages(folded, 3).tolist() == pytest.approx([-0.875, -2.0, 2.875])
    with pytest.raises(UserError, match="--kl-in-reward has no effect with --algo grpo"):
        _given("grpo", kl_in_reward=True)
    with pytest.raises(UserError, match="--kl-estimator has no effect with --kl-in-reward"):
        _given("rloo", kl_in_reward=True, kl_estimator="k2")


@pytest.mark.parametrize("algo", ["reinforce_pp", "reinforce_pp_baseline"])
def test_reinforce_pp_short_run(tmp_path, reward_file, algo):  # noqa: F811
    rows = _short_run(tmp_path, reward_file, algo, kl_ctl=0.05, gamma=0.99)
    assert "train/kl" in rows[0]  # the reference's log-probs are there for the KL reward


def test_remax_short_run(tmp_path, reward_file):  # noqa: F811
    rows = _short_run(tmp_path, reward_file, "remax", beta=0.0)
    assert "train/reward_baseline" in rows[0] and "train/kl" not in rows[0]  # the greedy answers' mean reward
    # without --loss-type ReMax sums each answer's tokens (its baseline is not centred); GRPO's default is grpo
    assert read_json(tmp_path / "remax" / "eval.json")["loss_type"] == "dr_grpo"


def test_every_spec_loads_its_run_time_class():
    """The registry maps each name to a torch-free spec; ``load()`` returns the run-time class, which inherits it."""
    for name, spec in ALGORITHMS.items():
        Algo = spec.load()
        assert issubclass(Algo, spec) and Algo.name == name and Algo.load() is Algo, name
        assert callable(Algo.step) and Algo.collator is not None and not hasattr(spec, "step"), name


def test_loss_type_defaults_per_algorithm_and_explicit_wins():
    cfg = lambda algo, **kw: build_config(RLHFConfig, {"algo": algo, "actor_model": "tiny", **kw})  # noqa: E731
    made = lambda algo, **kw: ALGORITHMS[algo].load()(cfg(algo, **kw), None, None, None, None, None, None, None)  # noqa: E731
    assert made("grpo").loss_type == "grpo" and made("rloo").loss_type == "grpo"
    assert made("remax").loss_type == "dr_grpo" and not made("remax").dynamic
    remax_dapo = made("remax", loss_type="dapo")  # dapo's aggregation and clip-higher, never its dynamic sampling
    assert remax_dapo.loss_type == "dapo" and remax_dapo.eps_high == 0.28 and not remax_dapo.dynamic
    assert made("grpo", loss_type="dapo").dynamic and made("reinforce_pp").loss_type == "dapo"


def _shard(rank: int, rows: slice) -> tuple:
    """Rank ``rank``'s share of one fixed batch: 4 completions (2 prompts x 2), 3 answer tokens, padding."""
    g = torch.Generator().manual_seed(0)
    old, ref = -torch.rand(4, 3, generator=g), -torch.rand(4, 3, generator=g)
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0])  # the second group's rewards are equal
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]])
    rollout = Rollout(torch.zeros(4, 5, dtype=torch.long), torch.ones(4, 5, dtype=torch.long), mask, 2,
                      torch.tensor([False, True, True, False]))
    return rewards[rows], rollout.select(torch.arange(4)[rows]), old[rows], ref[rows]


def _advantages(cls, rewards, rollout, old, ref):
    est = SimpleNamespace(g=SimpleNamespace(num_generations=2), group_baseline=cls.group_baseline,
                          p=SimpleNamespace(kl_ctl=0.1, clip_reward_value=5.0, gamma=0.9))
    return cls.advantages(est, rewards, rollout, old, ref, None)


def _two_ranks(rank: int, port: int, queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        rows = slice(0, 2) if rank == 0 else slice(2, 4)  # one prompt's group per rank
        # plain lists, not tensors: a tensor crosses the queue as a shared-memory handle that the parent can only
        # open while this process is alive, and it may have exited by then (seen on a loaded machine)
        queue.put((rank, [_advantages(c, *_shard(rank, rows)).tolist() for c in (ReinforcePP, ReinforcePPBaseline)]))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_reinforce_pp_whitens_over_all_ranks():
    """Two gloo ranks holding half the batch each get exactly the rows of the one-process whole-batch advantages
    (the whitening's moments are all-reduced), which whitening each half alone would not give."""
    whole = [_advantages(c, *_shard(0, slice(0, 4))) for c in (ReinforcePP, ReinforcePPBaseline)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_two_ranks, args=(r, port, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for i in range(2):
        torch.testing.assert_close(torch.tensor(got[0][i] + got[1][i]), whole[i], rtol=0, atol=1e-6)
    # sanity: the whole-batch advantages are whitened over the kept tokens (mean 0, unbiased std 1)
    mask = _shard(0, slice(0, 4))[1].action_mask
    assert abs(L.masked_mean(whole[0], mask).item()) < 1e-6
    assert L.masked_var(whole[0], mask).item() == pytest.approx(1.0, abs=1e-5)
    # a rank alone would whiten its half to its own mean: different numbers
    alone = _advantages(ReinforcePP, *_shard(1, slice(2, 4)))
    assert not torch.allclose(alone, whole[0][2:], atol=1e-3)
