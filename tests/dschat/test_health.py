"""The health monitor: each check fires on a planted metric stream at the step it should, and stays silent on a
healthy one; the actions (warn, save, stop, rollback) and the rollback's bookkeeping."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dschat.config import HealthArgs
from dschat.training import health as H


def monitor(tmp_path: Path, stage: int = 3, context: H.Context | None = None, **kw) -> H.HealthMonitor:
    return H.HealthMonitor(HealthArgs(**kw), stage, tmp_path, context, log=lambda _: None)


def feed(m: H.HealthMonitor, rows: list[dict]) -> list[tuple[int, str]]:
    """Observe rows as steps 1..N (a row with 'step' keeps its own); the (step, check) of every alarm."""
    fired = []
    for i, row in enumerate(rows, start=1):
        step = row.pop("step", i)
        fired += [(a.step, a.check) for a in m.observe(step, row)]
    return fired


def healthy(n: int = 60, **extra) -> list[dict]:
    """A stream like the demo's: noisy but stable figures."""
    rows = []
    for i in range(n):
        wiggle = 0.1 * math.sin(i)
        rows.append({"train/actor_loss": 0.5 + wiggle, "train/actor_grad_norm": 1.0 + wiggle,
                     "train/kl": 0.01 + 0.001 * i / n, "train/entropy": 2.0 + wiggle,
                     "train/answer_length": 20 + 3 * wiggle, "train/eos_rate": 0.6 + wiggle,
                     "train/reward": 0.1 * i / n, "train/clip_ratio": 0.05, "train/critic_loss": 0.3 + wiggle,
                     **extra})
    return rows


def test_a_healthy_stream_fires_nothing(tmp_path):
    m = monitor(tmp_path, context=H.Context(max_answer_len=64, reward_stats=(0.0, 1.0), reward_sources=("rm",)))
    assert feed(m, healthy()) == []


@pytest.mark.parametrize("key", ["train/actor_loss", "train/actor_grad_norm"])
def test_nonfinite_fires_at_once(tmp_path, key):
    rows = healthy(10)
    rows[6][key] = math.nan
    assert feed(monitor(tmp_path), rows) == [(7, "nonfinite")]


def test_grad_spike_against_the_running_median(tmp_path):
    rows = healthy(30)
    rows[20]["train/actor_grad_norm"] = 11.5  # median ~1.0; 10x threshold
    rows[25]["train/actor_grad_norm"] = 9.0  # below 10x: silent (and the check is quiet for a window anyway)
    assert feed(monitor(tmp_path), rows) == [(21, "grad_spike")]
    assert feed(monitor(tmp_path, alarm_grad_spike=0), healthy(30)) == []


def test_kl_ceiling_reads_the_per_token_figure_when_there_is_one(tmp_path):
    rows = healthy(10)
    rows[4]["train/kl"] = 1.5
    assert feed(monitor(tmp_path), rows) == [(5, "kl_ceiling")]
    rows = healthy(10, **{"train/kl_per_token": 0.01})
    rows[4]["train/kl"] = 30.0  # PPO's per-answer sum: not what the ceiling reads
    assert feed(monitor(tmp_path), rows) == []


def test_kl_growth(tmp_path):
    rows = healthy(40)
    for i, r in enumerate(rows):
        r["train/kl"] = 0.004 if i < 20 else 0.004 * 3 ** ((i - 19) / 2)  # x3 every two steps from step 21
    fired = feed(monitor(tmp_path, alarm_kl_ceiling=0), rows)
    assert fired and fired[0][1] == "kl_growth"
    step = fired[0][0]
    recent = [r["train/kl"] for r in rows[step - 10: step]]
    assert sum(recent) / 10 > H.KL_GROWTH_FLOOR  # not before the floor


def test_entropy_collapse_floor_and_drop(tmp_path):
    rows = healthy(40)
    for i, r in enumerate(rows[20:]):
        r["train/entropy"] = max(0.001, 2.0 * 0.7 ** (i + 1))
    fired = [c for _, c in feed(monitor(tmp_path), rows)]
    assert "entropy_drop" in fired and "entropy_floor" in fired
    assert fired.index("entropy_drop") < fired.index("entropy_floor")  # the fall shows before the floor


