"""The training health monitor: named checks over the metrics a stage already computes, and what an alarm does.

Every stage feeds each step's training metrics and each evaluation's to ``HealthMonitor.observe``; the checks
(``CHECKS``) look at the history of the figures they name and return an ``Alarm`` when one crosses its threshold
(``HealthArgs``: ``--alarm-*``, 0 turns a check off). After the step the loop calls ``respond`` (collective: rank
0's alarms decide for every rank), which acts as ``--on-alarm`` says:

- ``warn``: one line naming the check, the figure and the threshold;
- ``save``: the line and a training state written at once;
- ``stop``: the line, a state, and exit code 4 (``HealthStop``);
- ``rollback``: the newest state saved at or before the start of the alarm's window becomes ``latest`` (the
  newer ones move to ``checkpoints/rolled-back-N/``, never deleted), and the stage runs again from it with its
  learning rates scaled by ``--rollback-lr-scale`` (``Rollback``, caught by the stage command); an alarm after
  ``--max-rollbacks`` rollbacks stops the run. Without such a state it stops.

A non-finite loss or gradient norm never trains on: under ``warn`` and ``save`` it stops as ``stop`` does.

Every alarm is a line of ``health.jsonl`` in the output folder and an entry of ``eval.json``'s ``alarms``; the
tracker gets it too. After firing, a check stays quiet for a window of steps, so one episode is one alarm.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dschat import engine as E
from dschat.config import HealthArgs
from dschat.errors import ExitCode, UserError
from dschat.utils import atomic_write_text, read_jsonl_rows

STOP_EXIT_CODE = ExitCode.STOPPED
KL_GROWTH_FLOOR = 0.05  # nats per token: below it a growing KL is still small
MIN_HISTORY = 5  # a running median needs this many earlier values


@dataclass
class Alarm:
    step: int
    check: str
    metric: str
    value: float
    threshold: float
    message: str
    since: int  # the first step of the window the check looked at (where a rollback must land before)
    action: str = ""

    def record(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        return f"health alarm '{self.check}' at step {self.step}: {self.message} ({self.metric} = {self.value:.4g}, " \
               f"threshold {self.threshold:.4g})"


@dataclass
class Context:
    """What the checks need beyond the metrics: the answer length cap, the reward model's stage-2 statistics, the
    reward sources and the bound on staleness (stage 3)."""

    max_answer_len: int | None = None
    reward_stats: tuple[float, float] | None = None  # (mean, std) of the reward model's scores in stage 2
    reward_sources: tuple[str, ...] = ()
    max_staleness: int | None = None  # asynchronous rollouts: the most updates an answer may lag (None: lockstep)


class History:
    """Each metric's ``(step, value)`` pairs, training and evaluation alike."""

    def __init__(self) -> None:
        self.series: dict[str, list[tuple[int, float]]] = {}

    def add(self, step: int, row: dict[str, Any]) -> None:
        for k, v in row.items():
            if isinstance(v, bool) or not isinstance(v, int | float):
                continue
            self.series.setdefault(k, []).append((step, float(v)))

    def values(self, key: str) -> list[float]:
        return [v for _, v in self.series.get(key, [])]

    def steps(self, key: str) -> list[int]:
        return [s for s, _ in self.series.get(key, [])]

    def state_dict(self) -> dict[str, list[list[float]]]:
        """Every series as ``[[step, value], ...]`` (JSON; a non-finite value stays as JSON's NaN/Infinity)."""
        return {k: [[s, v] for s, v in series] for k, series in self.series.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.series = {str(k): [(int(s), float(v)) for s, v in series] for k, series in state.items()}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _halves(xs: list[float], window: int) -> tuple[list[float], list[float]] | None:
    """The window's two halves (earlier, recent), or None before a full window."""
    h = window // 2
    if len(xs) < 2 * h:
        return None
    return xs[-2 * h: -h], xs[-h:]


def _z(earlier: list[float], recent: list[float]) -> float:
    """The change between the halves in standard errors of the difference of their means."""
    var = (statistics.pvariance(earlier) / len(earlier)) + (statistics.pvariance(recent) / len(recent))
    diff = _mean(recent) - _mean(earlier)
    if var <= 0:
        return 0.0 if diff == 0 else math.copysign(math.inf, diff)
    return diff / math.sqrt(var)


@dataclass
class Check:
    """One named check: ``fn(step, history, args, context)`` returns ``(metric, value, threshold, message, since)``
    when it fires. ``threshold`` names the ``HealthArgs`` field that turns it off at 0 (None: always on)."""

    name: str
    threshold: str | None
    fn: Callable[[int, History, HealthArgs, Context], tuple[str, float, float, str, int] | None]
    stages: tuple[int, ...] = (1, 2, 3)


def _window_start(h: History, key: str, n: int) -> int:
    """The last step before the ``n`` latest values of ``key`` (0: the start of the run): a state of that step
    holds none of the updates the check found wanting."""
    steps = h.steps(key)
    return steps[-n - 1] if len(steps) > n else 0


def _nonfinite(step: int, h: History, a: HealthArgs, c: Context) -> Any:
    for key, series in h.series.items():
        if series and series[-1][0] == step and ("loss" in key or key.endswith("grad_norm")) and \
                not math.isfinite(series[-1][1]):
            return key, series[-1][1], math.nan, "the figure is not finite", step - 1
    return None


def _grad_spike(step: int, h: History, a: HealthArgs, c: Context) -> Any:
    for key in sorted(h.series):
        if not key.endswith("grad_norm"):
            continue
        xs = h.values(key)
        if h.steps(key)[-1] != step or len(xs) <= MIN_HISTORY:
            continue
        earlier = [x for x in xs[-1 - a.alarm_window: -1] if math.isfinite(x)]
        if len(earlier) < MIN_HISTORY:
            continue
        median = statistics.median(earlier)
        # and a new high for the run: a loss that saturates (a reward model at 100% accuracy) shrinks its gradients
        # by orders of magnitude, and a later batch back at the run's usual size is no spike
        record = max((x for x in xs[:-1] if math.isfinite(x)), default=0.0)
        if median > 0 and xs[-1] > a.alarm_grad_spike * median and xs[-1] > record:
            return key, xs[-1], max(a.alarm_grad_spike * median, record), \
                f"gradient norm {xs[-1] / median:.1f}x its running median {median:.4g}, above any earlier", step - 1
    return None


def _kl_key(h: History) -> str:
    return "train/kl_per_token" if "train/kl_per_token" in h.series else "train/kl"


def _last_step_within(h: History, key: str, ok: Callable[[float], bool]) -> int:
    """The last step whose ``key`` was acceptable (``ok``), or 0: where a rollback for a figure past a level must
    land, since a state already past it would only fire again."""
    return next((s for s, v in reversed(h.series.get(key, [])) if ok(v)), 0)


def _kl_ceiling(step: int, h: History, a: HealthArgs, c: Context) -> Any:
    key = _kl_key(h)
    xs = h.values(key)
    if xs and h.steps(key)[-1] == step and xs[-1] > a.alarm_kl_ceiling:
        # the KL logged at a step is the policy's before that step's update: the state of that step is past it.
        # A rollback lands a window before the last state below the ceiling: one just below it crosses again at
        # once, even at the lower rate
        since = _last_step_within(h, key, lambda v: v <= a.alarm_kl_ceiling)
        return key, xs[-1], a.alarm_kl_ceiling, "KL to the reference above its ceiling", \
            max(0, since - 1 - a.alarm_window)
    return None


def _kl_growth(step: int, h: History, a: HealthArgs, c: Context) -> Any:
    key = _kl_key(h)
    halves = _halves(h.values(key), a.alarm_window)
    if halves is None:
        return None
    earlier, recent = halves
    now, then = _mean(recent), _mean(earlier)
    if now > KL_GROWTH_FLOOR and now > a.alarm_kl_growth * max(then, 1e-12):
        return key, now, a.alarm_kl_growth * then, \
            f"KL grew {now / max(then, 1e-12):.1f}x within {a.alarm_window} steps", \
            _window_start(h, key, a.alarm_window)
    return None


def _baseline(xs: list[float], window: int) -> float | None:
    h = window // 2
    return _mean(xs[:h]) if len(xs) >= 2 * h else None


def _entropy_floor(step: int, h: History, a: HealthArgs, c: Context) -> Any:
    xs = h.values("train/entropy")
    if len(xs) >= a.alarm_window // 2 and _mean(xs[-(a.alarm_window // 2):]) < a.alarm_entropy_floor:
        now = _mean(xs[-(a.alarm_window // 2):])
        return "train/entropy", now, a.alarm_entropy_floor, "policy entropy collapsed below its floor", \
            _window_start(h, "train/entropy", a.alarm_window)
    return None


def _fell_from_baseline(h: History, key: str, window: int, drop: float,
                        min_base: float) -> tuple[float, float, float] | None:
    """``(baseline, recent mean, floor)`` when the mean of ``key`` over the last half-window is below
    ``(1 - drop)`` times its baseline (the run's first half-window, at least ``min_base``); else None."""
    xs = h.values(key)
    base = _baseline(xs, window)
    if base is None or base <= 0 or base < min_base:
        return None
    now, floor = _mean(xs[-(window // 2):]), (1 - drop) * base
    return (base, now, floor) if now < floor else None


def _entropy_drop(step: int, h: History, a: HealthArgs, c: Context) -> Any:
    fell = _fell_from_baseline(h, "train/entropy", a.alarm_window, a.alarm_entropy_drop, 0.0)
    if fell is None:
        return None
    base, now, floor = fell
    return "train/entropy", now, floor, f"policy entropy fell {1 - now / base:.0%} from its baseline {base:.4g}", \
        _window_start(h, "train/entropy", a.alarm_window)


def _length_pinned(step: int, h: History, a: HealthArgs, c: Context) -> Any:
    xs = h.values("train/answer_length")
    base = _baseline(xs, a.alarm_window)
    if not c.max_answer_len or base is None or base >= 0.8 * c.max_answer_len:
        return None
    now = _mean(xs[-(a.alarm_window // 2):])
    limit = a.alarm_length_pinned * c.max_answer_len
    if now >= limit:
        return "train/answer_length", now, limit, \
            f"answers grew to the length cap {c.max_answer_len} (baseline {base:.1f} tokens)", \
            _window_start(h, "train/answer_length", a.alarm_window)
    return None


def _eos_drop(step: int, h: History, a: HealthArgs, c: Context) -> Any:
    fell = _fell_from_baseline(h, "train/eos_rate", a.alarm_window, a.alarm_eos_drop, 0.2)
    if fell is None:
        return None
    base, now, floor = fell
    return "train/eos_rate", now, floor, f"EOS rate fell from its baseline {base:.2f}", \
        _window_start(h, "train/eos_rate", a.alarm_window)


def _against_best(h: History, key: str, step: int) -> tuple[int, float, int, float] | None:
    """At an evaluation of ``key`` at ``step``: the index, value and step of its best earlier evaluation, and the
    latest value; None at any other step or before a second evaluation."""
    xs = h.values(key)
    if h.steps(key)[-1:] != [step] or len(xs) < 2:
        return None
    i = max(range(len(xs) - 1), key=lambda j: xs[j])
    return i, xs[i], h.steps(key)[i], xs[-1]


def _train_rose(h: History, key: str, since: int) -> bool:
    """Whether the training figure ``key`` after step ``since`` is above its value up to ``since``."""
    series = h.series.get(key, [])
    before = [v for s, v in series if s <= since]
    after = [v for s, v in series if s > since]
    if not after:
        return False
    if not before:  # nothing logged before the best evaluation (it was the one before training)
        return len(after) >= 2 and _mean(after[len(after) // 2:]) > _mean(after[: len(after) // 2])
    return _mean(after) > _mean(before[-len(after):])


def _reward_hacking(step: int, h: History, a: HealthArgs, c: Context) -> Any:
    key = "eval/reward"
    best = _against_best(h, key, step)
    if best is None:
        return None
    i, top, top_step, now = best
    ses = h.values("eval/reward_se")
    se = math.sqrt(ses[i] ** 2 + ses[-1] ** 2) if len(ses) == len(h.values(key)) else 0.0
    threshold = top - a.alarm_hacking_z * se
    if se > 0 and now < threshold and _train_rose(h, "train/reward", top_step):
        return key, now, threshold, f"held-out reward fell from {top:.4g} (step {top_step}) while the training " \
                                    "reward rose", top_step
    return None


def _source_divergence(step: int, h: History, a: HealthArgs, c: Context) -> Any:
    keys = [k for k in sorted(h.series) if k.startswith("train/reward/") and h.steps(k)[-1:] == [step]]
    if len(keys) < 2:
        return None
    zs = {}
    for k in keys:
        halves = _halves(h.values(k), a.alarm_window)
        if halves is not None:
            zs[k] = _z(*halves)
    if len(zs) < 2:
        return None
    up, down = max(zs, key=zs.get), min(zs, key=zs.get)  # type: ignore[arg-type]
    # the falling source must be below where the run began: one coming back down from a rise it had gained
    # (a policy unlearning a gamed source while the others recover) is no hacking
    base = _baseline(h.values(down), a.alarm_window)
    below = base is not None and _mean(h.values(down)[-(a.alarm_window // 2):]) < base
    if zs[up] > a.alarm_hacking_z and zs[down] < -a.alarm_hacking_z and below:
        return down, zs[down], -a.alarm_hacking_z, \
            f"{up.split('/')[-1]} rose ({zs[up]:.1f} s.e.) while {down.split('/')[-1]} fell", \
            _window_start(h, down, a.alarm_window)
    return None


def _rm_range(step: int, h: History, a: HealthArgs, c: Context) -> Any:
    if c.reward_stats is None or "rm" not in c.reward_sources:
        return None
    key = "train/reward/rm" if "train/reward/rm" in h.series else ("train/reward" if c.reward_sources == ("rm",)
                                                                   else None)
    if key is None:
        return None
    xs = h.values(key)
    n = a.alarm_window // 2
    if len(xs) < n:
        return None
    mean, std = c.reward_stats
    now = _mean(xs[-n:])
    if abs(now - mean) > a.alarm_rm_sigma * std:
        return key, now, mean + math.copysign(a.alarm_rm_sigma * std, now - mean), \
            f"reward-model scores left the range of stage 2 (mean {mean:.3g}, std {std:.3g})", \
            _window_start(h, key, a.alarm_window)
    return None


def _overfit(step: int, h: History, a: HealthArgs, c: Context) -> Any:
    key = "eval/accuracy"
    best = _against_best(h, key, step)
    if best is None:
        return None
    _, top, top_step, now = best
    if now < top - a.alarm_overfit and _train_rose(h, "train/accuracy", top_step):
        return key, now, top - a.alarm_overfit, f"held-out accuracy fell from {top:.3f} (step {top_step}) while " \
                                                "the training accuracy rose", top_step
    return None


def _score_drift(step: int, h: History, a: HealthArgs, c: Context) -> Any:
    ch, rj = h.values("train/chosen_score"), h.values("train/rejected_score")
    n = a.alarm_window // 2
    if len(ch) < n or len(rj) < n or h.steps("train/chosen_score")[-1] != step:
        return None
    level = (_mean(ch[-n:]) + _mean(rj[-n:])) / 2
    if abs(level) > a.alarm_score_drift:
        return "train/chosen_score", level, math.copysign(a.alarm_score_drift, level), \
            "chosen and rejected scores drifted together (their mean)", \
            _window_start(h, "train/chosen_score", a.alarm_window)
    return None


def _value_growth(step: int, h: History, a: HealthArgs, c: Context) -> Any:
    key = "train/critic_loss"
    xs = h.values(key)
    n = a.alarm_window // 2
    if len(xs) < n + MIN_HISTORY or h.steps(key)[-1] != step:
        return None
    median = statistics.median(xs[-n - a.alarm_window: -n])
    now = _mean(xs[-n:])
    if median > 0 and now > a.alarm_value_growth * median:
        return key, now, a.alarm_value_growth * median, f"critic loss {now / median:.1f}x its running median", \
            _window_start(h, key, a.alarm_window)
    return None


def _clip_pinned(step: int, h: History, a: HealthArgs, c: Context) -> Any:
    n = a.alarm_window // 2
    for key in ("train/actor_clip_frac", "train/clip_ratio"):
        xs = h.values(key)
        if len(xs) >= n and h.steps(key)[-1] == step and min(xs[-n:]) >= a.alarm_clip_frac:
            return key, _mean(xs[-n:]), a.alarm_clip_frac, f"policy ratio clipped on every step for {n} steps", \
                _window_start(h, key, a.alarm_window)
    return None


def _async_lag(step: int, h: History, a: HealthArgs, c: Context) -> Any:
    xs = h.values("async/lag_max")
    if c.max_staleness is not None and xs and h.steps("async/lag_max")[-1] == step and xs[-1] > c.max_staleness:
        return "async/lag_max", xs[-1], float(c.max_staleness), \
            "an answer older than --max-staleness was trained on", step - 1
    return None


def _async_kl(step: int, h: History, a: HealthArgs, c: Context) -> Any:
    n, key = a.alarm_window // 2, "async/kl_behaviour_prox"
    xs = h.values(key)
    if len(xs) >= n and h.steps(key)[-1] == step and _mean(xs[-n:]) > a.alarm_async_kl:
        return key, _mean(xs[-n:]), a.alarm_async_kl, "the sampler's policy drifted from the trainer's (lower " \
            "--max-staleness or the learning rate)", _window_start(h, key, a.alarm_window)
    return None


CHECKS = (
    Check("nonfinite", None, _nonfinite),
    Check("grad_spike", "alarm_grad_spike", _grad_spike),
    Check("overfit", "alarm_overfit", _overfit, (2,)),
    Check("score_drift", "alarm_score_drift", _score_drift, (2,)),
    Check("kl_ceiling", "alarm_kl_ceiling", _kl_ceiling, (3,)),
    Check("kl_growth", "alarm_kl_growth", _kl_growth, (3,)),
    Check("entropy_floor", "alarm_entropy_floor", _entropy_floor, (3,)),
    Check("entropy_drop", "alarm_entropy_drop", _entropy_drop, (3,)),
    Check("length_pinned", "alarm_length_pinned", _length_pinned, (3,)),
    Check("eos_drop", "alarm_eos_drop", _eos_drop, (3,)),
    Check("reward_hacking", "alarm_hacking_z", _reward_hacking, (3,)),
    Check("source_divergence", "alarm_hacking_z", _source_divergence, (3,)),
    Check("rm_range", "alarm_rm_sigma", _rm_range, (3,)),
    Check("value_growth", "alarm_value_growth", _value_growth, (3,)),
    Check("clip_pinned", "alarm_clip_frac", _clip_pinned, (3,)),
    Check("async_lag", None, _async_lag, (3,)),
    Check("async_kl", "alarm_async_kl", _async_kl, (3,)),
)


class HealthStop(UserError):
    """An alarm under ``--on-alarm stop`` (or a non-finite figure): the state is saved; exit code 4."""

    exit_code = STOP_EXIT_CODE


class Rollback(Exception):
    """Raised to run the stage again from ``state`` (now ``latest``), learning rates times ``lr_scale`` (the total
    scale since the run began) and ``rollbacks`` done; the stage command catches it."""

    def __init__(self, state: Path, lr_scale: float, rollbacks: int):
        super().__init__(f"rollback to {state}")
        self.state, self.lr_scale, self.rollbacks = state, lr_scale, rollbacks


RESTART = "rollback.json"  # in checkpoints/: the state a rollback made latest, and the scale and count after it


def write_restart(output_dir: Path, rollback: Rollback) -> None:
    """The rollback's decision beside the states it rearranged: the run that resumes ``rollback.state`` next (in
    this process or a later ``--resume``) trains on with these learning rates and this rollback count."""
    from dschat.training.resume import checkpoint_root

    atomic_write_text(checkpoint_root(output_dir) / RESTART, json.dumps(
        {"state": rollback.state.name, "lr_scale": rollback.lr_scale, "rollbacks": rollback.rollbacks}) + "\n")


def read_restart(output_dir: Path, resumed: Path | None) -> dict[str, Any] | None:
    """The decision ``write_restart`` left for the state ``resumed``, or None (no rollback led to that state)."""
    from dschat.training.resume import checkpoint_root

    if resumed is None:
        return None
    try:
        decision = json.loads((checkpoint_root(output_dir) / RESTART).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return decision if isinstance(decision, dict) and decision.get("state") == Path(resumed).name else None


class HealthMonitor:
    """The checks of one stage (1, 2 or 3) with ``args``; ``observe`` every step's metrics and every evaluation's,
    then ``respond`` once per step (after the step is counted)."""

    def __init__(self, args: HealthArgs, stage: int, output_dir: str | Path, context: Context | None = None,
                 log: Callable[[str], None] = print, tracker: Any = None, checks: Iterable[Check] = CHECKS):
        self.args, self.stage, self.dir, self.log, self.tracker = args, stage, Path(output_dir), log, tracker
        self.context = context or Context()
        self.checks = [c for c in checks if stage in c.stages and
                       (c.threshold is None or getattr(args, c.threshold, 0) > 0)]
        self.history = History()
        self.quiet_until: dict[str, int] = {}
        self.pending: list[Alarm] = []
        self.alarms: list[Alarm] = []  # every alarm of this run (a resumed run starts with health.jsonl's)
        # what a rollback carried over (also kept in each state, so a later --resume keeps the lower rates)
        self.lr_scale, self.rollbacks = 1.0, 0

    # ------------------------------------------------------------------ state kept in training states
    def state_dict(self) -> dict[str, Any]:
        """What a training state keeps of the monitor (JSON): the rollback count and learning-rate scale, every
        figure it has observed (the trend checks' windows and baselines) and each check's quiet window."""
        return {"lr_scale": self.lr_scale, "rollbacks": self.rollbacks, "history": self.history.state_dict(),
                "quiet_until": dict(self.quiet_until)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lr_scale, self.rollbacks = float(state.get("lr_scale", 1.0)), int(state.get("rollbacks", 0))
        self.history.load_state_dict(state.get("history") or {})
        self.quiet_until = {str(k): int(v) for k, v in (state.get("quiet_until") or {}).items()}

    def resume(self, state: dict[str, Any] | None, engines: dict[str, Any], resumed: Path | None = None) -> None:
        """After the loop restored the state ``resumed`` (``state`` its trainer fields): the monitor as it was
        when that state was saved; when a rollback made it latest (``read_restart``), the scale and count that
        rollback decided, the restored engines' learning rates scaled to match. The alarms fired so far (every
        one of the run, those of rolled-back steps too) are reloaded from ``health.jsonl`` for ``eval.json``."""
        self.load_state_dict((state or {}).get("health") or {})
        restart = read_restart(self.dir, resumed) if E.is_main() else None
        restart = E.broadcast_object(restart) if E.world_size() > 1 else restart
        if restart:
            target = float(restart["lr_scale"])
            scale_learning_rates(engines, target / self.lr_scale)
            self.lr_scale, self.rollbacks = target, int(restart["rollbacks"])
            self.log(f"rolled back to {restart['state']}: learning rates x{target:g} from here "
                     f"(rollback {self.rollbacks} of {self.args.max_rollbacks})")
        path = self.dir / "health.jsonl"
        for record in read_jsonl_rows(path)[0] if path.exists() else []:
            try:
                self.alarms.append(Alarm(**record))
            except TypeError:
                continue

    # ------------------------------------------------------------------ checks
    def observe(self, step: int, row: dict[str, Any]) -> list[Alarm]:
        """Add a row of metrics (training or ``eval/``) and run the checks; the alarms wait for ``respond``."""
        self.history.add(step, row)
        fired = []
        for check in self.checks:
            if self.quiet_until.get(check.name, -1) >= step:
                continue
            hit = check.fn(step, self.history, self.args, self.context)
            if hit is None:
                continue
            metric, value, threshold, message, since = hit
            fired.append(Alarm(step, check.name, metric, float(value), float(threshold), message, int(since)))
            self.quiet_until[check.name] = step + self.args.alarm_window
        self.pending.extend(fired)
        return fired

    # ------------------------------------------------------------------ actions
    def respond(self, loop: Any, final: bool = False) -> None:
        """Act on the alarms observed since the last call (collective: rank 0's alarms decide). ``loop`` is the
        stage's ``ResumableLoop`` (its ``save_now`` writes a state of the step just counted). ``final``: after
        the last evaluation, where the final state is saved and the stage writes its outputs next, so only a
        rollback acts; the others are logged and recorded."""
        pending = E.broadcast_object(self.pending if E.is_main() else None) if E.world_size() > 1 else self.pending
        self.pending = []
        if not pending:
            return
        action = self.args.on_alarm
        if any(a.check == "nonfinite" for a in pending) and action in ("warn", "save"):
            action = "stop"
        if action == "rollback" and self.rollbacks >= self.args.max_rollbacks:
            action = "stop"
        if final and action != "rollback":  # a finished run keeps its outputs: its final alarms only warn
            action = "warn"
        for a in pending:
            a.action = action
            self._record(a)
            self.log(a.line())
        if action == "warn":
            return
        if action == "rollback":
            self._rollback(pending, loop)
        saved = loop.save_now()
        if action == "save":
            self.log(f"saved {saved} on the alarm" if saved else "no state could be saved at this step")
            return
        where = f"the state is {saved}; continue with --resume" if saved else "no state could be saved"
        raise HealthStop(f"stopped by the health alarm '{pending[0].check}' at step {pending[0].step}: "
                         f"{pending[0].message}; {where}")

    def _record(self, alarm: Alarm) -> None:
        self.alarms.append(alarm)
        if not E.is_main():
            return
        with (self.dir / "health.jsonl").open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(alarm.record()) + "\n")
        log_alarm = getattr(self.tracker, "log_alarm", None)
        if callable(log_alarm):
            log_alarm(alarm.record())

    def _rollback(self, pending: list[Alarm], loop: Any) -> None:
        since = min(a.since for a in pending)
        target = E.broadcast_object(rollback_target(self.dir, since) if E.is_main() else None)
        if target is None:
            saved = loop.save_now()
            where = f"the state is {saved}" if saved else "no state could be saved"
            raise HealthStop(f"health alarm '{pending[0].check}' at step {pending[0].step} asks for a rollback, "
                             f"but no training state was saved at or before step {since} (save one more often with "
                             f"--save-interval); {where}")
        rollback = Rollback(target, self.lr_scale * self.args.rollback_lr_scale, self.rollbacks + 1)
        if E.is_main():
            move_newer_states(self.dir, target, rollback.rollbacks)
            write_restart(self.dir, rollback)
        E.barrier()
        raise rollback

    def summary(self) -> list[dict[str, Any]]:
        """The run's alarms for ``eval.json``."""
        return [a.record() for a in self.alarms]


def scale_learning_rates(engines: dict[str, Any], factor: float) -> None:
    """Multiply every trained engine's learning rate (each parameter group, and the schedule's base rates, so the
    schedule keeps its shape) by ``factor``."""
    if factor == 1.0:
        return
    for eng in engines.values():
        for group in eng.optimizer.param_groups:
            group["lr"] *= factor
            if "initial_lr" in group:
                group["initial_lr"] *= factor
        sched = getattr(eng, "lr_scheduler", None)
        if sched is not None and hasattr(sched, "base_lrs"):
            sched.base_lrs = [lr * factor for lr in sched.base_lrs]


def rollback_target(output_dir: Path, since: int) -> Path | None:
    """The newest complete state of ``output_dir`` at or before step ``since``."""
    from dschat.training.resume import checkpoint_root

    best = None
    for p in sorted(checkpoint_root(output_dir).glob("step-*")):
        trainer = p / "trainer.json"
        if not trainer.exists():
            continue
        step = json.loads(trainer.read_text()).get("step", 0)
        if step <= since:
            best = p
    return best


def move_newer_states(output_dir: Path, target: Path, n: int) -> None:
    """Make ``target`` the latest state: the states after it move to ``checkpoints/rolled-back-<n>/`` (kept)."""
    from dschat.training.resume import checkpoint_root

    root = checkpoint_root(output_dir)
    aside = root / f"rolled-back-{n}"
    for p in sorted(root.glob("step-*")):
        if p.name > target.name:
            aside.mkdir(parents=True, exist_ok=True)
            shutil.move(str(p), str(aside / p.name))
    atomic_write_text(root / "latest", target.name + "\n")
