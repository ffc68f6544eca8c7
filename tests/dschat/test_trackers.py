"""--report-to: TensorBoard and metrics.jsonl by default, W&B, MLflow and Trackio on request, each read back with the
library's own reader; a missing package or an unanswering server is one line before anything loads."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest

from dschat.config import SFTConfig, build_config
from dschat.errors import UserError
from dschat.training import sinks as trackers
from dschat.training.run_tracker import RunTracker
from tests.helpers import ROOT, read_json, read_jsonl, run_cli

ALL = "tensorboard,jsonl,wandb,mlflow,trackio"
ALARM = {"step": 2, "check": "kl_max", "metric": "train/kl", "value": 3.5, "threshold": 1.0, "action": "warn",
         "message": "KL to the reference above 1 nat per token", "since": 1}
SAMPLES = [{"prompt": "1+1=", "answer": "= 2", "reward": 1.0}, {"prompt": "2+2=", "answer": "= 5", "reward": 0.0}]


def _external_installed() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("wandb", "mlflow", "trackio", "sqlalchemy",
                                                                   "alembic"))


def needs_trackers() -> None:
    if not _external_installed():
        if os.environ.get("CI"):
            pytest.fail("wandb, mlflow and trackio are not installed (CI installs requirements-{wandb,mlflow,"
                        "trackio}.txt)")
        pytest.skip("pip install -r requirements-wandb.txt -r requirements-mlflow.txt -r requirements-trackio.txt")


def tracker_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a child process: no tracker settings of this machine's, W&B's caches in ``tmp_path``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_", "TRACKIO_"))}
    env.update({f"WANDB_{k}_DIR": str(tmp_path / f"wandb-{k.lower()}") for k in ("DATA", "CACHE", "CONFIG")})
    env["PYTHONUNBUFFERED"] = "1"
    return env


def in_child(function: str, out: Path, env: dict[str, str], cwd: Path = ROOT, code: int = 0) -> dict:
    """``function(out)`` of this module in a fresh process (its tracker libraries and their settings stay out of
    the test process), started in ``cwd``; its JSON result (``code``: the exit status it must end with)."""
    run = f"import json; from tests.dschat.test_trackers import {function} as f; print(json.dumps(f({str(out)!r})))"
    proc = subprocess.run([sys.executable, "-c", run], cwd=cwd, env={**env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == code, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]) if code == 0 else {}


def write_every_tracker(out: str) -> dict:
    """A RunTracker on every tracker: two logged rows, an alarm, sampled answers (run in a child process)."""
    tracker = RunTracker(out, True, 2, progress=False, report_to=ALL, config={"seed": 7, "data": ["a.jsonl"]})
    tracker.log(1, {"train/loss": 0.5, "train/note": "text stays in metrics.jsonl"})
    tracker.log(2, {"train/loss": 0.25, "eval/reward": float("nan")})  # not finite: metrics.jsonl only
    tracker.log_alarm(ALARM)
    tracker.log_samples(2, SAMPLES)
    tracker.close()
    return {}


def resume_every_tracker(out: str) -> dict:
    """The same folder's run again, as after --resume: two more rows (run in a child process)."""
    tracker = RunTracker(out, True, 2, progress=False, report_to=ALL, config={"seed": 7, "data": ["a.jsonl"]})
    tracker.log(3, {"train/loss": 0.125})
    tracker.log(4, {"train/loss": 0.0625})
    tracker.close()
    return {}