def test_length_pinned_only_from_a_lower_baseline(tmp_path):
    ctx = H.Context(max_answer_len=64)
    rows = healthy(40)
    for r in rows[20:]:
        r["train/answer_length"], r["train/eos_rate"] = 64.0, 0.6
    assert ("length_pinned" in [c for _, c in feed(monitor(tmp_path, context=ctx), rows)])
    pinned_from_start = healthy(40, **{"train/answer_length": 64.0, "train/eos_rate": 0.0})  # the tiny demo's
    assert feed(monitor(tmp_path, context=ctx), pinned_from_start) == []


def test_eos_drop(tmp_path):
    rows = healthy(40)
    for r in rows[20:]:
        r["train/eos_rate"] = 0.05
    assert [c for _, c in feed(monitor(tmp_path), rows)] == ["eos_drop"]


def test_reward_hacking_needs_the_held_out_fall_and_the_training_rise(tmp_path):
    rows = healthy(30)
    for i, r in enumerate(rows):
        r["train/reward"] = 0.1 * i  # rising
    evals = {10: (0.50, 0.02), 20: (0.60, 0.02), 30: (0.45, 0.02)}
    m = monitor(tmp_path)
    m.observe(0, {"eval/reward": 0.4, "eval/reward_se": 0.02})
    fired = []
    for i, row in enumerate(rows, start=1):
        fired += [(a.step, a.check, a.since) for a in m.observe(i, row)]
        if i in evals:
            v, se = evals[i]
            fired += [(a.step, a.check, a.since) for a in m.observe(i, {"eval/reward": v, "eval/reward_se": se})]
    assert fired == [(30, "reward_hacking", 20)]  # the window starts at the best evaluation
    # the same evaluations with a flat training reward: a held-out fall alone is not hacking
    m = monitor(tmp_path)
    m.observe(0, {"eval/reward": 0.4, "eval/reward_se": 0.02})
    flat = []
    for i, row in enumerate(healthy(30, **{"train/reward": 0.2}), start=1):
        m.observe(i, row)
        if i in evals:
            flat += m.observe(i, {"eval/reward": evals[i][0], "eval/reward_se": evals[i][1]})
    assert flat == []


def test_source_divergence(tmp_path):
    rows = healthy(40)
    for i, r in enumerate(rows):
        r["train/reward/length"] = 0.01 * i + 0.01 * math.sin(3 * i)
        r["train/reward/accuracy"] = (0.8 if i < 20 else 0.8 - 0.02 * (i - 19)) + 0.01 * math.cos(3 * i)
    fired = feed(monitor(tmp_path), rows)
    assert [c for _, c in fired] == ["source_divergence"]
    # the gamed source coming back down from its gain, still above where it began, while the other rises
    recovery = healthy(50)
    for i, r in enumerate(recovery):
        gain = 0.0 if i < 10 else (0.07 * (i - 10) if i < 25 else 1.05 - 0.04 * (i - 25))
        r["train/reward/length"] = 1.0 + gain + 0.01 * math.sin(3 * i)
        r["train/reward/accuracy"] = 0.5 + 0.01 * i + 0.01 * math.cos(3 * i)
    assert min(r["train/reward/length"] for r in recovery[25:]) > 1.02  # the fall ends above the start
    assert feed(monitor(tmp_path), recovery) == []
    alarm = monitor(tmp_path)
    for i, row in enumerate(rows, start=1):
        hits = alarm.observe(i, row)
        if hits:
            assert hits[0].metric == "train/reward/accuracy" and "length rose" in hits[0].message
            break


def test_rm_range(tmp_path):
    ctx = H.Context(reward_stats=(0.5, 0.2), reward_sources=("rm",))
    rows = healthy(30)
    for i, r in enumerate(rows):
        r["train/reward"] = 0.5 + (0.1 * (i - 10) if i > 10 else 0.0)
    fired = feed(monitor(tmp_path, context=ctx), rows)
    assert [c for _, c in fired] == ["rm_range"]
    step = fired[0][0]
    assert sum(r["train/reward"] for r in rows[step - 10: step]) / 10 > 0.5 + 4 * 0.2
    # another source mixed in, without a per-source figure: the check has nothing it can read
    mixed = H.Context(reward_stats=(0.5, 0.2), reward_sources=("rm", "format"))
    assert feed(monitor(tmp_path, context=mixed), healthy(30, **{"train/reward": 5.0})) == []


