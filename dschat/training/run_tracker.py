"""The run's tracker, shared by every stage: metrics.jsonl, the sinks of ``--report-to`` (TensorBoard, W&B, MLflow,
Trackio: ``dschat.training.sinks``), eval.json, a progress bar."""

from __future__ import annotations

import atexit
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from dschat.config import RunArgs
from dschat.errors import ExitCode, first_line
from dschat.training.sinks import RefusedKeys, Sink, open_sinks
from dschat.utils import METRICS_FILE, write_json

DEFAULT_REPORT_TO: str = RunArgs.report_to  # TensorBoard and jsonl


def _scalar(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, int | float):
        return float(v)
    if hasattr(v, "item") and getattr(v, "numel", lambda: 0)() == 1:
        return float(v.item())
    return None


class RunTracker:
    """Writes one JSON object per logged step to ``metrics.jsonl`` and the same scalars to the trackers of
    ``--report-to`` (``dschat.training.sinks``: TensorBoard by default; W&B, MLflow, Trackio on request), with
    the health monitor's alarms (``log_alarm``) and sampled answers (``log_samples``).

    ``metrics.jsonl`` is always written (resume, the pipeline report and the benchmarks read it). ``report_to``
    and ``config`` (what each tracker records as the run's configuration) default to the output folder's
    ``args.json``, which ``begin_stage`` writes first; without one, TensorBoard and jsonl, as before the flag.
    The run's name in the trackers is the output folder's name.

    Only the main rank writes; other ranks get a tracker that does nothing, so loops need no rank checks. Every
    external run ends when the process does: ``close`` (the stages call it in a ``finally``), else an exit
    handler that ends it FAILED.
    """

    def __init__(self, output_dir: str | Path, enabled: bool, total_steps: int, progress: bool = True,
                 desc: str = "train", report_to: str | None = None, config: dict[str, Any] | None = None):
        self.dir = Path(output_dir)
        self.enabled = enabled
        self.start = time.time()
        self._sinks: list[Sink] = []
        self._bar = None
        self._jsonl = None
        if not enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        args = self._args() if report_to is None or config is None else {}
        report_to = report_to or args.get("report_to") or DEFAULT_REPORT_TO
        self._jsonl = (self.dir / METRICS_FILE).open("a", encoding="utf-8")
        self._sinks = open_sinks(report_to, self.dir, self.dir.resolve().name, args if config is None else config)
        atexit.register(self._at_exit)
        for sink in self._sinks:
            if getattr(sink, "where", None):  # W&B says where itself
                self.message(f"{sink.name}: {sink.where}")
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, desc=desc, dynamic_ncols=True, file=sys.stderr,
                             mininterval=1.0)

    def _args(self) -> dict[str, Any]:
        """The run's ``args.json`` (written by ``begin_stage``), or nothing."""
        try:
            args = json.loads((self.dir / "args.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return args if isinstance(args, dict) else {}

    def _each(self, call: str, *args: Any) -> None:
        """``sink.<call>(*args)`` on every tracker. A tracker that fails mid-run is dropped with one line: logging
        never stops training, and ``metrics.jsonl`` keeps everything."""
        for sink in list(self._sinks):
            try:
                getattr(sink, call)(*args)
            except RefusedKeys as e:  # the sink logged the rest and skips these from now on
                self.message(f"{sink.name}: refused {', '.join(e.keys)} ({e.why}); not logged there from now on "
                             "(metrics.jsonl has them)")
            except Exception as e:  # noqa: BLE001 - whatever the library raised
                self._sinks.remove(sink)
                self.message(f"{sink.name}: logging failed ({first_line(e)}); it is off for the rest of the run "
                             "(metrics.jsonl has every row)")

    def log(self, step: int, metrics: dict[str, Any], prefix: str = "") -> None:
        if not self.enabled:
            return
        from dschat.diskfull import disk_full_guard

        with disk_full_guard("the metrics log", self.dir / METRICS_FILE):
            self._log(step, metrics, prefix)

    def _log(self, step: int, metrics: dict[str, Any], prefix: str) -> None:
        row: dict[str, Any] = {"step": step, "time": round(time.time() - self.start, 3)}
        scalars: dict[str, float] = {}
        for k, v in metrics.items():
            s = _scalar(v)
            row[prefix + k] = s if s is not None else v
            if s is not None and math.isfinite(s):
                scalars[prefix + k] = s
        if scalars:
            self._each("log", step, scalars)
        assert self._jsonl is not None
        self._jsonl.write(json.dumps(row, ensure_ascii=False) + "\n")
        self._jsonl.flush()

    def log_alarm(self, record: dict[str, Any]) -> None:
        """A health alarm (``step``, ``check``, ``metric``, ``value``, ``threshold``, ``action``, ``message``) to
        every tracker but jsonl (the health monitor writes ``health.jsonl`` itself)."""
        if self.enabled:
            self._each("alarm", dict(record))

    def log_samples(self, step: int, rows: list[dict[str, Any]] | None) -> None:
        """Sampled answers (``prompt``, ``answer``, ``reward``) of an evaluation as a table, to every tracker but
        jsonl."""
        if self.enabled and rows:
            self._each("samples", step, list(rows))

    def advance(self, n: int = 1, **postfix: Any) -> None:
        if self._bar is not None:
            self._bar.update(n)
            if postfix:
                self._bar.set_postfix({k: f"{v:.4g}" if isinstance(v, float) else v for k, v in postfix.items()},
                                      refresh=False)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self, status: str | None = None) -> None:
        """End every tracker's run as ``status`` (``sinks.STATUSES``); by default as the exception on its way out
        says when called from a ``finally`` (``exit_status``)."""
        if status is None:
            status = exit_status(sys.exc_info()[1])
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._each("close", status)
        self._sinks = []
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None


    def _at_exit(self) -> None:
        """The process is exiting with a run still open (an error before the stage's ``finally``, a hung step):
        it ends FAILED rather than RUNNING for ever."""
        if self._sinks:
            self.close("FAILED")


def exit_status(error: BaseException | None) -> str:
    """How a run ends when ``error`` is on its way out: FINISHED (none), KILLED (stopped with a state: a health
    alarm, a reward server down, Ctrl-C; or a rollback, after which the same run goes on), FAILED (anything else)."""
    if error is None:
        return "FINISHED"
    health = sys.modules.get("dschat.training.health")  # not imported: no rollback can be on its way
    rollback = health is not None and isinstance(error, health.Rollback)
    stopped = getattr(error, "exit_code", None) in (ExitCode.STOPPED, ExitCode.INTERRUPTED)
    return "KILLED" if stopped or rollback or isinstance(error, KeyboardInterrupt) else "FAILED"


def write_eval(output_dir: str | Path, metrics: dict[str, Any]) -> None:
    """eval.json: the stage's final metrics, with the run's peak memory per phase (``memory.summary``)."""
    from dschat.training import memory

    peaks = memory.summary()
    write_json(Path(output_dir) / "eval.json", {**metrics, "memory": peaks} if peaks else metrics)