def read_trackers(out: str) -> dict:
    """What W&B, MLflow and Trackio hold of the run in ``out``, read with each library's own reader (run in a child
    process whose TRACKIO_DIR is ``out/trackio``)."""
    root = Path(out)
    # W&B: the offline run's transaction log, as `wandb leet inspect --json` prints its records (a resumed run
    # writes another offline-run-*-<id> folder with the same id; `wandb sync` joins them)
    records, history, tables, metrics = [], {}, {}, []
    run_dirs = sorted(glob.glob(str(root / "wandb" / "offline-run-*")))
    for run_dir in run_dirs:
        proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", run_dir],
                              capture_output=True, text=True, timeout=120, check=True)
        mine = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        records += mine
        for r in mine:
            if r["type"] == "history":
                # W&B's own x-axis for dschat's rows is the step metric dschat defines (define_metric): the row
                # counter (_step) of a resumed run starts again; a step logged again replaces the earlier row
                item = r["history"]["item"]
                step = str(int(item.pop(trackers.STEP_METRIC)))
                history.setdefault(step, {}).update(item)
                if "eval/samples.path" in item:  # the table's file, beside the run's other files
                    tables[step] = json.loads((Path(run_dir) / "files" / item["eval/samples.path"]).read_text())
            if r["type"] == "metric":
                metrics.append(r["metric"])
    run = [r["run"] for r in records if r["type"] == "run"][0]
    wandb = {"history": history, "config": run["config"]["update"], "name": run["display_name"],
             "project": run["project"], "alerts": [r["alert"] for r in records if r["type"] == "alert"],
             "exit": [r["exit"] for r in records if r["type"] == "exit"], "tables": tables,
             "ids": [d.rsplit("-", 1)[1] for d in run_dirs], "metrics": metrics}

    # MLflow: the SQLite store under out/mlflow
    import mlflow
    from mlflow import MlflowClient
    from mlflow.artifacts import load_dict

    mlflow.set_tracking_uri(trackers.mlflow_local_uri(root))  # load_table searches the global store
    client = MlflowClient()
    experiment = client.get_experiment_by_name(trackers.PROJECT)
    [mrun] = client.search_runs([experiment.experiment_id])
    rid = mrun.info.run_id
    artifacts = {a.path for d in ("alarms", "samples") for a in client.list_artifacts(rid, d)}
    mlflow = {"name": mrun.info.run_name, "status": mrun.info.status, "params": mrun.data.params,
              "metrics": {k: {str(m.step): m.value for m in client.get_metric_history(rid, k)}
                          for k in mrun.data.metrics},
              "alarms": [load_dict(f"{mrun.info.artifact_uri}/{a}") for a in sorted(artifacts) if "alarms/" in a],
              "samples": {a: client.load_table(experiment.experiment_id, a, run_ids=[rid]).to_dict("records")
                          for a in sorted(artifacts) if "samples/" in a}}

    # Trackio: its local store, through its storage and API
    import trackio
    from trackio.sqlite_storage import SQLiteStorage
    from trackio.utils import TRACKIO_DIR

    [name] = SQLiteStorage.get_runs(trackers.PROJECT)
    [trun] = list(trackio.Api().runs(trackers.PROJECT))
    logs = SQLiteStorage.get_logs(trackers.PROJECT, name)
    trackio_ = {"dir": str(TRACKIO_DIR), "name": name, "config": trun.config, "alerts": trun.alerts(),
                "logs": [{k: v for k, v in r.items() if k != "timestamp"} for r in logs]}
    return {"wandb": wandb, "mlflow": mlflow, "trackio": trackio_}


def jsonl_scalars(out: Path) -> dict[int, dict[str, float]]:
    """Each step's finite scalars of metrics.jsonl (what every tracker must hold), without step and time."""
    rows: dict[int, dict[str, float]] = {}
    for r in read_jsonl(out / "metrics.jsonl"):
        rows.setdefault(r["step"], {}).update({k: v for k, v in r.items() if k not in ("step", "time")
                                               and isinstance(v, int | float) and v == v})
    return rows