def test_stage2_overfit_and_score_drift(tmp_path):
    m = monitor(tmp_path, stage=2)
    fired = []
    acc = {0: 0.5, 10: 0.8, 20: 0.7}
    fired += m.observe(0, {"eval/accuracy": acc[0]})
    for i in range(1, 21):
        fired += m.observe(i, {"train/loss": 0.5, "train/accuracy": 0.5 + 0.02 * i, "train/chosen_score": 0.5,
                               "train/rejected_score": -0.5})
        if i in acc:
            fired += m.observe(i, {"eval/accuracy": acc[i]})
    assert [(a.step, a.check) for a in fired] == [(20, "overfit")]
    drift = monitor(tmp_path, stage=2)
    rows = [{"train/chosen_score": 1.0 + 2 * i, "train/rejected_score": -1.0 + 2 * i} for i in range(30)]
    assert [c for _, c in feed(drift, rows)] == ["score_drift"]
    # stage-3 checks never run in stage 2
    assert feed(monitor(tmp_path, stage=2), [{"train/kl": 50.0}]) == []


def test_value_growth_and_clip_pinned(tmp_path):
    rows = healthy(40)
    for r in rows[25:]:
        r["train/critic_loss"] = 8.0
    assert [c for _, c in feed(monitor(tmp_path), rows)] == ["value_growth"]
    rows = healthy(40)
    for r in rows[20:]:
        r["train/actor_clip_frac"] = 0.7
    assert [c for _, c in feed(monitor(tmp_path), rows)] == ["clip_pinned"]


def test_a_check_is_quiet_for_a_window_after_firing(tmp_path):
    rows = healthy(60, **{"train/kl": 2.0})
    assert [s for s, _ in feed(monitor(tmp_path, alarm_kl_growth=0), rows)] == [1, 22, 43]


class FakeLoop:
    def __init__(self):
        self.saved = []

    def save_now(self):
        self.saved.append(True)
        return Path("state")


def test_actions(tmp_path):
    lines = []
    m = H.HealthMonitor(HealthArgs(on_alarm="warn"), 3, tmp_path, log=lines.append)
    m.observe(1, {"train/kl": 5.0})
    loop = FakeLoop()
    m.respond(loop)
    assert loop.saved == [] and "health alarm 'kl_ceiling' at step 1" in lines[0] and "threshold 1" in lines[0]
    rec = [json.loads(x) for x in (tmp_path / "health.jsonl").read_text().splitlines()]
    assert rec[0]["check"] == "kl_ceiling" and rec[0]["action"] == "warn" and rec[0]["value"] == 5.0
    m = monitor(tmp_path, on_alarm="save")
    m.observe(1, {"train/kl": 5.0})
    m.respond(loop)
    assert loop.saved == [True]
    m = monitor(tmp_path, on_alarm="stop")
    m.observe(1, {"train/kl": 5.0})
    with pytest.raises(H.HealthStop, match="stopped by the health alarm 'kl_ceiling' at step 1.*--resume") as e:
        m.respond(loop)
    assert e.value.exit_code == 4
    m = monitor(tmp_path, on_alarm="warn")  # a non-finite figure stops even under warn
    m.observe(1, {"train/actor_loss": math.inf})
    with pytest.raises(H.HealthStop):
        m.respond(loop)
    m = monitor(tmp_path, on_alarm="stop")  # after the last evaluation only a rollback acts
    m.observe(5, {"train/kl": 5.0})
    m.respond(loop, final=True)
    assert [a["action"] for a in m.summary()][-1] == "warn"


def make_states(tmp_path: Path, steps: list[int]) -> Path:
    root = tmp_path / "checkpoints"
    for s in steps:
        d = root / f"step-{s:08d}"
        d.mkdir(parents=True)
        (d / "trainer.json").write_text(json.dumps({"step": s}))
    (root / "latest").write_text(f"step-{steps[-1]:08d}\n")
    return root


def test_rollback_picks_the_state_before_the_window_and_keeps_the_newer_ones(tmp_path):
    root = make_states(tmp_path, [0, 10, 20, 30])  # step 0: the state a rollback run saves before its first step
    m = monitor(tmp_path, on_alarm="rollback", rollback_lr_scale=0.25)
    rows = healthy(30)
    for i, r in enumerate(rows):
        r["train/kl"] = 0.004 if i < 20 else 0.2
    with pytest.raises(H.Rollback) as e:
        for i, row in enumerate(rows, start=1):
            m.observe(i, row)
            m.respond(FakeLoop())
    rb = e.value
    alarm = m.summary()[0]
    assert alarm["check"] == "kl_growth" and alarm["action"] == "rollback"
    # the trend checks land before their whole window (both halves): the earlier half already held the rise
    assert alarm["since"] <= alarm["step"] - 20
    assert rb.state.name == f"step-{max(s for s in (0, 10, 20, 30) if s <= alarm['since']):08d}"
    assert rb.lr_scale == 0.25 and rb.rollbacks == 1
    assert (root / "latest").read_text().strip() == rb.state.name
    kept_aside = sorted(p.name for p in (root / "rolled-back-1").iterdir())
    assert kept_aside and all(p > rb.state.name for p in kept_aside)
    assert sorted(p.name for p in root.glob("step-*")) <= [rb.state.name] + kept_aside


