"""Pictures of a run (``dschat report``): the curves of ``metrics.jsonl``, the before/after figures of ``eval.json``
and the alarms of ``health.jsonl``, as PNGs and one self-contained HTML page.

A folder is a stage's output folder (it holds ``metrics.jsonl``) or a pipeline's (its stage subfolders do); a
pipeline gets one section per stage. Several folders are compared: each plot draws one line per folder, labelled
with the folder's name. A running job's folder works too: a half-written last line of ``metrics.jsonl`` is
skipped, and a missing ``eval.json`` only leaves its table out.

Plots are drawn on ``matplotlib.figure.Figure`` with the Agg canvas, never through pyplot, so nothing global
(a backend, open figures) is touched and any process may call this. The page embeds each PNG as a base64 data URI
and its CSS inline: it opens anywhere, offline, from a mail attachment.
"""

from __future__ import annotations

import base64
import html
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dschat.errors import UserError
from dschat.utils import METRICS_FILE, atomic_write_text, read_jsonl_rows

__all__ = ["PLOTS", "Plot", "Run", "Section", "default_out", "load_run", "read_jsonl_rows", "sections_of",
           "write_report"]

REPORT_DIR = "report"  # the default output, inside the (first) folder reported on
PAGE = "report.html"
# health.jsonl's actions, drawn in these colours (Okabe-Ito, readable by the colour-blind)
ACTION_COLOURS = {"warn": "#e69f00", "save": "#0072b2", "stop": "#d55e00", "rollback": "#cc79a7"}
OTHER_ACTION_COLOUR = "#555555"
MAX_ALARM_LABELS = 8  # per plot; further alarms are drawn as lines without a label (the page's table lists all)
LOG_SPAN = 20.0  # a log axis only for values this far apart: over a narrower range it only hides the changes
SMOOTH_FROM = 30  # a training curve with this many points or more is drawn raw (faint) and smoothed


@dataclass(frozen=True)
class Plot:
    """One picture: the metrics it draws (exact keys, or ``prefix/*`` for every key under a prefix) on one axis.
    ``eval/`` keys are drawn as points (with error bars where ``<key>_se`` exists), the rest as lines. ``log``:
    a logarithmic y axis when every value is positive and they span more than a factor ``LOG_SPAN``; ``smooth``:
    a long noisy curve is drawn faint with its moving average over it."""

    name: str  # the PNG's file stem
    title: str
    keys: tuple[str, ...]
    ylabel: str = ""
    log: bool = False
    smooth: bool = True