def assert_every_scalar_found(got: dict, out: Path) -> None:
    expected = jsonl_scalars(out)
    assert expected and all(expected.values())
    trackio_rows: dict[int, dict] = {}
    for r in got["trackio"]["logs"]:
        trackio_rows.setdefault(r["step"], {}).update(r)
    for step, scalars in expected.items():
        for key, value in scalars.items():
            assert got["wandb"]["history"][str(step)][key] == pytest.approx(value, rel=1e-9), ("wandb", step, key)
            assert got["mlflow"]["metrics"][key][str(step)] == pytest.approx(value, rel=1e-9), ("mlflow", step, key)
            assert trackio_rows[step][key] == pytest.approx(value, rel=1e-9), ("trackio", step, key)


def test_report_to_flag_is_declared_once_and_validated():
    cfg = build_config(SFTConfig, {})
    assert cfg.run.report_to == "tensorboard,jsonl"  # today's outputs
    assert build_config(SFTConfig, {"report_to": " wandb, mlflow ,wandb"}).run.report_to == " wandb, mlflow ,wandb"
    assert trackers.report_sinks(" wandb, mlflow ,wandb") == ("wandb", "mlflow")
    for bad in ("wandb,neptune", "", " , "):
        with pytest.raises(UserError, match="--report-to takes a comma-separated list of tensorboard, jsonl"):
            build_config(SFTConfig, {"report_to": bad})


def test_default_trackers_write_tensorboard_and_jsonl_only(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    tracker = RunTracker(out, True, 2, progress=False)  # no args.json, no flag: the defaults
    tracker.log(1, {"train/loss": 0.5, "train/note": "text"})
    tracker.log_alarm(ALARM)
    tracker.log_samples(1, SAMPLES)
    tracker.close()
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "tensorboard"]  # no wandb/, mlflow/, trackio/
    assert read_jsonl(out / "metrics.jsonl") == [{"step": 1, "time": read_jsonl(out / "metrics.jsonl")[0]["time"],
                                                  "train/loss": 0.5, "train/note": "text"}]  # alarms go elsewhere
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    assert [e.value for e in events.Scalars("train/loss")] == [0.5]
    [alarm] = events.Tensors("alarms/kl_max/text_summary")  # add_text's tag
    assert alarm.step == 2 and alarm.tensor_proto.string_val[0].decode() == trackers.alarm_text(ALARM)
    [table] = events.Tensors("eval/samples/text_summary")
    assert table.step == 1 and "| 2+2= | = 5 | 0.0 |" in table.tensor_proto.string_val[0].decode()

    jsonl_only = tmp_path / "jsonl"
    RunTracker(jsonl_only, True, 1, progress=False, report_to="jsonl").close()
    assert [p.name for p in jsonl_only.iterdir()] == ["metrics.jsonl"]  # jsonl alone: no TensorBoard


class Recording:
    """A tracker that records what it gets; ``broken`` makes its ``log`` fail as a lost server would."""

    name = "recording"

    def __init__(self, broken: bool = False):
        self.broken, self.rows, self.closed = broken, [], None

    def log(self, step, scalars):
        if self.broken:
            raise ConnectionError("server went away\nsecond line")
        self.rows.append((step, scalars))

    def alarm(self, record):
        self.rows.append(("alarm", record["check"]))

    def samples(self, step, rows):
        self.rows.append(("samples", step, len(rows)))

    def close(self, status):
        self.closed = status


def test_a_failing_tracker_is_dropped_and_runs_end_failed_on_an_exception(tmp_path, capsys):
    tracker = RunTracker(tmp_path / "a", True, 2, progress=False, report_to="jsonl")
    broken, kept = Recording(broken=True), Recording()
    tracker._sinks += [broken, kept]
    tracker.log(1, {"x": 1.0, "nan": float("nan"), "text": "t"})
    tracker.log(2, {"x": 2.0})
    tracker.log_alarm(ALARM)
    tracker.log_samples(2, SAMPLES)
    tracker.log_samples(2, [])  # an evaluation without texts: nothing
    tracker.close()
    assert [r["x"] for r in read_jsonl(tmp_path / "a" / "metrics.jsonl")] == [1.0, 2.0]  # logging never stops
    assert kept.rows == [(1, {"x": 1.0}), (2, {"x": 2.0}), ("alarm", "kl_max"), ("samples", 2, 2)]
    assert kept.closed == "FINISHED" and broken.closed is None  # the broken one was dropped at its first failure
    err = capsys.readouterr().err
    assert err.count("recording: logging failed (server went away); it is off for the rest of the run") == 1

    tracker = RunTracker(tmp_path / "b", True, 2, progress=False, report_to="jsonl")
    tracker._sinks.append(failed := Recording())
    with pytest.raises(ValueError):
        try:
            raise ValueError("the stage failed")
        finally:
            tracker.close()  # as the stages close it
    assert failed.closed == "FAILED"
    RunTracker(tmp_path / "c", False, 2).log_alarm(ALARM)  # other ranks: nothing, no folder
    assert not (tmp_path / "c").exists()


