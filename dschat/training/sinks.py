"""The places ``--report-to`` sends a run's metrics besides ``metrics.jsonl``: TensorBoard, Weights & Biases, MLflow
and Trackio, one small sink each, written to by ``dschat.training.run_tracker.RunTracker`` on the main rank.

A sink gets the run's configuration (the flat dict of ``args.json``) when it opens, then every logged row's finite
scalars at their step (``log``, under names it accepts: ``metric_name``), the health monitor's alarms (``alarm``),
sampled answers as a table (``samples``), and ``close``, which ends the run FINISHED, FAILED or KILLED (stopped
with a state). A key the tracker still refuses is ``RefusedKeys``: the rest of the row was logged.

Steps go back after a resume or a rollback (the run goes on from its state, and logs those steps again): W&B logs
its own step metric (``STEP_METRIC``, ``define_metric``) so that no row is dropped, and TensorBoard's events past
the state are purged as ``metrics.jsonl`` is cut (``dschat.training.resume.truncate_metrics``).

The external libraries are imported lazily and log offline into the output folder by default: W&B in offline mode
(``O/wandb/``; ``WANDB_MODE`` chooses otherwise), MLflow to a SQLite store (``O/mlflow/``; ``MLFLOW_TRACKING_URI``
chooses otherwise), Trackio to its local store (``O/trackio/``; ``TRACKIO_DIR``, ``TRACKIO_SERVER_URL`` or
``TRACKIO_SPACE_ID`` choose otherwise). ``check_trackers`` runs before anything loads (``begin_stage``): a missing
package, or a server the environment names that does not answer, is one line and exit code 2.

Each external run's identity is kept in ``O/trackers.json``; a run resumed in the same folder (``--resume``, or a
health rollback) goes on in the same W&B, MLflow and Trackio run instead of starting another. A fresh start in the
folder removes the file.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import time
from pathlib import Path
from typing import Any, Protocol

from dschat.config import report_sinks
from dschat.errors import UserError, first_line
from dschat.utils import write_json

PROJECT = "dschat"  # the W&B project, MLflow experiment and Trackio project (each library's env vars override it)
EXTERNAL = ("wandb", "mlflow", "trackio")
PROBE_TIMEOUT_S = 5.0
SAMPLE_COLUMNS = ("step", "prompt", "answer", "reward")
SQL_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")  # MLflow stores that go through SQLAlchemy
RUN_IDS = "trackers.json"  # in the output folder: {tracker: the id of its run}, for a resumed run to continue
STEP_METRIC = "dschat/step"  # W&B's x-axis for every metric: a step logged again after a rollback is kept
STATUSES = ("FINISHED", "FAILED", "KILLED")  # how a run ends: done, an error, stopped (with a state, or Ctrl-C)


def metric_name(key: str) -> str:
    """``key`` as every tracker accepts it: letters, digits and ``_-./`` only (anything else becomes ``_``), no
    empty, leading or trailing path segment (MLflow refuses a name that a path normalisation would change)."""
    text = re.sub(r"[^\w\-./]", "_", key)
    parts = [p if p not in (".", "..") else p.replace(".", "_") for p in text.split("/") if p]
    return "/".join(parts) or "_"


class RefusedKeys(Exception):
    """A tracker refused some keys of a row (``keys``) and logged the rest; the tracker stays on."""

    def __init__(self, keys: list[str], why: str):
        super().__init__(f"refused {', '.join(keys)}: {why}")
        self.keys, self.why = keys, why


class Sink(Protocol):
    """One place metrics go; an external one may say where (``where``, printed once when the run starts) and
    which run it writes (``run_id``, kept for a resumed run)."""

    name: str

    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def alarm(self, record: dict[str, Any]) -> None: ...

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None: ...

    def close(self, status: str) -> None: ...


def alarm_text(record: dict[str, Any]) -> str:
    """One line describing a health alarm record (``step``, ``check``, ``metric``, ``value``, ``threshold``,
    ``action``, ``message``)."""
    value, threshold = record.get("value"), record.get("threshold")
    figures = f" ({record.get('metric')} = {value:.4g}, threshold {threshold:.4g})" \
        if isinstance(value, int | float) and isinstance(threshold, int | float) else ""
    action = f"; action: {record['action']}" if record.get("action") else ""
    return f"step {record.get('step')}: {record.get('message', '')}{figures}{action}"


def sample_rows(step: int, rows: list[dict[str, Any]]) -> list[list[Any]]:
    """Sampled answers (dicts with ``prompt``, ``answer``, ``reward``) as table rows of ``SAMPLE_COLUMNS``."""
    return [[step, str(r.get("prompt", "")), str(r.get("answer", "")), r.get("reward")] for r in rows]


class TensorBoardSink:
    """``O/tensorboard/``: scalars, and alarms and sampled answers as text."""

    name = "tensorboard"

    def __init__(self, output_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(output_dir / "tensorboard"))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(metric_name(k), v, step)

    def alarm(self, record: dict[str, Any]) -> None:
        self.writer.add_text(f"alarms/{record.get('check', 'alarm')}", alarm_text(record), record.get("step", 0))

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        def cell(x: Any) -> str:
            return str(x).replace("|", "\\|").replace("\n", " ")

        table = ["| prompt | answer | reward |", "|---|---|---|"]
        table += [f"| {cell(r.get('prompt', ''))} | {cell(r.get('answer', ''))} | {cell(r.get('reward'))} |"
                  for r in rows]
        self.writer.add_text("eval/samples", "\n".join(table), step)

    def close(self, status: str) -> None:
        self.writer.flush()
        self.writer.close()


class RunApiSink:
    """What W&B and Trackio share (Trackio follows W&B's run API): scalars through ``run.log``, alarms as
    ``run.alert``, sampled answers as the library's ``Table``. ``lib`` is the module; ``quiet`` wraps the calls that
    print to stdout."""

    lib: Any
    run: Any
    quiet: Any = contextlib.nullcontext

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log({metric_name(k): v for k, v in scalars.items()}, step=step)

    def alarm(self, record: dict[str, Any]) -> None:
        with self.quiet():
            self.run.alert(title=f"dschat health alarm: {record.get('check', '')}", text=alarm_text(record),
                           level=self.lib.AlertLevel.WARN)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        table = self.lib.Table(columns=list(SAMPLE_COLUMNS), data=sample_rows(step, rows))
        self.run.log({"eval/samples": table}, step=step)


class WandbSink(RunApiSink):
    """A W&B run: offline under ``O/wandb/`` unless ``WANDB_MODE`` says otherwise (``wandb sync O/wandb/offline-run-*``
    uploads it later). Alarms are W&B alerts; sampled answers a ``wandb.Table`` (``eval/samples``)."""

    name = "wandb"

    def __init__(self, output_dir: Path, run_name: str, config: dict[str, Any], resume_id: str | None = None):
        import wandb

        self.lib = wandb
        kwargs: dict[str, Any] = {"id": resume_id, "resume": "allow"} if resume_id else {}
        if not os.environ.get("WANDB_MODE"):
            kwargs["mode"] = "offline"
        if not os.environ.get("WANDB_DIR"):
            kwargs["dir"] = str(output_dir)
        settings = {} if os.environ.get("WANDB_CONSOLE") else {"console": "off"}  # dschat prints its own log
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or PROJECT,
                              name=os.environ.get("WANDB_NAME") or run_name, config=config,
                              settings=wandb.Settings(**settings), **kwargs)
        self.run_id = self.run.id  # offline, a resumed run is another offline-run-*-<id> folder; sync joins them
        # W&B drops a row whose step is below its run's current one, which is every row a resumed or rolled-back
        # run logs again: every metric is plotted against a step metric of dschat's own instead
        self.run.define_metric(STEP_METRIC)
        self.run.define_metric("*", step_metric=STEP_METRIC)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log({**{metric_name(k): v for k, v in scalars.items()}, STEP_METRIC: step})

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        table = self.lib.Table(columns=list(SAMPLE_COLUMNS), data=sample_rows(step, rows))
        self.run.log({"eval/samples": table, STEP_METRIC: step})

    def close(self, status: str) -> None:
        self.run.finish(exit_code={"FINISHED": 0, "FAILED": 1}.get(status, 255))


def mlflow_local_uri(output_dir: Path) -> str:
    """The SQLite store under ``O/mlflow/`` used when ``MLFLOW_TRACKING_URI`` is not set."""
    return "sqlite:///" + str((output_dir / "mlflow" / "mlflow.db").resolve())


def mlflow_scheme(uri: str) -> str:
    """The store kind of an MLflow tracking URI (``sqlite``, ``postgresql``, ``http``, ``file``, ...)."""
    return uri.split(":", 1)[0].split("+", 1)[0] if "://" in uri or uri.startswith("sqlite:") else "file"


class MlflowSink:
    """An MLflow run in the experiment ``dschat`` (``MLFLOW_EXPERIMENT_NAME`` overrides it): the configuration as
    parameters, scalars as metrics, alarms as ``alarms/step_<step>_<check>.json`` and sampled answers as tables
    (``samples/step_<step>.json``) among the run's artifacts. The store is ``MLFLOW_TRACKING_URI``, else SQLite
    under ``O/mlflow/`` (``mlflow ui --backend-store-uri sqlite:///O/mlflow/mlflow.db``)."""

    name = "mlflow"
    MAX_PARAMS, MAX_METRICS, MAX_PARAM_CHARS = 100, 1000, 6000  # MLflow's limits per batch and per value

    def __init__(self, output_dir: Path, run_name: str, config: dict[str, Any], resume_id: str | None = None):
        from mlflow import MlflowClient
        from mlflow.entities import Metric, Param

        self.Metric = Metric
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        local = not uri
        if local:
            (output_dir / "mlflow").mkdir(parents=True, exist_ok=True)
            uri = mlflow_local_uri(output_dir)
        self.client = MlflowClient(tracking_uri=uri)
        self.refused: set[str] = set()
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or PROJECT
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            # a database store without a server keeps artifacts in ./mlruns of wherever the command started:
            # under the output folder instead. A server (http) has an artifact store of its own
            artifacts = (output_dir / "mlflow" / "artifacts").resolve().as_uri() \
                if mlflow_scheme(uri) in SQL_SCHEMES else None
            experiment_id = self.client.create_experiment(name, artifact_location=artifacts)
        self.run_id = self._resumed(resume_id)
        if self.run_id is None:
            self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
            params = [Param(k, (v if isinstance(v, str) else json.dumps(v))[:self.MAX_PARAM_CHARS])
                      for k, v in config.items()]
            for i in range(0, len(params), self.MAX_PARAMS):
                self.client.log_batch(self.run_id, params=params[i:i + self.MAX_PARAMS])
        self.where = f"run {self.run_id} in {uri}" + (f" (view: mlflow ui --backend-store-uri {uri})" if local else "")

    def _resumed(self, run_id: str | None) -> str | None:
        """The earlier run ``run_id``, running again; None when there is none (or the store no longer has it). Its
        parameters stay those it started with (MLflow refuses to change a logged parameter)."""
        if not run_id:
            return None
        try:
            self.client.get_run(run_id)
        except Exception:  # noqa: BLE001 - MLflow's "not found" differs between stores
            return None
        self.client.update_run(run_id, status="RUNNING")
        return run_id

    def log(self, step: int, scalars: dict[str, float]) -> None:
        stamp = int(time.time() * 1000)
        metrics = [self.Metric(metric_name(k), v, stamp, step) for k, v in scalars.items()
                   if metric_name(k) not in self.refused]
        refused: list[str] = []
        why = ""
        for i in range(0, len(metrics), self.MAX_METRICS):
            batch = metrics[i:i + self.MAX_METRICS]
            try:
                self.client.log_batch(self.run_id, metrics=batch)
            except Exception as e:  # noqa: BLE001 - MLflow's own error
                if not refuses(e):  # the store failed, not a name: the tracker goes
                    raise
                for m in batch:  # one by one: a name MLflow refuses goes, the others are logged
                    try:
                        self.client.log_batch(self.run_id, metrics=[m])
                    except Exception as one:  # noqa: BLE001
                        if not refuses(one):
                            raise
                        refused.append(m.key)
                        why = first_line(one)
        if refused:
            self.refused.update(refused)
            raise RefusedKeys(refused, why)

    def alarm(self, record: dict[str, Any]) -> None:
        check = re.sub(r"[^A-Za-z0-9_.-]", "_", str(record.get("check", "alarm")))
        self.client.log_dict(self.run_id, {**record, "text": alarm_text(record)},
                             f"alarms/step_{int(record.get('step', 0)):08d}_{check}.json")

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        columns = list(zip(*sample_rows(step, rows), strict=True))
        self.client.log_table(self.run_id, data={c: list(v) for c, v in zip(SAMPLE_COLUMNS, columns, strict=True)},
                              artifact_file=f"samples/step_{step:08d}.json")

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)


def refuses(e: BaseException) -> bool:
    """Whether an MLflow error refuses what was logged (a name or value), rather than failing to store it."""
    return getattr(e, "error_code", None) == "INVALID_PARAMETER_VALUE"


def import_trackio(output_dir: Path) -> Any:
    """``trackio``, its local store pointed at ``O/trackio/`` unless ``TRACKIO_DIR`` is set. Trackio reads the
    variable once, when first imported: a process keeps the first store it chose."""
    os.environ.setdefault("TRACKIO_DIR", str((output_dir / "trackio").resolve()))
    import trackio

    return trackio


class TrackioSink(RunApiSink):
    """A Trackio run in the project ``dschat``: configuration, scalars, alarms as Trackio alerts, sampled answers as
    a ``trackio.Table`` (``eval/samples``). Local store ``O/trackio/`` (``TRACKIO_DIR=O/trackio trackio show``)."""

    name = "trackio"

    def __init__(self, output_dir: Path, run_name: str, config: dict[str, Any], resume_id: str | None = None):
        trackio = import_trackio(output_dir)
        self.lib = trackio
        self.quiet = quiet_stdout
        self.run_id = resume_id or run_name  # a Trackio run is known by its name in the project
        with quiet_stdout():  # trackio prints its banner to stdout; dschat's stdout carries results only
            self.run = trackio.init(project=PROJECT, name=self.run_id, config=config, embed=False,
                                    resume="allow" if resume_id else "never")
        from trackio.utils import TRACKIO_DIR

        remote = os.environ.get("TRACKIO_SPACE_ID") or os.environ.get("TRACKIO_SERVER_URL")
        self.where = f"run {self.run_id} in " + (remote or f"{TRACKIO_DIR} (view: TRACKIO_DIR={TRACKIO_DIR} trackio "
                                                         f"show --project {PROJECT})")

    def close(self, status: str) -> None:
        with quiet_stdout():
            self.lib.finish()


@contextlib.contextmanager
def quiet_stdout() -> Any:
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def read_run_ids(output_dir: Path) -> dict[str, str]:
    """``O/trackers.json``: the external trackers' run ids of the run in ``output_dir`` (empty without one)."""
    try:
        ids = json.loads((output_dir / RUN_IDS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in ids.items() if isinstance(v, str)} if isinstance(ids, dict) else {}


def open_sinks(report_to: str, output_dir: Path, run_name: str, config: dict[str, Any]) -> list[Sink]:
    """The sinks ``--report-to`` names (jsonl is written by the tracker itself). TensorBoard missing is no error
    (it is a requirement, but logging never stops a run); a failing external tracker is one line. An external
    tracker continues the run ``O/trackers.json`` names for it, and the file is updated with the runs opened."""
    sinks: list[Sink] = []
    ids = read_run_ids(output_dir)
    for name in report_sinks(report_to):
        if name == "tensorboard":
            with contextlib.suppress(ImportError):
                sinks.append(TensorBoardSink(output_dir))
        elif name in EXTERNAL:
            cls = {"wandb": WandbSink, "mlflow": MlflowSink, "trackio": TrackioSink}[name]
            try:
                sinks.append(cls(output_dir, run_name, config, ids.get(name)))
                ids[name] = sinks[-1].run_id
            except ImportError as e:
                raise UserError(missing(name, e)) from None
            except Exception as e:  # noqa: BLE001 - the library's own error, as one line
                raise UserError(f"--report-to {name}: could not start a run: {first_line(e)}") from None
    if any(sink.name in EXTERNAL for sink in sinks):
        write_json(output_dir / RUN_IDS, ids)
    return sinks


def missing(name: str, e: ImportError) -> str:
    """The one line for a tracker whose package (or a package it needs) does not import."""
    module = (e.name or "").split(".")[0] if isinstance(e, ModuleNotFoundError) else ""
    what = f"the {name} package is not installed" if module in ("", name) else f"{name} needs {module}, not installed"
    if not isinstance(e, ModuleNotFoundError):
        what = f"{name} does not import ({first_line(e)})"
    return f"--report-to {name}: {what}; pip install \"dschat[{name}]\" (in a checkout: pip install -r " \
           f"requirements-{name}.txt) or drop {name} from --report-to"


def probe(url: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None when an HTTP server answers at ``url`` (any status), else why not."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(url, timeout=timeout).close()
    except urllib.error.HTTPError:
        return None  # it answered
    except (urllib.error.URLError, OSError, ValueError) as e:
        return str(getattr(e, "reason", None) or e)
    return None


def tracker_problem(report_to: str, output_dir: Path) -> str | None:
    """Why the trackers ``--report-to`` names cannot run here (a package missing, a configured server not
    answering within ``PROBE_TIMEOUT_S``), or None. Imports each named library; nothing is written."""
    names = [n for n in report_sinks(report_to) if n in EXTERNAL]
    for name in names:
        try:
            if name == "wandb":
                import wandb  # noqa: F401
            elif name == "mlflow":
                import mlflow  # noqa: F401
                scheme = os.environ.get("MLFLOW_TRACKING_URI", "sqlite").split(":", 1)[0].split("+", 1)[0]
                if scheme in SQL_SCHEMES:  # a database store (the local SQLite one by default) needs these two
                    import alembic  # noqa: F401
                    import sqlalchemy  # noqa: F401
            else:
                import_trackio(output_dir)
        except ImportError as e:
            return missing(name, e)
    servers: list[tuple[str, str, str]] = []  # (tracker, variable, url)
    if "wandb" in names and os.environ.get("WANDB_MODE", "offline") in ("online", "run"):
        servers.append(("wandb", "WANDB_BASE_URL", os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"))
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if "mlflow" in names and uri.startswith(("http://", "https://")):
        servers.append(("mlflow", "MLFLOW_TRACKING_URI", uri.rstrip("/") + "/health"))
    url = os.environ.get("TRACKIO_SERVER_URL", "")
    if "trackio" in names and url.startswith(("http://", "https://")) and not os.environ.get("TRACKIO_SPACE_ID"):
        servers.append(("trackio", "TRACKIO_SERVER_URL", url.split("?", 1)[0]))
    for name, variable, target in servers:
        why = probe(target)
        if why is not None:
            return f"--report-to {name}: {target} ({variable}) does not answer: {why}; start the server, fix " \
                   f"{variable}, or drop {name} from --report-to"
    return None


def check_trackers(report_to: str, output_dir: Path) -> None:
    """Stop before anything loads when a tracker ``--report-to`` names cannot run (``tracker_problem``). The main
    rank (the only one that writes) checks; every rank raises the same one-line error."""
    if not any(n in EXTERNAL for n in report_sinks(report_to)):
        return
    from dschat import engine as E

    problem = E.broadcast_object(tracker_problem(report_to, output_dir) if E.is_main() else None)
    if problem:
        raise UserError(problem)
