"""Tool and environment faults that must cost a call or an episode and nothing more (docs/tools.md, Faults): values
that cannot be text, hung, spinning, exiting and forking tools (killed with their worker's process group),
environments past the deadline or over the output cap, loose step types, resets that return junk, user code that
exits at import or at run time, and the environment shapes users bring (``reset()``, ``async def step``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dschat.agents.agent import Agent
from dschat.agents.env import load_envs
from dschat.agents.tools import ToolRunner, load_tools
from dschat.agents.worker import check_step
from dschat.errors import UserError


def _file(tmp_path: Path, body: str, name: str = "user_code.py") -> str:
    f = tmp_path / name
    f.write_text(textwrap.dedent(body), encoding="utf-8")
    return str(f)


def _gone(pid: int) -> bool:
    """The process ``pid`` is gone (or a zombie nobody has reaped yet: it runs nothing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
    return state in ("Z", "X")


def _wait_gone(pid: int, seconds: float = 3.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.05)
    return _gone(pid)


@pytest.fixture
def runners():
    made: list[Any] = []
    yield made
    for r in made:
        r.close()


def _runner(runners: list, tmp_path: Path, body: str, names: list[str], timeout: float = 5.0,
            max_output: int = 100) -> ToolRunner:
    f = _file(tmp_path, body, "my_tools.py")
    runner = ToolRunner(load_tools([f"{f}:{n}" for n in names]), timeout, max_output)
    runners.append(runner)
    return runner


# ------------------------------------------------------------------------------------------------ return values
RETURNS = """
class Loud(str):
    def __str__(self):
        raise RuntimeError("no str for you")

    def __format__(self, spec):
        raise RuntimeError("no format either")

def deep(text: str):
    x = []
    for _ in range(100_000):
        x = [x]
    return x

def huge(text: str):
    return 10 ** 5000

def loud(text: str):
    return Loud("plain words")

def deep_dict(text: str):
    x = {}
    for _ in range(50_000):
        x = {"a": x}
    return x

def surrogate(text: str):
    return "a\\ud800b"

def nan(text: str):
    return float("nan")
"""


def test_tool_return_values_that_are_not_text_are_error_turns_not_crashes(tmp_path, runners):
    names = ["deep", "huge", "loud", "deep_dict", "surrogate", "nan"]
    runner = _runner(runners, tmp_path, RETURNS, names)
    got = {n: runner.call(n, {"text": "x"}).wait() for n in names}
    assert got["deep"].error == "junk" and "nested too deeply" in got["deep"].text
    assert got["deep_dict"].error == "junk" and "nested too deeply" in got["deep_dict"].text
    assert got["huge"].error == "junk" and got["huge"].text.startswith("error: huge returned a int that cannot")
    assert got["nan"].error == "junk"
    # a str subclass is its text (its own __str__ and __format__ never run); what comes back is a plain str
    assert got["loud"].error is None and got["loud"].text == "plain words" and type(got["loud"].text) is str
    assert got["surrogate"].error is None and got["surrogate"].text.encode("utf-8")


def test_the_same_values_from_a_tool_in_this_process_are_error_turns_too():
    from dschat.agents.tools import tool_from_function

    namespace: dict[str, Any] = {}
    exec(RETURNS, namespace)  # noqa: S102 - the same functions, given as Python objects
    tools = [tool_from_function(namespace[n]) for n in ("deep", "huge", "loud")]
    runner = ToolRunner(tools, 5.0, 100)
    assert runner.call("deep", {"text": "x"}).wait().error == "junk"
    assert runner.call("huge", {"text": "x"}).wait().error == "junk"
    loud = runner.call("loud", {"text": "x"}).wait()
    assert loud.text == "plain words" and type(loud.text) is str


def test_an_episode_goes_on_after_a_tool_returns_junk(tmp_path, runners):
    from dschat.agents.episode import Episodes
    from dschat.models.loading import load_tokenizer, resolve_model
    from tests.dschat.test_tools import _drive, _ids

    tok = load_tokenizer(resolve_model("tiny"))
    f = _file(tmp_path, RETURNS, "my_tools.py")
    tools = load_tools([f"{f}:deep", f"{f}:loud"])
    runner = ToolRunner(tools, 5.0, 100)
    runners.append(runner)
    eos = tok.eos_token_id
    scripts = [_ids(tok, " <tool_call>deep(x)</tool_call>") + _ids(tok, " done") + [eos],
               _ids(tok, " <tool_call>loud(x)</tool_call>") + _ids(tok, " done") + [eos]]
    ep = Episodes(Agent(tools, runner, {}, "env", 4), tok, [{}, {}], [eos], tok.pad_token_id)
    out = _drive(ep, scripts, tok.pad_token_id)
    texts = [tok.decode([t for t, r, _ in row if r]) for row in out]
    assert "error: deep returned a list nested too deeply" in texts[0] and texts[0].endswith("done</s>")
    assert "<tool_response>plain words</tool_response>" in texts[1]
    assert ep.finished() == [True, True] and [st.counts.errors for st in ep.state] == [1, 0]


# ------------------------------------------------------------------------------------------------ processes
PROCESSES = """
import os, sys, time

def hang(path: str) -> str:
    open(path, "w").write(str(os.getpid()))
    time.sleep(60)
    return "late"

def spin(path: str) -> str:
    open(path, "w").write(str(os.getpid()))
    while True:
        pass

def quit_hard(path: str) -> str:
    os._exit(7)

def quit_soft(path: str) -> str:
    sys.exit(5)

def interrupt(path: str) -> str:
    raise KeyboardInterrupt

def forks(path: str) -> str:
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    open(path, "w").write(str(child))
    return "forked"

def echo(path: str) -> str:
    return path
"""


def test_a_hung_or_spinning_tool_costs_its_call_its_worker_is_killed_and_threads_do_not_pile_up(tmp_path,
                                                                                                 runners):
    runner = _runner(runners, tmp_path, PROCESSES, ["hang", "spin", "echo"], timeout=0.4)
    assert runner.call("echo", {"path": "warm"}).wait().text == "warm"  # the process's threads, settled
    threads = threading.active_count()
    pids = []
    t0 = time.monotonic()
    for i in range(4):
        name = "hang" if i % 2 == 0 else "spin"
        pid_file = tmp_path / f"pid{i}"
        result = runner.call(name, {"path": str(pid_file)}).wait()
        assert result.error == "timeout" and result.text == f"error: {name} timed out after 0.4 s"
        pids.append(int(pid_file.read_text()))
    assert time.monotonic() - t0 < 4 * 0.4 + 3  # each call cost its deadline (and a fresh worker's start)
    assert all(_wait_gone(pid) for pid in pids), "a timed-out tool's worker still runs"
    assert len(set(pids)) == 4  # each call after a timeout had a fresh worker
    assert threading.active_count() <= threads + 2  # one thread per worker of each tool, not one per call
    assert runner.call("echo", {"path": "still here"}).wait().text == "still here"


def test_calls_of_one_tool_run_side_by_side_in_up_to_four_workers(tmp_path, runners):
    from dschat.agents.worker import WORKERS

    runner = _runner(runners, tmp_path, "import os, time\ndef nap(path: str) -> str:\n    time.sleep(1.0)\n"
                                        "    return str(os.getpid())\n", ["nap"])
    t0 = time.monotonic()
    calls = [runner.call("nap", {"path": "x"}) for _ in range(2 * WORKERS)]
    pids = [c.wait().text for c in calls]
    assert len(set(pids)) == WORKERS  # as many workers as the pool holds, each answering in turn
    assert time.monotonic() - t0 < 2 * 1.0 + 3.5  # two rounds of naps (and the workers' start), not eight


def test_a_tool_that_exits_or_interrupts_is_an_error_turn_and_the_next_call_runs(tmp_path, runners):
    runner = _runner(runners, tmp_path, PROCESSES, ["quit_hard", "quit_soft", "interrupt", "echo"])
    hard = runner.call("quit_hard", {"path": "x"}).wait()
    assert hard.error == "crashed" and hard.text == "error: quit_hard failed: its process exited with code 7"
    soft = runner.call("quit_soft", {"path": "x"}).wait()
    assert soft.error == "raised" and soft.text == "error: quit_soft raised sys.exit(5)"
    assert runner.call("interrupt", {"path": "x"}).wait().error == "raised"
    assert runner.call("quit_hard", {"path": "x"}).wait().error == "crashed"  # a fresh worker, and again
    assert runner.call("echo", {"path": "ok"}).wait().text == "ok"


def test_what_a_tool_forks_dies_with_its_worker(tmp_path, runners):
    runner = _runner(runners, tmp_path, PROCESSES, ["forks"])
    pid_file = tmp_path / "child"
    assert runner.call("forks", {"path": str(pid_file)}).wait().text == "forked"
    child = int(pid_file.read_text())
    assert not _gone(child)
    runner.close()
    assert _wait_gone(child), "the tool's forked child outlived its worker"


@pytest.mark.parametrize("end", ["exits", "killed"])
def test_the_end_of_the_run_kills_the_workers_and_what_they_forked(tmp_path, end):
    """A run that ends (a Python process that exits normally, or one SIGKILLed) leaves no tool process behind."""
    f = _file(tmp_path, PROCESSES, "my_tools.py")
    pid_file = tmp_path / "child"
    script = (f"import os, signal\n"
              f"from dschat.agents.tools import ToolRunner, Tool\n"
              f"tool = Tool('forks', 'forks', {{'type': 'object', 'properties': {{'path': {{'type': 'string'}}}}}}, "
              f"print, ({f!r}, 'forks'))\n"
              f"r = ToolRunner([tool], 10.0, 100)\n"
              f"print(r.call('forks', {{'path': {str(pid_file)!r}}}).wait().text, flush=True)\n"
              + ("os.kill(os.getpid(), signal.SIGKILL)\n" if end == "killed" else ""))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == (0 if end == "exits" else -9), proc.stderr[-2000:]
    assert proc.stdout.strip() == "forked"
    assert _wait_gone(int(pid_file.read_text())), "a tool's forked child outlived the run"


def test_files_that_end_their_process_at_import_are_one_line_errors(tmp_path):
    for n, body in enumerate(["import os\nos._exit(0)\ndef f(x: str) -> str:\n    return x\n",
                              "import sys\nsys.exit(0)\ndef f(x: str) -> str:\n    return x\n",
                              "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"]):
        f = _file(tmp_path, body, f"exits{n}.py")
        with pytest.raises(UserError) as e:
            load_tools([f"{f}:f"])
        said = str(e.value)
        assert said.startswith(f"--tools '{f}:f': importing {f} ") and "\n" not in said
        assert ("must not end its process at import" in said) if n != 1 else ("sys.exit(0)" in said)
        with pytest.raises(UserError, match="importing"):
            load_envs([f"{f}:Env"])


def test_a_file_that_exits_at_import_stops_the_cli_with_exit_2_and_one_line(tmp_path):
    from tests.helpers import run_cli

    f = _file(tmp_path, "import os\nos._exit(0)\n", "exits.py")
    proc = run_cli("chat", "--model", "tiny", "--tools", f"{f}:f", "--prompt", "hi", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "must not end its process at import" in proc.stderr and "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------------------------ environments
ENVS = """
import asyncio, os, sys, time

class Fine:
    def reset(self, row):
        return "start " + str(row.get("answer"))

    def step(self, text):
        return None, 1.0, True

class Slow:
    def reset(self, row):
        return None

    def step(self, text):
        time.sleep(30)
        return None, 1.0, True

class SlowStart:
    def reset(self, row):
        time.sleep(30)

    def step(self, text):
        return None, 1.0, True

class Flood:
    def reset(self, row):
        return "r" * 10_000_000

    def step(self, text):
        return "s" * 10_000_000, 0.5, False

class Interrupts:
    def reset(self, row):
        return None

    def step(self, text):
        raise KeyboardInterrupt

class Exits:
    def reset(self, row):
        return None

    def step(self, text):
        raise SystemExit(5)

class ExitsHard:
    def reset(self, row):
        return None

    def step(self, text):
        os._exit(3)

class Array:
    def reset(self, row):
        import numpy as np
        return np.array([1, 2])

class NoBool:
    def __bool__(self):
        raise RuntimeError("no truth")

    def __str__(self):
        raise RuntimeError("no text")

class WeirdReset:
    def reset(self, row):
        return NoBool()

class DictReset:
    def reset(self, row):
        return {"text": "hi"}

class TupleReset:
    def reset(self, row):
        return ("hi", 1)

class StringReward:
    def reset(self, row):
        return None

    def step(self, text):
        return None, "1.5", True

class StringDone:
    def reset(self, row):
        return None

    def step(self, text):
        return None, 1.0, "no"

class NumpyStep:
    def reset(self, row):
        return None

    def step(self, text):
        import numpy as np
        return "more", np.float32(0.25), np.bool_(False)

class NoRow:
    '''OpenEnv's shape: reset takes options, not a row; step is async.'''
    def reset(self, seed=None, episode_id=None, **kwargs):
        self.n = 0
        return "no row needed"

    async def step(self, text):
        await asyncio.sleep(0)
        self.n += 1
        return f"turn {self.n}", 0.5, self.n >= 2

class RowByName:
    async def reset(self, row=None):
        return "row: " + str(row["answer"])

    def step(self, text):
        return None, 2.0, True

class NeedsArgs:
    def __init__(self, level):
        self.level = level

    def reset(self, row):
        return None

    def step(self, text):
        return None, 0.0, True

class StepNoText:
    def reset(self, row):
        return None

    def step(self):
        return None, 0.0, True

class ResetTwo:
    def reset(self, row, extra):
        return None

    def step(self, text):
        return None, 0.0, True
"""
for _name in ("Array", "WeirdReset", "DictReset", "TupleReset"):  # these fail at reset: any step will do
    ENVS = ENVS.replace(f"class {_name}:\n", f"class {_name}:\n    def step(self, text):\n"
                                                f"        return None, 0.0, True\n\n")


def _envs(tmp_path: Path, names: list[str], timeout: float = 5.0, max_output: int = 100) -> Agent:
    f = _file(tmp_path, ENVS, "my_envs.py")
    runner = ToolRunner([], timeout, max_output)
    return Agent([], runner, load_envs([f"{f}:{n}" for n in names]), "env", 4)


@pytest.fixture
def agents():
    made: list[Agent] = []
    yield made
    for a in made:
        a.close()


def _reset(agent: Agent, name: str, row: dict | None = None):
    session = agent.open_env(name)
    return session, session.reset(row or {"answer": "42"}).wait()


def test_reset_values_that_are_not_text_are_episode_errors(tmp_path, agents):
    agent = _envs(tmp_path, ["Array", "WeirdReset", "DictReset", "TupleReset", "Fine"])
    agents.append(agent)
    said = {n: _reset(agent, n)[1] for n in ("Array", "WeirdReset", "DictReset", "TupleReset", "Fine")}
    for name, kind in (("Array", "ndarray"), ("WeirdReset", "NoBool"), ("DictReset", "dict"), ("TupleReset", "tuple")):
        assert said[name].error == "bad_return"
        assert said[name].message == f"reset() must return text or None, got {kind}"
    assert said["Fine"].error is None and said["Fine"].observation == "start 42"


def test_step_types_looser_than_documented_are_refused():
    assert check_step((None, "1.5", True), 100) == {"error": "bad_return",
                                                    "message": "the reward must be a number, got str"}
    assert check_step((None, 1.0, "no"), 100) == {"error": "bad_return",
                                                  "message": "done must be True or False, got str"}
    assert check_step((None, 1.0, 1), 100)["error"] == "bad_return"
    assert check_step(("x", None, False), 100) == {"observation": "x", "reward": 0.0, "done": False,
                                                   "truncated": False}
    assert check_step(("x", float("inf"), False), 100)["message"] == "the reward is not finite"
    assert check_step((b"x", 1.0, False), 100)["message"] == "the observation must be text or None, got bytes"
    assert check_step("text", 100)["error"] == "bad_return"


def test_loose_step_types_end_the_episode_counted(tmp_path, agents):
    agent = _envs(tmp_path, ["StringReward", "StringDone", "NumpyStep"])
    agents.append(agent)
    for name in ("StringReward", "StringDone"):
        session, _ = _reset(agent, name)
        reply = session.step("hi").wait()
        assert reply.error == "bad_return" and reply.reward == 0.0
    session, _ = _reset(agent, "NumpyStep")
    reply = session.step("hi").wait()  # numpy's scalars are a number and a bool
    assert (reply.error, reply.observation, reply.reward, reply.done) == (None, "more", 0.25, False)


def test_an_environment_past_the_deadline_costs_its_episode_and_no_more(tmp_path, agents):
    agent = _envs(tmp_path, ["Slow", "SlowStart", "Fine"], timeout=0.5)
    agents.append(agent)
    t0 = time.monotonic()
    session, reply = _reset(agent, "Slow")
    assert reply.error is None
    step = session.step("hi").wait()
    assert step.error == "timeout" and step.message == "step timed out after 0.5 s"
    _, start = _reset(agent, "SlowStart")
    assert start.error == "timeout" and start.message == "reset timed out after 0.5 s"
    assert time.monotonic() - t0 < 6
    session, reply = _reset(agent, "Slow")  # a fresh worker answers the next episode
    assert reply.error is None


def test_an_observation_is_cut_at_the_output_cap(tmp_path, agents):
    agent = _envs(tmp_path, ["Flood"], timeout=10.0, max_output=50)
    agents.append(agent)
    t0 = time.monotonic()
    session, reply = _reset(agent, "Flood")
    assert reply.observation == "r" * 50 and reply.truncated
    step = session.step("hi").wait()
    assert step.observation == "s" * 50 and step.truncated and step.reward == 0.5
    assert time.monotonic() - t0 < 5


def test_an_environment_that_interrupts_or_exits_ends_its_episode_not_the_run(tmp_path, agents):
    agent = _envs(tmp_path, ["Interrupts", "Exits", "ExitsHard"])
    agents.append(agent)
    said = {}
    for name in ("Interrupts", "Exits", "ExitsHard"):
        session, _ = _reset(agent, name)
        said[name] = session.step("hi").wait()
    assert said["Interrupts"].error == "raised" and said["Interrupts"].message == "step raised KeyboardInterrupt"
    assert said["Exits"].error == "raised" and said["Exits"].message == "step raised sys.exit(5)"
    assert said["ExitsHard"].error == "crashed" and "exited with code 3" in said["ExitsHard"].message


def test_environments_in_this_process_refuse_the_same_values():
    """A class given as a Python object (not through --env) runs in this process, with the same checks."""
    namespace: dict[str, Any] = {}
    exec(ENVS, namespace)  # noqa: S102
    agent = Agent([], ToolRunner([]), {n: namespace[n] for n in ("Array", "WeirdReset", "StringReward",
                                                                  "Interrupts", "NoRow")}, "env", 4)
    assert _reset(agent, "Array")[1].error == "bad_return"
    assert _reset(agent, "WeirdReset")[1].error == "bad_return"
    session, _ = _reset(agent, "StringReward")
    assert session.step("x").wait().error == "bad_return"
    session, _ = _reset(agent, "Interrupts")
    assert session.step("x").wait().error == "raised"
    session, reply = _reset(agent, "NoRow")
    assert reply.observation == "no row needed" and session.step("x").wait().observation == "turn 1"


def test_environment_faults_end_episodes_counted_in_a_batch(tmp_path, agents, capsys):
    """Through the episode driver: the faulty rows end with an error each, the others run on."""
    from dschat.agents.episode import Episodes
    from dschat.models.loading import load_tokenizer, resolve_model
    from tests.dschat.test_tools import _drive, _ids

    tok = load_tokenizer(resolve_model("tiny"))
    agent = _envs(tmp_path, ["Fine", "StringReward", "Slow", "DictReset", "NoRow"], timeout=0.5)
    agents.append(agent)
    eos = tok.eos_token_id
    names = ["Fine", "StringReward", "Slow", "DictReset", "NoRow"]
    turn = _ids(tok, " guess") + [eos]
    ep = Episodes(agent, tok, [{"env": n, "answer": "7"} for n in names], [eos], tok.pad_token_id)
    out = _drive(ep, [turn * 4] * len(names), tok.pad_token_id, steps=400)
    assert [st.counts.errors for st in ep.state] == [0, 1, 1, 1, 0]
    assert ep.finished() == [True, False, False, False, True]
    assert [st.env_reward for st in ep.state] == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert "turn 1" in tok.decode([t for t, r, _ in out[4] if r])
    import torch

    agent.counts += ep.counts(torch.ones(2), torch.ones(1))  # as a rollout adds a batch's counts
    metrics = agent.take_metrics()
    assert metrics["episode/env_bad_return"] == 2.0 and metrics["episode/env_timeout"] == 1.0
    assert capsys.readouterr().out.count("environment error") == 1  # said once, counted always


def test_environment_shapes_are_taken_by_signature_or_refused_at_load(tmp_path, agents):
    agent = _envs(tmp_path, ["NoRow", "RowByName"])
    agents.append(agent)
    assert {n: e.takes_row for n, e in agent.envs.items()} == {"NoRow": "none", "RowByName": "keyword"}
    session, reply = _reset(agent, "NoRow")
    assert reply.observation == "no row needed"
    first, second = session.step("a").wait(), session.step("b").wait()
    assert (first.observation, first.done, second.observation, second.done) == ("turn 1", False, "turn 2", True)
    session, reply = _reset(agent, "RowByName")
    assert reply.observation == "row: 42" and session.step("x").wait().reward == 2.0
    f = _file(tmp_path, ENVS, "my_envs.py")
    for name, said in (("NeedsArgs", "NeedsArgs() needs level; dschat makes each episode's environment with no "
                                     "arguments"),
                       ("StepNoText", "StepNoText.step takes no argument; dschat calls step(text)"),
                       ("ResetTwo", "ResetTwo.reset needs row, extra; dschat calls reset(row)")):
        with pytest.raises(UserError, match=f"^--env '{f}:{name}': " + said.replace("(", r"\(").replace(")", r"\)")):
            load_envs([f"{f}:{name}"])


def test_tool_timeout_and_max_output_apply_to_environments(tmp_path):
    from dschat.config import build_config, refuse_inert
    from dschat.rlhf.config import RLHFConfig

    f = _file(tmp_path, ENVS, "my_envs.py")
    refuse_inert(build_config(RLHFConfig, {"algo": "grpo", "actor_model": "tiny", "env": [f"{f}:Fine"],
                                           "tool_timeout": 3.0, "tool_max_output": 100}),
                 {"tool_timeout", "tool_max_output"})
    with pytest.raises(UserError, match="--tool-timeout has no effect without --tools or --env"):
        refuse_inert(build_config(RLHFConfig, {"algo": "grpo", "actor_model": "tiny", "tool_timeout": 3.0}),
                     {"tool_timeout"})


def test_no_worker_outlives_close(tmp_path, agents):
    agent = _envs(tmp_path, ["Fine"])
    session, _ = _reset(agent, "Fine")
    hosts = agent._hosts
    assert hosts is not None
    pids = [s.channel.proc.pid for pool in hosts.pools.values() for s in pool.slots if s.channel is not None]
    assert pids
    agent.close()
    assert all(_wait_gone(pid) for pid in pids)
    assert os.getpid() not in pids


def test_warm_starts_a_tool_s_worker_before_its_first_call(tmp_path):
    """``ToolRunner.warm`` starts one worker per tool from a file in the background, so the first call finds it
    running; the calculator and objects stay in this process and start nothing."""
    from dschat.agents.tools import ToolRunner, load_tools

    f = tmp_path / "t.py"
    f.write_text("import os\n\ndef pid(text: str) -> str:\n    \"\"\"Its worker's pid.\n\n    Args:\n"
                 "        text: anything\n    \"\"\"\n    return str(os.getpid())\n", encoding="utf-8")
    tools = load_tools(["calculator", f"{f}:pid"])
    runner = ToolRunner(tools, 10.0, 200)
    try:
        runner.warm()
        slot = runner._pools["pid"].slots[0]
        deadline = time.monotonic() + 30
        while slot.channel is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert slot.channel is not None and list(runner._pools) == ["pid"]
        started = slot.generation
        result = runner.call("pid", {"text": "x"}).wait()
        assert result.error is None and result.text.isdigit() and int(result.text) != os.getpid()
        assert slot.generation == started and len(runner._pools["pid"].slots) == 1  # the same worker answered
    finally:
        runner.close()