def test_tracker_problems_are_one_line(tmp_path, monkeypatch):
    for name in ("wandb", "mlflow", "trackio"):
        monkeypatch.setitem(sys.modules, name, None)  # `import name` fails as if it were not installed
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    for name in ("wandb", "mlflow", "trackio"):
        problem = trackers.tracker_problem(f"tensorboard,{name}", tmp_path)
        assert problem == f"--report-to {name}: the {name} package is not installed; pip install \"dschat[{name}]\" " \
                          f"(in a checkout: pip install -r requirements-{name}.txt) or drop {name} from --report-to"
    assert trackers.tracker_problem("tensorboard,jsonl", tmp_path) is None  # nothing imported for the defaults

    # a server the environment names must answer (anything HTTP counts); a closed port does not
    for name in ("wandb", "mlflow", "trackio"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", closed)
    with pytest.raises(UserError, match=rf"--report-to mlflow: {closed}/health \(MLFLOW_TRACKING_URI\) does not "
                                        "answer: .*; start the server"):
        trackers.check_trackers("mlflow", tmp_path)
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_BASE_URL", closed)
    assert trackers.tracker_problem("wandb", tmp_path).startswith(f"--report-to wandb: {closed} (WANDB_BASE_URL)")
    monkeypatch.setenv("TRACKIO_SERVER_URL", closed + "/?write_token=x")
    assert trackers.tracker_problem("trackio", tmp_path).startswith(f"--report-to trackio: {closed}/ (TRACKIO_")
    monkeypatch.setenv("WANDB_MODE", "offline")  # offline: no server to ask
    assert trackers.tracker_problem("wandb", tmp_path) is None

    import http.server
    import threading

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # answers 501
    threading.Thread(target=server.handle_request, daemon=True).start()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{server.server_port}")
    try:
        assert trackers.tracker_problem("mlflow", tmp_path) is None
    finally:
        server.server_close()


@pytest.mark.slow
def test_missing_tracker_stops_before_anything_loads(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(
        "import sys, importlib.abc\n"
        "class Hide(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'mlflow' or name.startswith('mlflow.'):\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Hide())\n")
    out = tmp_path / "o"
    proc = run_cli("train", "--step", "1", "--model", "tiny", "--max-steps", "1", "--no-progress", "--output-dir",
                   str(out), "--report-to", "tensorboard,mlflow",
                   env={"PYTHONPATH": f"{tmp_path / 'site'}:{ROOT}"}, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == \
        "dschat: error: --report-to mlflow: the mlflow package is not installed; pip install \"dschat[mlflow]\" " \
        "(in a checkout: pip install -r requirements-mlflow.txt) or drop mlflow from --report-to"
    assert "Traceback" not in proc.stderr and "[step1_sft]" not in proc.stderr  # no data, no model
    assert not out.exists()


@pytest.mark.slow
def test_alarms_samples_and_config_reach_every_tracker(tmp_path):
    needs_trackers()
    out = tmp_path / "run"
    env = tracker_env(tmp_path)
    in_child("write_every_tracker", out, env)
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "mlflow", "tensorboard", "trackers.json",
                                                     "trackio", "wandb"]
    got = in_child("read_trackers", out, {**env, "TRACKIO_DIR": str(out / "trackio")})
    assert_every_scalar_found(got, out)
    text = trackers.alarm_text(ALARM)
    assert text == "step 2: KL to the reference above 1 nat per token (train/kl = 3.5, threshold 1); action: warn"

    w = got["wandb"]
    assert (w["name"], w["project"], w["config"]["seed"], w["config"]["data"]) == ("run", "dschat", 7, ["a.jsonl"])
    assert [(a["title"], a["text"]) for a in w["alerts"]] == [("dschat health alarm: kl_max", text)]
    assert w["tables"]["2"]["columns"] == ["step", "prompt", "answer", "reward"]
    assert w["tables"]["2"]["data"] == [[2, "1+1=", "= 2", 1.0], [2, "2+2=", "= 5", 0.0]]
    assert "eval/reward" not in w["history"]["2"] and w["exit"][0].get("exit_code", 0) == 0

    m = got["mlflow"]
    assert (m["name"], m["status"], m["params"]) == ("run", "FINISHED", {"seed": "7", "data": '["a.jsonl"]'})
    assert m["alarms"] == [{**ALARM, "text": text}]
    rows = [{"step": 2, **r} for r in SAMPLES]
    assert m["samples"] == {"samples/step_00000002.json": rows}

    t = got["trackio"]
    assert Path(t["dir"]) == out / "trackio" and t["name"] == "run"
    assert (t["config"]["seed"], t["config"]["data"]) == (7, ["a.jsonl"])
    assert [(a["title"], a["text"]) for a in t["alerts"]] == [("dschat health alarm: kl_max", text)]
    [table] = [r["eval/samples"] for r in t["logs"] if "eval/samples" in r]
    assert table["_value"] == rows


@pytest.mark.slow
def test_tiny_run_reports_to_every_tracker(tmp_path):
    needs_trackers()
    out = tmp_path / "sft"
    env = tracker_env(tmp_path)
    proc = subprocess.run([sys.executable, "-c", "from dschat.cli.main import cli; cli()", "train", "--step", "1",
                           "--model", "tiny", "--max-steps", "3", "--no-progress", "--output-dir", str(out),
                           "--report-to", ALL], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {"metrics.jsonl", "tensorboard", "wandb", "mlflow", "trackio"} <= {p.name for p in out.iterdir()}
    args = read_json(out / "args.json")
    got = in_child("read_trackers", out, {**env, "TRACKIO_DIR": str(out / "trackio")})
    assert_every_scalar_found(got, out)
    assert sorted(jsonl_scalars(out)) == [0, 1, 2, 3]
    # each tracker holds the run's configuration: args.json, flag for flag
    assert got["wandb"]["config"]["report_to"] == ALL and got["wandb"]["config"]["max_steps"] == 3
    assert got["mlflow"]["params"] == {k: v if isinstance(v, str) else json.dumps(v) for k, v in args.items()}
    assert {k: got["trackio"]["config"][k] for k in args} == args
    assert got["mlflow"]["status"] == "FINISHED" and got["wandb"]["name"] == got["trackio"]["name"] == "sft"


def test_a_resumed_run_goes_on_in_the_same_tracker_runs(tmp_path):
    needs_trackers()
    out = tmp_path / "run"
    env = tracker_env(tmp_path)
    in_child("write_every_tracker", out, env)
    ids = read_json(out / trackers.RUN_IDS)
    assert sorted(ids) == ["mlflow", "trackio", "wandb"]
    in_child("resume_every_tracker", out, env)
    assert read_json(out / trackers.RUN_IDS) == ids  # the same runs
    got = in_child("read_trackers", out, {**env, "TRACKIO_DIR": str(out / "trackio")})  # one MLflow/Trackio run
    assert_every_scalar_found(got, out)
    assert sorted(jsonl_scalars(out)) == [1, 2, 3, 4]
    assert got["wandb"]["ids"] == [ids["wandb"]] * 2  # two offline folders of one W&B run
    assert got["mlflow"]["status"] == "FINISHED" and got["mlflow"]["params"] == {"seed": "7", "data": '["a.jsonl"]'}
    assert got["mlflow"]["metrics"]["train/loss"] == {"1": 0.5, "2": 0.25, "3": 0.125, "4": 0.0625}
    assert got["trackio"]["name"] == ids["trackio"] == "run"


# ------------------------------------------------------------------ names, endings, artifacts, steps that go back
ODD = "train/reward//abs/path/rewards.py:fn"  # what a reward given by path was named before sources had labels
LONG = "train/" + "x" * 300  # past MLflow's 250 characters: refused whatever its characters


def odd_and_refused_keys(out: str) -> dict:
    """Rows whose keys MLflow would refuse as given (run in a child process)."""
    tracker = RunTracker(out, True, 2, progress=False, report_to="tensorboard,jsonl,mlflow", config={"seed": 7})
    lines: list[str] = []
    tracker.message = lines.append
    tracker.log(1, {ODD: 1.0, LONG: 2.0, "train/loss": 0.5})
    tracker.log(2, {LONG: 3.0, "train/loss": 0.25})
    tracker.close()
    return {"lines": lines}


def mlflow_run(out: str) -> dict:
    """The MLflow run of ``out``'s local store: status and metric histories (run in a child process)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=os.environ.get("MLFLOW_TRACKING_URI") or trackers.mlflow_local_uri(Path(out)))
    experiment = client.get_experiment_by_name(trackers.PROJECT)
    [run] = client.search_runs([experiment.experiment_id])
    rid = run.info.run_id
    return {"status": run.info.status, "artifact_uri": run.info.artifact_uri,
            "artifacts": sorted(a.path for d in ("alarms", "samples") for a in client.list_artifacts(rid, d)),
            "metrics": {k: {str(m.step): m.value for m in sorted(client.get_metric_history(rid, k),
                                                                 key=lambda m: m.timestamp)}
                        for k in run.data.metrics}}


def test_a_key_a_tracker_refuses_is_dropped_there_and_the_tracker_stays_on(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    needs_trackers()
    out = tmp_path / "run"
    env = tracker_env(tmp_path)
    lines = in_child("odd_and_refused_keys", out, env)["lines"]
    got = in_child("mlflow_run", out, env)
    assert got["status"] == "FINISHED"
    assert got["metrics"] == {"train/loss": {"1": 0.5, "2": 0.25}, "train/reward/abs/path/rewards.py_fn": {"1": 1.0}}
    [line] = [x for x in lines if "refused" in x]  # one line for the refused key, and nothing else said
    assert line.startswith(f"mlflow: refused {LONG} (") and line.endswith("not logged there from now on "
                                                                           "(metrics.jsonl has them)")
    assert len(lines) == 1  # the tracker stayed on: no "logging failed"
    tags = EventAccumulator(str(out / "tensorboard")).Reload().Tags()["scalars"]
    assert sorted(tags) == sorted(["train/loss", "train/reward/abs/path/rewards.py_fn", LONG])
    assert trackers.metric_name("a//b/../c d:e/") == "a/b/__/c_d_e"


def ends_failed_without_close(out: str) -> dict:
    """A tracker left open by an error before the stage's ``finally`` (run in a child process, which fails)."""
    tracker = RunTracker(out, True, 2, progress=False, report_to="jsonl,mlflow", config={})
    tracker.log(1, {"train/loss": 0.5})
    raise RuntimeError("the stage failed before its finally")


def ends_killed_on_a_stop(out: str) -> dict:
    """A health stop on its way out through the stage's ``finally`` (run in a child process)."""
    from dschat.training.health import HealthStop

    tracker = RunTracker(out, True, 2, progress=False, report_to="jsonl,mlflow", config={})
    try:
        try:
            tracker.log(1, {"train/loss": 0.5})
            raise HealthStop("stopped by the health alarm")
        finally:
            tracker.close()
    except HealthStop:
        return {}


def test_every_external_run_ends_when_the_process_does(tmp_path):
    needs_trackers()
    env = tracker_env(tmp_path)
    in_child("ends_failed_without_close", tmp_path / "failed", env, code=1)
    assert in_child("mlflow_run", tmp_path / "failed", env)["status"] == "FAILED"  # not RUNNING for ever
    in_child("ends_killed_on_a_stop", tmp_path / "stopped", env)
    assert in_child("mlflow_run", tmp_path / "stopped", env)["status"] == "KILLED"


def test_mlflow_artifacts_stay_out_of_the_current_folder(tmp_path):
    """A database store named by MLFLOW_TRACKING_URI keeps its artifacts under the output folder, not in ./mlruns
    of wherever the command was started (a git checkout, say)."""
    needs_trackers()
    cwd, out = tmp_path / "checkout", tmp_path / "run"
    cwd.mkdir()
    (tmp_path / "store").mkdir()
    env = {**tracker_env(tmp_path), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"}
    in_child("write_every_tracker", out, env, cwd=cwd)
    assert list(cwd.iterdir()) == []  # no mlruns/
    got = in_child("mlflow_run", out, env)
    assert got["artifacts"] == ["alarms/step_00000002_kl_max.json", "samples/step_00000002.json"]
    assert got["artifact_uri"].startswith((out / "mlflow" / "artifacts").resolve().as_uri())
    assert (out / "mlflow" / "artifacts").is_dir() and not (out / "mlflow" / "mlflow.db").exists()


def first_attempt(out: str) -> dict:
    """Steps 1-4 and an evaluation at 4, then stopped by an alarm (run in a child process)."""
    tracker = RunTracker(out, True, 4, progress=False, report_to=ALL, config={"seed": 7})
    for step in range(1, 5):
        tracker.log(step, {"train/loss": float(step)})
    tracker.log(4, {"eval/reward": 0.75})
    tracker.close("KILLED")
    return {}


def rolled_back_to_2(out: str) -> dict:
    """A rollback to the state of step 2: the cut, then steps 3-5 again at other values (run in a child process)."""
    from dschat.training.resume import truncate_metrics

    truncate_metrics(out, 2)
    tracker = RunTracker(out, True, 5, progress=False, report_to=ALL, config={"seed": 7})
    for step in range(3, 6):
        tracker.log(step, {"train/loss": 10.0 + step})
    tracker.close("KILLED")
    return {}


def resumed_at_5(out: str) -> dict:
    """``--resume`` from the state of step 5: step 6 (run in a child process)."""
    from dschat.training.resume import truncate_metrics

    truncate_metrics(out, 5)
    tracker = RunTracker(out, True, 6, progress=False, report_to=ALL, config={"seed": 7})
    tracker.log(6, {"train/loss": 16.0})
    tracker.close()
    return {}


@pytest.mark.slow
def test_curves_across_a_rollback_and_a_resume_are_one_value_per_step(tmp_path):
    """Each tracker read back with its own reader holds one value per step, metrics.jsonl's: the rolled-back steps'
    new values, none of the abandoned ones (the evaluation at the abandoned step 4 included)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    needs_trackers()
    out = tmp_path / "run"
    env = tracker_env(tmp_path)
    for attempt in ("first_attempt", "rolled_back_to_2", "resumed_at_5"):
        in_child(attempt, out, env)
    expected = {1: 1.0, 2: 2.0, 3: 13.0, 4: 14.0, 5: 15.0, 6: 16.0}
    assert {s: r["train/loss"] for s, r in jsonl_scalars(out).items()} == expected
    assert all("eval/reward" not in r for r in jsonl_scalars(out).values())

    events = EventAccumulator(str(out / "tensorboard")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == list(expected.items())
    assert events.Scalars("eval/reward") == []  # the abandoned evaluation is gone too

    got = in_child("read_trackers", out, {**env, "TRACKIO_DIR": str(out / "trackio")})
    assert_every_scalar_found(got, out)  # each step's latest value in W&B, MLflow and Trackio is metrics.jsonl's
    assert sorted(map(int, got["wandb"]["history"])) == sorted(expected)  # every step arrived
    # W&B plots every metric against dschat's own step, so a step below the run's current one is kept
    assert any(m.get("name") == trackers.STEP_METRIC for m in got["wandb"]["metrics"])
    assert any(m.get("glob_name") == "*" and m.get("step_metric") == trackers.STEP_METRIC
               for m in got["wandb"]["metrics"]), got["wandb"]["metrics"]
    assert got["mlflow"]["metrics"]["train/loss"] == {str(s): v for s, v in expected.items()}
    assert got["mlflow"]["status"] == "FINISHED"


def test_a_fresh_start_clears_the_old_runs_tensorboard(tmp_path):
    """--force (or any fresh start in the folder) removes O/tensorboard/ with the other outputs of the old run;
    TensorBoard overlaid the old run's curves and the new one's."""
    out = tmp_path / "run"
    (out / "tensorboard").mkdir(parents=True)
    (out / "tensorboard" / "events.out.tfevents.1.old").write_bytes(b"")
    (out / "eval.json").write_text("{}")
    code = ("from dschat.config import SFTConfig, build_config; from dschat.training.stage import begin_stage; "
            f"begin_stage(build_config(SFTConfig, {{'output_dir': {str(out)!r}, 'force': True}}), 'sft', 'x')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == [".dschat.lock", "args.json"]


@pytest.mark.slow
def test_a_stage3_run_with_a_reward_by_path_rolled_back_and_resumed_reports_to_every_tracker(tmp_path):
    """The reward function given by its absolute path (its metrics were train/reward//abs/path...:length, which
    MLflow refused, turning itself off for the run), a rollback (the KL ceiling as in test_health), then --resume
    for two more steps: every tracker, read with its own reader, holds one value per step, metrics.jsonl's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.dschat.test_health import grpo_argv

    needs_trackers()
    out = tmp_path / "run"
    env = tracker_env(tmp_path)

    def train(*extra: str) -> subprocess.CompletedProcess:
        argv = grpo_argv(tmp_path, out, "--report-to", ALL, "--log-interval", "1", *extra)
        return subprocess.run([sys.executable, "-c", "from dschat.cli.main import cli; cli()", *argv], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=900)

    first = train("--alarm-kl-ceiling", "6e-4", "--on-alarm", "rollback", "--max-rollbacks", "2", "--alarm-window",
                  "4")
    assert first.returncode in (0, 4), first.stderr[-3000:]
    assert "rolled back to" in first.stderr
    second = train("--resume", "--max-steps", "6")
    assert second.returncode == 0, second.stderr[-3000:]
    for proc in (first, second):
        assert "logging failed" not in proc.stderr and "refused" not in proc.stderr, proc.stderr[-3000:]

    expected = jsonl_scalars(out)
    assert sorted(expected) == [0, 1, 2, 3, 4, 5, 6] and "train/reward/length" in expected[3]
    events = EventAccumulator(str(out / "tensorboard")).Reload()
    for key in {k for row in expected.values() for k in row}:
        got = [(e.step, e.value) for e in events.Scalars(key)]
        want = [(s, row[key]) for s, row in sorted(expected.items()) if key in row]
        assert [s for s, _ in got] == [s for s, _ in want], key  # one value per step, none abandoned
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6), key
    got = in_child("read_trackers", out, {**env, "TRACKIO_DIR": str(out / "trackio")})
    assert_every_scalar_found(got, out)
    assert got["mlflow"]["status"] == "FINISHED"
    assert sorted(map(int, got["wandb"]["history"])) == sorted(expected)