def test_rollback_without_an_earlier_state_stops_and_a_second_alarm_stops(tmp_path):
    m = monitor(tmp_path, on_alarm="rollback")
    m.observe(1, {"train/kl": 5.0})
    with pytest.raises(H.HealthStop, match="no training state was saved at or before step 0"):
        m.respond(FakeLoop())
    m = monitor(tmp_path, on_alarm="rollback")
    m.rollbacks = 1  # one done already (--max-rollbacks 1)
    m.observe(1, {"train/kl": 5.0})
    with pytest.raises(H.HealthStop):
        m.respond(FakeLoop())


def test_learning_rates_scale_with_their_schedule():
    import torch

    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))

    class Eng:
        optimizer, lr_scheduler = opt, sched

    H.scale_learning_rates({"actor": Eng()}, 0.5)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05 / 2)


# ---------------------------------------------------------------------------------------------- end to end
LENGTH_REWARD = '''
def length(prompts, completions, **row_fields):
    return [len(c) / 10 for c in completions]
'''


def grpo_argv(tmp_path: Path, out: Path, *extra: str) -> list[str]:
    from dschat.demo import demo_files

    reward = tmp_path / "length_reward.py"
    reward.write_text(LENGTH_REWARD)
    return ["train", "--step", "3", "--algo", "grpo", "--actor-model", "tiny", "--data", str(demo_files()["prompts"]),
            "--output-dir", str(out), "--max-steps", "4", "--max-answer-seq-len", "12", "--num-generations", "2",
            "--per-device-generation-batch-size", "2", "--per-device-training-batch-size", "4", "--max-eval-rows", "4",
            "--per-device-eval-batch-size", "4", "--reward-funcs", f"{reward}:length", "--beta", "0.04",
            "--save-interval", "1", "--keep-checkpoints", "8", "--no-progress", *extra]


