"""One table of exit codes (dschat.errors.ExitCode), each with one meaning, as docs/cli.md lists it; a hung step stops
through the exit handlers with its own code (not os._exit, not 3, which means "does not fit")."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

from dschat.errors import ExitCode, TimedOut, UserError
from tests.helpers import ROOT


def test_the_table_has_one_meaning_per_code_and_docs_list_it():
    assert [int(c) for c in ExitCode] == [0, 1, 2, 3, 4, 5, 130]  # distinct (an IntEnum would alias a repeat)
    text = (ROOT / "docs" / "cli.md").read_text()
    section = text.split("## Exit codes", 1)[1]
    documented = [int(m) for m in re.findall(r"^\| (\d+) \|", section, flags=re.M)]
    assert documented == [int(c) for c in ExitCode]


def test_every_error_takes_its_code_from_the_table():
    from dschat.cli.plan import NO_FIT_EXIT
    from dschat.rewards.remote import RewardServerDown
    from dschat.training.health import HealthStop
    from dschat.training.stage import Interrupted

    assert UserError.exit_code == ExitCode.USAGE == 2
    assert NO_FIT_EXIT == ExitCode.DOES_NOT_FIT == 3
    assert HealthStop.exit_code == RewardServerDown.exit_code == ExitCode.STOPPED == 4
    assert TimedOut.exit_code == ExitCode.TIMED_OUT == 5
    assert Interrupted.exit_code == ExitCode.INTERRUPTED == 130
    # no code spelled as a number anywhere else in the library, and no exit that skips the exit handlers
    spelled = re.compile(r"(exit_code\s*=\s*\d|sys\.exit\(\d|os\._exit\(|ctx\.exit\(\d|_EXIT\s*=\s*\d)")
    found = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "dschat").rglob("*.py")) if p.name != "errors.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if spelled.search(line)]
    assert found == []


CHILD = textwrap.dedent('''
    import atexit, sys, threading, time
    import click
    from dschat.cli.options import run_command
    from dschat.errors import stop_hung_process

    mark, mode = sys.argv[1], sys.argv[2]
    atexit.register(lambda: open(mark, "a").write("exit handlers ran\\n"))  # as the lock's release and the trackers

    @click.command()
    def hang():
        threading.Timer(0.2, stop_hung_process, args=("the weight sync did not finish within 0.2 s",),
                        kwargs={"grace_s": 1.0}).start()
        if mode == "python":  # the main thread runs Python: the error is raised in it
            try:
                while True:
                    time.sleep(0.01)
            finally:
                open(mark, "a").write("unwound\\n")  # as the stage's finally closes its tracker
        threading.Event().wait()  # blocked in native code: the watchdog ends the process after the grace

    run_command(hang, [])
''')


def run_hung(tmp_path, mode: str) -> tuple[subprocess.CompletedProcess, str]:
    mark = tmp_path / f"{mode}.txt"
    proc = subprocess.run([sys.executable, "-c", CHILD, str(mark), mode], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    return proc, mark.read_text() if mark.exists() else ""


def test_a_hung_step_unwinds_the_main_thread_and_exits_5(tmp_path):
    proc, mark = run_hung(tmp_path, "python")
    assert proc.returncode == 5, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == ["dschat: error: the weight sync did not finish within 0.2 s"]
    assert mark == "unwound\nexit handlers ran\n"


def test_a_step_hung_in_native_code_still_runs_the_exit_handlers(tmp_path):
    proc, mark = run_hung(tmp_path, "native")
    assert proc.returncode == 5, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == ["dschat: error: the weight sync did not finish within 0.2 s"]
    assert mark == "exit handlers ran\n"


def test_the_vllm_sync_watchdog_stops_through_the_table(monkeypatch):
    from dschat.generation import vllm_engine

    calls = []
    monkeypatch.setattr(vllm_engine, "stop_hung_process", calls.append)
    vllm_engine._Watchdog(30, "the weight sync")._fire()
    assert calls == ["the weight sync did not finish within 30 s (--sync-timeout); stopping"]