MEMORY_PHASES = ("train", "eval", "generate", "experience", "train_actor", "train_critic")
MEMORY_FIGURES = ("peak_rss", "peak_allocated", "peak_reserved", "device_used")
PLOTS: tuple[Plot, ...] = (
    Plot("loss", "Loss", ("train/loss", "eval/loss", "train/ce", "train/kd", "eval/kd", "train/unsup_loss")),
    Plot("actor_loss", "Actor (policy) loss", ("train/actor_loss",)),
    Plot("critic_loss", "Critic (value) loss", ("train/critic_loss",)),
    Plot("perplexity", "Held-out perplexity", ("eval/perplexity",), "perplexity", log=True),
    Plot("reward", "Reward", ("train/reward", "eval/reward"), "reward"),
    Plot("reward_sources", "Reward by source", ("train/reward/*", "eval/reward/*"), "reward"),
    Plot("kl", "KL to the reference policy", ("train/kl", "eval/kl", "train/approx_kl_old_new"), "KL (nats)"),
    Plot("kl_per_token", "KL to the reference policy per token", ("train/kl_per_token", "eval/kl_per_token"),
         "KL (nats per token)"),
    Plot("entropy", "Entropy", ("train/entropy", "eval/entropy"), "nats per token"),
    Plot("answer_length", "Answer length", ("train/answer_length", "eval/answer_length"), "tokens"),
    Plot("eos_rate", "EOS rate (answers that ended)", ("train/eos_rate", "eval/eos_rate"), "share"),
    Plot("grad_norm", "Gradient norm", ("train/grad_norm", "train/actor_grad_norm", "train/critic_grad_norm"),
         "norm", log=True, smooth=False),  # a spike is the point
    Plot("accuracy", "Preference accuracy", ("train/accuracy", "eval/accuracy", "train/implicit_accuracy",
                                             "eval/implicit_accuracy", "eval/sampled_implicit_accuracy",
                                             "eval/onpolicy_implicit_accuracy"), "share of pairs"),
    Plot("scores", "Chosen and rejected scores", ("train/chosen_score", "train/rejected_score", "eval/chosen_score",
                                                  "eval/rejected_score", "eval/margin", "train/rewards_chosen",
                                                  "train/rewards_rejected", "eval/rewards_chosen",
                                                  "eval/rewards_rejected", "train/implicit_margin",
                                                  "eval/implicit_margin"), "score"),
    Plot("clip", "Clipped fraction", ("train/actor_clip_frac", "train/critic_clip_frac", "train/clip_ratio"),
         "share"),
    Plot("lr", "Learning rate", ("train/lr",), "learning rate", smooth=False),
    Plot("throughput", "Throughput", ("time/tokens_per_s", "train/tokens_per_s", "time/pairs_per_s"), "per second"),
    # dschat.training.memory's figures: per phase, the peak RSS (CPU) or allocated, reserved and device total (CUDA)
    Plot("memory", "Peak memory per phase", tuple(f"memory/{phase}_{figure}_mib" for phase in MEMORY_PHASES
                                                  for figure in MEMORY_FIGURES), "MiB", smooth=False),
)
BEFORE_AFTER = "reward_before_after"  # the PNG of eval.json's reward before and after training