@pytest.mark.slow
def test_rollback_restores_the_state_it_names(tmp_path):
    """The KL logged at a step is the policy's before that step's update: on this run 0 at step 1, 3.0e-4 at step 2,
    1.05e-3 at step 3. A ceiling of 6e-4 fires at step 3, so the last state below it is step 1's, and the rollback
    lands a window before that (``--alarm-window 4``): on the state of step 0, saved before the first step, from
    which the run trains on at half the rate. Step 1's figures are computed from the restored weights, RNG and
    prompt position before any update at the new rate, so they equal an uninterrupted run's bit for bit."""
    from tests.helpers import read_json, read_jsonl, run_cli

    plain, out = tmp_path / "plain", tmp_path / "run"
    proc = run_cli(*grpo_argv(tmp_path, plain), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli(*grpo_argv(tmp_path, out, "--alarm-kl-ceiling", "6e-4", "--on-alarm", "rollback",
                              "--max-rollbacks", "2", "--alarm-window", "4"), timeout=600)
    assert proc.returncode in (0, 4), proc.stderr[-3000:]
    alarms = [json.loads(x) for x in (out / "health.jsonl").read_text().splitlines()]
    first = alarms[0]
    assert (first["step"], first["check"], first["action"], first["since"]) == (3, "kl_ceiling", "rollback", 0)
    assert "rolled back to" in proc.stderr and "step-00000000: learning rates x0.5" in proc.stderr
    assert sorted(p.name for p in (out / "checkpoints" / "rolled-back-1").iterdir()) == ["step-00000001",
                                                                                        "step-00000002"]

    def train_row(folder, step):
        return next(r for r in read_jsonl(folder / "metrics.jsonl") if r["step"] == step and "train/kl" in r)

    for step in (1,):  # the restored state, bit for bit
        a, b = train_row(plain, step), train_row(out, step)
        measured = ("time", "memory/")  # the machine's figures, not the run's
        assert {k: v for k, v in a.items() if not k.startswith(measured)} == \
            {k: v for k, v in b.items() if not k.startswith(measured)}
    later = read_json(sorted((out / "checkpoints").glob("step-*"))[-1] / "trainer.json")["health"]
    assert later["lr_scale"] == 0.5 or later["lr_scale"] == 0.25


@pytest.mark.slow
def test_stop_exits_with_its_code_and_leaves_a_resumable_state(tmp_path):
    from tests.helpers import read_json, run_cli

    out = tmp_path / "run"
    proc = run_cli(*grpo_argv(tmp_path, out, "--alarm-kl-ceiling", "1e-9", "--on-alarm", "stop"), timeout=600)
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("dschat: error: stopped by the health alarm 'kl_ceiling'")
    assert "continue with --resume" in proc.stderr
    proc = run_cli(*grpo_argv(tmp_path, out, "--resume"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr and read_json(out / "eval.json")["steps"] == 4
    assert [a["check"] for a in read_json(out / "eval.json")["alarms"]] == ["kl_ceiling"]  # the first run's


STREAMS = Path(__file__).parent.parent / "data" / "health_streams"


@pytest.mark.parametrize("name", sorted(p.stem for p in STREAMS.glob("*.jsonl")))
def test_silent_on_the_demo_pipelines_own_streams(tmp_path, name):
    """Every stage of `dschat pipeline all`, `grpo` and `dpo` with their defaults, replayed: each file is a header
    (the stage, its answer-length cap, the reward model's stage-2 statistics, the reward sources) and the run's
    metrics.jsonl rows, as the stage logged them (every step and every evaluation)."""
    lines = (STREAMS / f"{name}.jsonl").read_text().splitlines()
    head = json.loads(lines[0])
    ctx = H.Context(head.get("max_answer_len"), tuple(head["reward_stats"]) if head.get("reward_stats") else None,
                    tuple(head.get("reward_sources", ())))
    m = monitor(tmp_path, stage=head["stage"], context=ctx)
    fired = []
    for line in lines[1:]:
        row = json.loads(line)
        step = row.pop("step")
        fired += [a.line() for a in m.observe(step, row)]
    assert len(lines) > 10 and fired == []


def test_a_resumed_monitor_has_the_history_and_quiet_windows_of_the_run(tmp_path):
    """The monitor's windows, baselines and quiet windows travel in the training state (as JSON), not rebuilt from
    metrics.jsonl, which holds only every --log-interval-th step: here every 5th, so a rebuilt history would have
    4 values of the 20 steps before the state, and kl_growth (window 20) would find no earlier half."""
    rows = healthy(40)
    for i, r in enumerate(rows):
        r["train/kl"] = 0.004 if i < 20 else 0.2
        r["train/eos_rate"] = 0.6 if i < 10 else 0.1  # eos_drop fires before the state, then quiet for a window
    with (tmp_path / "metrics.jsonl").open("w") as fh:
        for i, r in enumerate(rows[:20], start=1):
            if i % 5 == 0:
                fh.write(json.dumps({"step": i, "time": 0.1 * i, **r}) + "\n")
    uninterrupted = monitor(tmp_path)
    fired = feed(uninterrupted, [dict(r) for r in rows])
    assert ("kl_growth" in [c for s, c in fired if s > 20]) and [c for s, c in fired if s <= 20] == ["eos_drop"]

    first = monitor(tmp_path)
    feed(first, [dict(r) for r in rows[:20]])
    trainer = json.loads(json.dumps({"step": 20, "health": first.state_dict()}))  # trainer.json's round trip
    resumed = monitor(tmp_path)
    resumed.resume(trainer, {})
    assert len(resumed.history.values("train/kl")) == 20
    assert resumed.quiet_until == first.quiet_until and set(resumed.quiet_until) == {"eos_drop"}
    after = []
    for i, row in enumerate(rows[20:], start=21):
        after += [(a.step, a.check) for a in resumed.observe(i, dict(row))]
    assert after == [x for x in fired if x[0] > 20]


def test_a_rollback_passes_its_decision_to_the_run_that_resumes_its_state(tmp_path):
    """No module global: the rollback leaves its scale and count beside the states (checkpoints/rollback.json),
    read by the monitor that resumes exactly that state (in this process or a later --resume), no other one."""
    import torch

    assert not hasattr(H, "_RESTART") and not hasattr(H, "restart_after")
    root = make_states(tmp_path, [0, 10, 20])
    m = monitor(tmp_path, on_alarm="rollback", rollback_lr_scale=0.25, max_rollbacks=2)
    m.observe(20, {"train/kl": 5.0})
    with pytest.raises(H.Rollback) as e:
        m.respond(FakeLoop())
    assert e.value.state == root / "step-00000000" and (e.value.lr_scale, e.value.rollbacks) == (0.25, 1)

    p = torch.nn.Parameter(torch.zeros(1))

    class Eng:
        optimizer = torch.optim.SGD([p], lr=0.1)

    lines = []
    again = H.HealthMonitor(HealthArgs(on_alarm="rollback", max_rollbacks=2), 3, tmp_path, log=lines.append)
    again.resume({"step": 0, "health": {"lr_scale": 1.0, "rollbacks": 0}}, {"actor": Eng()}, root / "step-00000000")
    assert (again.lr_scale, again.rollbacks) == (0.25, 1)
    assert Eng.optimizer.param_groups[0]["lr"] == pytest.approx(0.025)
    assert lines == ["rolled back to step-00000000: learning rates x0.25 from here (rollback 1 of 2)"]
    assert again.state_dict()["lr_scale"] == 0.25  # what the next state saves
    other = monitor(tmp_path)  # another state (a later one, resumed by --resume): its own saved figures
    other.resume({"step": 30, "health": {"lr_scale": 0.25, "rollbacks": 1}}, {}, root / "step-00000030")
    assert (other.lr_scale, other.rollbacks) == (0.25, 1)


def test_a_final_alarm_never_costs_a_finished_run_its_outputs(tmp_path):
    """After the last evaluation an alarm only warns, under rollback with no rollbacks left too (it raised a stop
    before the model folders and eval.json were written); with one left it still rolls back."""
    make_states(tmp_path, [0])
    for action in ("stop", "save", "rollback"):
        m = monitor(tmp_path, on_alarm=action)
        m.rollbacks = 1  # --max-rollbacks 1, spent
        m.observe(5, {"train/kl": 5.0})
        loop = FakeLoop()
        m.respond(loop, final=True)
        assert [a["action"] for a in m.summary()] == ["warn"] and loop.saved == []
    m = monitor(tmp_path, on_alarm="rollback")
    m.observe(5, {"train/kl": 5.0})
    with pytest.raises(H.Rollback):
        m.respond(FakeLoop(), final=True)


def test_a_kl_ceiling_rollback_lands_a_window_before_the_crossing(tmp_path):
    m = monitor(tmp_path)  # --alarm-window 20
    for i, kl in enumerate([0.01 * i for i in range(30)] + [0.9, 1.05, 1.1, 1.2], start=1):
        m.observe(i, {"train/kl": kl})
    # crossed at step 32 (measured before step 32's update): the state of step 30 is the last one below the ceiling,
    # and one just below it would cross again at once; the rollback lands a window (20 steps) before it
    assert [(a.step, a.check, a.since) for a in m.pending] == [(32, "kl_ceiling", 10)]


def test_each_check_its_flag_and_its_function_read_alike():
    """kl_ceiling / --alarm-kl-ceiling / _kl_ceiling; only a threshold two checks share (a z-score) or one named by
    its unit keeps another name."""
    by_unit = {"reward_hacking": "alarm_hacking_z", "source_divergence": "alarm_hacking_z",
               "rm_range": "alarm_rm_sigma", "clip_pinned": "alarm_clip_frac"}
    for check in H.CHECKS:
        assert check.fn.__name__ == f"_{check.name}"
        if check.threshold is not None:
            assert check.threshold == by_unit.get(check.name, f"alarm_{check.name}")


def test_async_checks_watch_the_lag_and_the_sampler_s_drift(tmp_path):
    context = H.Context(max_staleness=1)
    rows = healthy(30, **{"async/lag_max": 1.0, "async/kl_behaviour_prox": 0.01})
    rows[12]["async/lag_max"] = 2.0  # older than K = 1: admission failed
    assert feed(monitor(tmp_path, context=context), rows) == [(13, "async_lag")]
    assert feed(monitor(tmp_path), healthy(30, **{"async/lag_max": 5.0})) == []  # lockstep: no bound to hold
    rows = healthy(30, **{"async/lag_max": 1.0, "async/kl_behaviour_prox": 0.01})
    for r in rows[15:]:
        r["async/kl_behaviour_prox"] = 0.3  # the last 10 steps' mean: 0.097 at step 18, 0.126 at step 19
    assert feed(monitor(tmp_path, context=context), rows) == [(19, "async_kl")]
    assert feed(monitor(tmp_path, context=context, alarm_async_kl=0), rows) == []