# ------------------------------------------------------------------------------------------------ reading
def _read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object file, or None when it is absent or unreadable (being written, say)."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def _number(v: Any) -> float | None:
    """A metric's value as a float (non-finite ones as NaN: a gap in the line), or None when it is no number."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    v = float(v)
    return v if math.isfinite(v) else math.nan


@dataclass
class Run:
    """One stage's output folder as read: every metric as step -> value (a step logged twice, as after a resume,
    keeps the later value), ``eval.json``, ``args.json`` and the alarms of ``health.jsonl``."""

    folder: Path
    label: str
    series: dict[str, dict[int, float]] = field(default_factory=dict)
    eval: dict[str, Any] | None = None
    args: dict[str, Any] = field(default_factory=dict)
    alarms: list[dict[str, Any]] = field(default_factory=list)
    bad_lines: int = 0  # unreadable lines of metrics.jsonl
    last_step: int | None = None
    last_time: float | None = None

    def keys_matching(self, patterns: tuple[str, ...]) -> list[str]:
        """This run's metric keys that ``patterns`` name, in the patterns' order (``prefix/*``: sorted)."""
        out: list[str] = []
        for p in patterns:
            found = sorted(k for k in self.series if k.startswith(p[:-1])) if p.endswith("/*") else \
                [p] if p in self.series else []
            out += [k for k in found if k not in out and not k.endswith("_se")]
        return out

    @property
    def non_finite(self) -> int:
        return sum(1 for s in self.series.values() for v in s.values() if math.isnan(v))


def load_run(folder: Path, label: str) -> Run:
    """Read one stage's output folder. Raises UserError when it holds no ``metrics.jsonl``."""
    path = folder / METRICS_FILE
    if not path.is_file():
        raise UserError(f"{folder}: no metrics.jsonl (not a dschat output folder, or its run has not logged yet)")
    rows, bad = read_jsonl_rows(path)
    run = Run(folder=folder, label=label, bad_lines=bad, eval=_read_json(folder / "eval.json"),
              args=_read_json(folder / "args.json") or {})
    for row in rows:
        step = row.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            run.bad_lines += 1
            continue
        run.last_step = step if run.last_step is None else max(run.last_step, step)
        if isinstance(row.get("time"), int | float):
            run.last_time = float(row["time"])
        for k, v in row.items():
            x = _number(v)
            if k not in ("step", "time") and x is not None:
                run.series.setdefault(k, {})[step] = x
    health = folder / "health.jsonl"
    alarms = read_jsonl_rows(health)[0] if health.is_file() else (run.eval or {}).get("alarms")
    if isinstance(alarms, list):  # eval.json's copy of them where health.jsonl is gone
        run.alarms = [a for a in alarms if isinstance(a, dict) and isinstance(a.get("step"), int)
                      and not isinstance(a.get("step"), bool)]
    return run


@dataclass
class Section:
    """A part of the page: one stage (``title`` is its folder name in a pipeline; empty for stage folders) and
    the runs compared in it, one per folder given."""

    title: str
    runs: list[Run]


def _labels(folders: list[Path]) -> list[str]:
    """Short distinct names: each folder's name, or as many trailing path parts as tell them apart."""
    parts = [f.resolve().parts for f in folders]
    for k in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-k:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(f) for f in folders]  # the same folder twice


def _stage_folders(folder: Path) -> list[Path]:
    return sorted(d for d in folder.iterdir() if d.is_dir() and (d / METRICS_FILE).is_file())


def sections_of(folders: list[Path]) -> list[Section]:
    """The page's sections for the folders given: all stage folders (one section, a run per folder) or all
    pipeline folders (a section per stage folder name, in name order: step1 before step2 before step3)."""
    if not folders:
        raise UserError("give at least one output folder")
    kinds = []
    for f in folders:
        if not f.is_dir():
            raise UserError(f"{f}: no such folder")
        if (f / METRICS_FILE).is_file():
            kinds.append("stage")
        elif _stage_folders(f):
            kinds.append("pipeline")
        else:
            raise UserError(f"{f}: no metrics.jsonl, here or in a stage subfolder (not a dschat output or "
                            "pipeline folder, or nothing has been logged yet)")
    if len(set(kinds)) > 1:
        mixed = ", ".join(f"{f} ({k})" for f, k in zip(folders, kinds, strict=True))
        raise UserError(f"compare stage folders with stage folders and pipeline folders with pipeline folders, not "
                        f"both: {mixed}")
    labels = _labels(folders)
    if kinds[0] == "stage":
        return [Section("", [load_run(f, label) for f, label in zip(folders, labels, strict=True)])]
    names = sorted({d.name for f in folders for d in _stage_folders(f)})
    sections = []
    for name in names:
        runs = [load_run(f / name, label) for f, label in zip(folders, labels, strict=True)
                if (f / name / METRICS_FILE).is_file()]
        sections.append(Section(name, runs))
    return sections


# ------------------------------------------------------------------------------------------------ drawing
def _smooth(values: list[float]) -> list[float]:
    """A centred moving average over about an 80th of the points (at least 3; no lag, unlike an exponential
    one), NaNs left out of each window."""
    import numpy as np

    v = np.asarray(values, dtype=float)
    ok = ~np.isnan(v)
    sums = np.concatenate([[0.0], np.cumsum(np.where(ok, v, 0.0))])
    counts = np.concatenate([[0], np.cumsum(ok)])
    half = max(1, len(v) // 160)
    i = np.arange(len(v))
    lo, hi = np.clip(i - half, 0, len(v)), np.clip(i + half + 1, 0, len(v))
    n = counts[hi] - counts[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, (sums[hi] - sums[lo]) / np.maximum(n, 1), np.nan).tolist()


def _metric(key: str) -> str:
    """What a key measures, whichever its split: ``train/kl`` and ``eval/kl`` are both ``kl``."""
    return key.split("/", 1)[-1]


def _short(key: str) -> str:
    """A legend's name for a metric key: a user reward function's path shortened to its file and function."""
    head, _, rest = key.partition("/reward/")
    if rest and "/" in rest:
        return f"{head}/reward/{rest.rsplit('/', 1)[-1]}"
    return key


def _alarm_matches(alarm: dict[str, Any], keys: list[str]) -> bool:
    metric = str(alarm.get("metric") or "")
    return any(metric in (k, k.split("/", 1)[-1]) for k in keys)


def _alarms_for(run: Run, keys: list[str], all_keys: set[str]) -> list[dict[str, Any]]:
    """The run's alarms to mark on a plot of ``keys``: those on its metrics, and those on a metric that no plot
    draws (marked everywhere, so no alarm goes unseen)."""
    return [a for a in run.alarms if _alarm_matches(a, keys) or not _alarm_matches(a, list(all_keys))]


def _figure(title: str, ylabel: str) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 3.8), dpi=100)
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=11)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")
LINESTYLES = ("-", "--", ":", "-.")


def draw_plot(plot: Plot, runs: list[Run], path: Path, plotted_keys: set[str]) -> bool:
    """Draw ``plot`` for ``runs`` into ``path`` (PNG). One run: a colour per metric; several: a colour per run
    and a line style per metric. Returns False (and writes nothing) when no run has any of its metrics."""
    keys_of = {id(run): run.keys_matching(plot.keys) for run in runs}
    if not any(keys_of.values()):
        return False
    fig, ax = _figure(plot.title, plot.ylabel)
    several = len(runs) > 1
    keys_in_plot = list(dict.fromkeys(k for ks in keys_of.values() for k in ks))
    metrics = list(dict.fromkeys(_metric(k) for k in keys_in_plot))  # train/x and eval/x share a colour (style)
    low, high = math.inf, 0.0  # the positive values' range (low <= 0: not all positive)
    for r, run in enumerate(runs):
        for key in keys_of[id(run)]:
            m = metrics.index(_metric(key))
            colour = COLOURS[(r if several else m) % len(COLOURS)]
            style = LINESTYLES[m % len(LINESTYLES)] if several else "-"
            name = _short(key)
            label = (f"{run.label}: {name}" if len(keys_in_plot) > 1 else run.label) if several else name
            steps = sorted(run.series[key])
            values = [run.series[key][s] for s in steps]
            finite = [v for v in values if not math.isnan(v)]
            low, high = min([low, *finite]), max([high, *finite])
            if key.startswith("eval/"):
                se = run.series.get(f"{key}_se", {})
                errors = [se.get(s, math.nan) for s in steps]
                line = {"color": colour, "linestyle": ":" if not several else style, "marker": "o",
                        "markersize": 4, "linewidth": 0.9}
                if any(not math.isnan(e) for e in errors):
                    ax.errorbar(steps, values, yerr=[0.0 if math.isnan(e) else e for e in errors], capsize=3,
                                label=f"{label} ± s.e.", **line)
                else:
                    ax.plot(steps, values, label=label, **line)
            elif plot.smooth and len(steps) >= SMOOTH_FROM:
                ax.plot(steps, values, color=colour, linestyle=style, linewidth=0.8, alpha=0.25)
                ax.plot(steps, _smooth(values), color=colour, linestyle=style, linewidth=1.6, label=label)
            else:
                ax.plot(steps, values, color=colour, linestyle=style, linewidth=1.4, marker="." if len(steps) < 10
                        else None, label=label)
    if plot.log and 0 < low and high > LOG_SPAN * low:
        ax.set_yscale("log")
    _mark_alarms(ax, runs, keys_of, plotted_keys, several)
    ax.set_xlabel("step")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, format="png")
    return True


def _mark_alarms(ax: Any, runs: list[Run], keys_of: dict[int, list[str]], plotted_keys: set[str],
                 several: bool) -> None:
    """A vertical line where each alarm fired, coloured by its action, with a label (check and action) for the
    first ``MAX_ALARM_LABELS`` distinct ones."""
    from matplotlib.transforms import blended_transform_factory

    top = blended_transform_factory(ax.transData, ax.transAxes)
    seen: set[tuple[str, int, str, str]] = set()
    for run in runs:
        for alarm in _alarms_for(run, keys_of[id(run)], plotted_keys):
            action = str(alarm.get("action") or "")
            mark = (run.label, alarm["step"], str(alarm.get("check") or ""), action)
            if mark in seen:
                continue
            colour = ACTION_COLOURS.get(action, OTHER_ACTION_COLOUR)
            ax.axvline(alarm["step"], color=colour, linestyle="--", linewidth=1.5)
            if len(seen) < MAX_ALARM_LABELS:
                text = f"{mark[2]} ({action})" + (f" {run.label}" if several else "")
                ax.annotate(text, (alarm["step"], 0.98), xycoords=top, xytext=(-3, 0), textcoords="offset points",
                            rotation=90, va="top", ha="right", fontsize=7, color=colour)
            seen.add(mark)


def _before_after(ev: dict[str, Any]) -> list[tuple[str, float, float, float | None, float | None, str]]:
    """eval.json's rewards before and after training: (source, before, after, before s.e., after s.e., gain
    text), the total first, then each reward function's."""
    out = []
    for name, prefix in [("reward", "reward")] + [(str(f), f"reward_{f}") for f in ev.get("reward_funcs") or []]:
        b, a = ev.get(f"{prefix}_before"), ev.get(f"{prefix}_after")
        if not (isinstance(b, int | float) and isinstance(a, int | float)):
            continue
        se_b, se_a = ev.get(f"{prefix}_before_se"), ev.get(f"{prefix}_after_se")
        gain, gain_se = ev.get(f"{prefix}_gain", a - b), ev.get(f"{prefix}_gain_se")
        text = f"{gain:+.3f}" + (f" ± {gain_se:.3f}" if isinstance(gain_se, int | float) else "")
        out.append((name, float(b), float(a), se_b if isinstance(se_b, int | float) else None,
                    se_a if isinstance(se_a, int | float) else None, text))
    return out


def draw_before_after(runs: list[Run], path: Path) -> bool:
    """Bars of the reward before and after training (eval.json) with their standard errors, and the gain ± its
    paired standard error above each pair. Returns False when no run has them."""
    groups = [(run, row) for run in runs for row in _before_after(run.eval or {})]
    if not groups:
        return False
    fig, ax = _figure("Reward before and after training (held-out prompts)", "reward")
    several = len(runs) > 1
    xs = list(range(len(groups)))
    width = 0.38
    for i, (_run, (_name, b, a, se_b, se_a, text)) in enumerate(groups):
        ax.bar(i - width / 2, b, width, yerr=se_b, capsize=4, color="#9e9e9e", label="before" if i == 0 else None)
        ax.bar(i + width / 2, a, width, yerr=se_a, capsize=4, color="#1f77b4", label="after" if i == 0 else None)
        ax.annotate(text, (i, max(a + (se_a or 0), b + (se_b or 0))), textcoords="offset points", xytext=(0, 4),
                    ha="center", fontsize=8)
    ax.set_xticks(xs, [f"{run.label}\n{name}" if several else name for run, (name, *_rest) in groups], fontsize=8)
    ax.axhline(0, color="black", linewidth=0.6)
    ax.margins(y=0.15)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, format="png")
    return True


# ------------------------------------------------------------------------------------------------ the page
def _fmt(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return str(v)
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def key_figures(ev: dict[str, Any]) -> list[tuple[str, str]]:
    """eval.json's figures as (name, text): each before/after pair as ``before ± s.e. → after ± s.e. (gain ±
    s.e.)`` first, then the other scalars (lists of names joined; the data sources' details left out)."""
    used: set[str] = set()
    pairs: list[tuple[str, str]] = []
    for key in ev:
        if not key.endswith("_before") or key in used:
            continue
        base = key[: -len("_before")]
        after_key = f"{base}_after" if f"{base}_after" in ev else base if base in ev else None
        b, a = ev[key], ev.get(after_key) if after_key else None
        if not isinstance(b, int | float) or not isinstance(a, int | float):
            continue
        parts = []
        for value, se_key in ((b, f"{base}_before_se"), (a, f"{base}_after_se")):  # eval.json's one spelling
            se = ev[se_key] if isinstance(ev.get(se_key), int | float) else None
            parts.append(_fmt(value) + (f" ± {_fmt(se)}" if se is not None else ""))
            used.add(se_key)
        text = " → ".join(parts)
        gain, gain_se = ev.get(f"{base}_gain"), ev.get(f"{base}_gain_se")
        if isinstance(gain, int | float) or isinstance(gain_se, int | float):
            gain = gain if isinstance(gain, int | float) else a - b
            text += f" (gain {gain:+.4g}" + (f" ± {_fmt(gain_se)}" if isinstance(gain_se, int | float) else "") + ")"
        used.update({key, after_key, f"{base}_gain", f"{base}_gain_se"})
        pairs.append((base, text))
    rest = []
    for key, v in ev.items():
        if key in used or isinstance(v, dict) or v is None or v == []:
            continue
        if isinstance(v, list):
            if not all(isinstance(x, str | int | float) for x in v):
                continue  # the data sources: a list of records
            v = ", ".join(_fmt(x) for x in v)
        rest.append((key, _fmt(v)))
    return pairs + rest


CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 24px; color: #222;
       background: #fff; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 18px; border-bottom: 2px solid #1f77b4;
padding-bottom: 4px; margin-top: 32px; }
h3 { font-size: 14px; margin: 16px 0 6px; }
.meta { color: #555; font-size: 13px; margin: 2px 0; }
table { border-collapse: collapse; font-size: 13px; margin: 6px 0 12px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f0f4f8; } td.num { font-variant-numeric: tabular-nums; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(440px, 1fr)); gap: 12px; max-width: 1800px; }
figure { margin: 0; border: 1px solid #ddd; padding: 4px; background: #fff; }
figure img { display: block; width: 100%; height: auto; }
figcaption { font-size: 12px; color: #555; text-align: center; }
.alarm-warn { color: #a66f00; } .alarm-stop, .alarm-rollback { color: #b2400a; font-weight: bold; }
.note { background: #fff8e1; border-left: 4px solid #e69f00; padding: 4px 8px; font-size: 13px; }
"""


def _e(v: Any) -> str:
    return html.escape(str(v), quote=True)


def _run_line(run: Run) -> str:
    stage = run.args.get("stage", "")
    algo = run.args.get("algo")
    bits = [f"<b>{_e(run.label)}</b>", _e(run.folder)]
    if stage:
        bits.append(f"stage {_e(stage)}" + (f", algo {_e(algo)}" if algo else ""))
    if run.last_step is not None:
        bits.append(f"last logged step {run.last_step}" + (f" at {run.last_time:.0f}s" if run.last_time else ""))
    bits.append("finished (eval.json)" if run.eval is not None else "no eval.json: running, stopped or failed")
    notes = []
    if run.bad_lines:
        notes.append(f"{run.bad_lines} unreadable line(s) of metrics.jsonl skipped (a running job's last line "
                     "is often half-written)")
    if run.non_finite:
        notes.append(f"{run.non_finite} non-finite value(s) (NaN/inf) left as gaps in the curves")
    text = f'<p class="meta">{" · ".join(bits)}</p>'
    return text + "".join(f'<p class="note">{_e(n)}</p>' for n in notes)


def _figures_table(runs: list[Run]) -> str:
    figures = [(run, dict(key_figures(run.eval))) for run in runs if run.eval is not None]
    if not figures:
        return ""
    names = list(dict.fromkeys(name for run in runs if run.eval for name, _ in key_figures(run.eval)))
    head = "".join(f"<th>{_e(run.label)}</th>" for run, _ in figures) if len(runs) > 1 else "<th>value</th>"
    rows = "".join(f"<tr><th>{_e(n)}</th>" + "".join(f'<td class="num">{_e(f.get(n, "-"))}</td>' for _, f in figures)
                   + "</tr>" for n in names)
    return f"<h3>Final figures (eval.json)</h3><table><tr><th>figure</th>{head}</tr>{rows}</table>"


def _alarms_table(runs: list[Run]) -> str:
    rows = []
    for run in runs:
        for a in sorted(run.alarms, key=lambda a: a["step"]):
            action = str(a.get("action") or "")
            cells = ([run.label] if len(runs) > 1 else []) + [a["step"], a.get("check", ""), a.get("metric", ""),
                                                              _fmt(a.get("value", "")), _fmt(a.get("threshold", "")),
                                                              action, a.get("message", "")]
            rows.append(f'<tr class="alarm-{_e(action)}">' + "".join(f"<td>{_e(c)}</td>" for c in cells) + "</tr>")
    if not rows:
        return ""
    head = (["run"] if len(runs) > 1 else []) + ["step", "check", "metric", "value", "threshold", "action", "message"]
    return ("<h3>Alarms (health.jsonl)</h3><table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"
            + "".join(rows) + "</table>")


def _section_html(section: Section, images: list[tuple[str, bytes]]) -> str:
    parts = [f"<section><h2>{_e(section.title)}</h2>" if section.title else "<section>"]
    parts += [_run_line(run) for run in section.runs]
    parts.append(_figures_table(section.runs))
    parts.append(_alarms_table(section.runs))
    if images:
        figures = "".join(f'<figure><img alt="{_e(name)}" src="data:image/png;base64,'
                          f'{base64.b64encode(data).decode("ascii")}"><figcaption>{_e(name)}.png</figcaption></figure>'
                          for name, data in images)
        parts.append(f'<div class="grid">{figures}</div>')
    else:
        parts.append('<p class="note">no metrics to plot yet</p>')
    parts.append("</section>")
    return "\n".join(parts)


def default_out(folders: list[Path]) -> Path:
    """``O/report`` for one folder; several need ``--out`` (a comparison belongs to none of them)."""
    if len(folders) != 1:
        raise UserError("a comparison of several folders needs --out DIR (where to write its pictures and page)")
    return folders[0] / REPORT_DIR


def write_report(folders: list[Path], out: Path | None = None) -> Path:
    """Write the PNGs and the page (``report.html``) for ``folders`` into ``out`` (default ``O/report``; a
    pipeline's stages in subfolders of it) and return the page's path. User mistakes (no such folder, no
    metrics) raise UserError naming the folder."""
    folders = [Path(f) for f in folders]
    sections = sections_of(folders)
    out = Path(out) if out is not None else default_out(folders)
    out.mkdir(parents=True, exist_ok=True)
    body = []
    for section in sections:
        where = out / section.title if section.title else out
        where.mkdir(parents=True, exist_ok=True)
        images = []
        plotted_keys = {k for run in section.runs for p in PLOTS for k in run.keys_matching(p.keys)}
        for plot in PLOTS:
            path = where / f"{plot.name}.png"
            if draw_plot(plot, section.runs, path, plotted_keys):
                images.append((plot.name, path.read_bytes()))
        path = where / f"{BEFORE_AFTER}.png"
        if draw_before_after(section.runs, path):
            images.insert(min(len(images), _after_reward(images)), (BEFORE_AFTER, path.read_bytes()))
        body.append(_section_html(section, images))
    title = "dschat report: " + ", ".join(str(f) for f in folders)
    head = [f'<p class="meta">written {time.strftime("%Y-%m-%d %H:%M:%S")}; {len(sections)} section(s)</p>']
    for f, label in zip(folders, _labels(folders), strict=True):  # a pipeline's last run: seconds per stage
        seconds = (_read_json(f / "pipeline.json") or {}).get("seconds")
        if isinstance(seconds, dict) and seconds:
            times = ", ".join(f"{_e(k)} {_fmt(v)}s" for k, v in seconds.items())
            head.append(f'<p class="meta"><b>{_e(label)}</b> pipeline.json, time per stage run: {times}</p>')
    page = (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
            f"<style>{CSS}</style></head><body><h1>{_e(title)}</h1>" + "".join(head) + "\n" + "\n".join(body)
            + "</body></html>\n")
    atomic_write_text(out / PAGE, page)
    return out / PAGE


def _after_reward(images: list[tuple[str, bytes]]) -> int:
    """Where the before/after bars go: right after the reward curves (or first)."""
    names = [name for name, _ in images]
    for name in ("reward_sources", "reward"):
        if name in names:
            return names.index(name) + 1
    return 0

