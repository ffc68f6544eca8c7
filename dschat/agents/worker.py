"""User code in processes of its own: the worker program that runs a user's tool or environment, and the run's
side that starts, feeds and kills the workers.

Run as a program (``python worker.py MODE SPEC``) this file is the worker. It imports the standard library and the
user's file, nothing of dschat, and reads one JSON request a line and answers one JSON line: what crosses between
it and the run is plain data (text, numbers, booleans), never a pickle. Each worker leads a process group of its
own, so killing the group also ends what the user's code forked; a worker whose run is gone kills its group.

- ``probe``: import the file once and say whether it imported (a file that exits, or kills its process, at import
  is caught here, before the run imports it);
- ``tool``: call the tool with each request's arguments; the answer is its text (the return value as text, or what
  it printed when it returns None) or its error;
- ``env``: environments by episode id: ``reset`` makes the instance and resets it, ``step`` steps it, ``close``
  drops it.

The run's side (``Slot``, ``ToolPool``, ``EnvPool``): a slot is one worker process and one thread of the run that
writes its requests and waits for each reply under the deadline. A request past its deadline, a worker that dies
or answers something that is not a reply: the worker's group is killed, the request gets its error, and the next
request starts a fresh worker. ``as_text``, ``call_tool``, ``env_reset`` and ``env_step`` check and convert what
user code returns; the worker and the run's in-process path (the built-in calculator, classes and functions given
as Python objects) share them.
"""

from __future__ import annotations

import atexit
import json
import math
import numbers
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

WORKER_FILE = os.path.abspath(__file__)
STARTUP_S = 120.0  # a worker's import of the user's file (once per worker; the deadline of calls starts after it)
PROBE_S = 300.0  # the probe's import
WORKERS = 4  # workers per tool or environment: calls beyond wait their turn (their deadline starts when they run)
ERROR_KINDS_ENV = ("raised", "bad_return", "timeout", "crashed", "lost")


# ------------------------------------------------------------------------------------------------ plain values
def clean(text: str) -> str:
    """A plain ``str`` holding ``text`` (a subclass's own methods never run), lone surrogates replaced."""
    text = str.__str__(text)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "replace").decode("utf-8")
    return text


def cut(text: str, limit: int) -> tuple[str, bool]:
    """``text`` as plain text, at most ``limit`` characters; whether it was longer."""
    head = clean(str.__getitem__(text, slice(0, limit + 1)))
    return head[:limit], len(head) > limit


def type_name(value: Any) -> str:
    try:
        name = type(value).__name__
        return clean(name) if isinstance(name, str) else "object"
    except BaseException:  # noqa: BLE001 - a metaclass's own __name__: the generic word
        return "object"


def first_line(error: BaseException, limit: int = 200) -> str:
    """``Type: the first line of its message`` (the type alone when the message is empty or cannot be read)."""
    name = type_name(error)
    if isinstance(error, SystemExit):
        return f"sys.exit({error.code!r})" if type(error.code) in (int, str, type(None)) else "sys.exit()"
    try:
        text = clean(str(error)).strip()
    except BaseException:  # noqa: BLE001 - an exception whose __str__ raises
        text = ""
    text = text.splitlines()[0][:limit] if text else ""
    return f"{name}: {text}" if text else name


def as_text(value: Any, limit: int) -> tuple[str | None, str]:
    """A tool's return value as text: a string as it is, numbers, lists and dicts as JSON; ``(None, why)`` for
    anything else or for what cannot be written (too deep, an integer too long, a value whose methods raise)."""
    kind = type_name(value)
    try:
        if isinstance(value, str):
            return clean(str.__getitem__(value, slice(0, limit + 1))), ""
        if isinstance(value, bool):
            return ("true" if value else "false"), ""
        if isinstance(value, int):
            return int.__repr__(value), ""
        if isinstance(value, float):
            return (float.__repr__(value), "") if math.isfinite(value) else (None, f"a {kind} that is not finite")
        if isinstance(value, list | tuple | dict):
            return clean(json.dumps(value, ensure_ascii=False, allow_nan=False)), ""
    except RecursionError:
        return None, f"a {kind} nested too deeply to write as JSON"
    except BaseException as e:  # noqa: BLE001 - whatever the value does, it is the call's error
        return None, f"a {kind} that cannot be written as text ({first_line(e, 80)})"
    return None, f"a {kind}, not text"


_loop: Any = None


def settle(value: Any) -> Any:
    """An awaitable's result (an ``async def`` tool, reset or step), run on this process's own event loop; any
    other value as it is."""
    if not isinstance(value, Awaitable):
        return value
    import asyncio

    global _loop
    if _loop is None or _loop.is_closed():
        _loop = asyncio.new_event_loop()
    return _loop.run_until_complete(value)


class _Printed:
    """``sys.stdout`` of a worker process during a tool call: what the tool prints, kept up to one character past
    the cap."""

    def __init__(self, limit: int):
        self.parts: list[str] = []
        self.room = limit + 1

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type_name(text)}")
        if self.room > 0:
            head = clean(str.__getitem__(text, slice(0, self.room)))
            self.parts.append(head)
            self.room -= len(head)
        return len(text)

    def flush(self) -> None:
        pass

    def text(self) -> str:
        return "".join(self.parts)


def call_tool(fn: Callable[..., Any], arguments: dict[str, Any], limit: int) -> dict[str, Any]:
    """``fn(**arguments)`` as a reply: ``{"text", "truncated"}`` or ``{"error": raised | junk, "message"}``.

    In a worker (this file run as the program: a process of the tool's own) what the tool prints is the answer
    when it returns None: ``sys.stdout`` is the call's buffer while it runs. Anywhere else (the run's process: the
    calculator, a function given as an object) ``sys.stdout`` is the process's, shared with every thread, so it is
    left alone: the tool's prints go where the process's go, and its return value is its answer (None: empty)."""
    printed = _Printed(limit)
    capture = __name__ == "__main__"
    saved = sys.stdout
    if capture:
        sys.stdout = printed  # type: ignore[assignment]
    try:
        value = settle(fn(**arguments))
    except BaseException as e:  # noqa: BLE001 - the tool's failure is the call's error message
        return {"error": "raised", "message": first_line(e)}
    finally:
        if capture:
            sys.stdout = saved
    if value is None:
        text = printed.text()
    else:
        text, why = as_text(value, limit)
        if text is None:
            return {"error": "junk", "message": why}
    text, truncated = cut(text, limit)
    return {"text": text, "truncated": truncated}


# ------------------------------------------------------------------------------------------------ environments
def env_new(cls: Any) -> tuple[Any, dict[str, Any] | None]:
    """A new instance of the environment ``cls`` (no arguments), or the error reply."""
    try:
        return cls(), None
    except BaseException as e:  # noqa: BLE001 - the user's environment: the episode's error
        name = cls.__name__ if isinstance(cls, type) else "the environment"
        return None, {"error": "raised", "message": f"{name}() raised {first_line(e, 120)}"}


def env_reset(instance: Any, row: dict[str, Any], takes_row: str, limit: int) -> dict[str, Any]:
    """``instance.reset(row)`` (or ``reset(row=row)``, or ``reset()``, as ``takes_row`` says) as a reply:
    ``{"text": text or None, "truncated"}`` or an error. Only text or None is taken: anything else is refused
    without being looked at (no truth value, no ``str()``)."""
    try:
        if takes_row == "positional":
            value = instance.reset(row)
        elif takes_row == "keyword":
            value = instance.reset(row=row)
        else:
            value = instance.reset()
        value = settle(value)
    except BaseException as e:  # noqa: BLE001 - the user's environment: the episode's error
        return {"error": "raised", "message": f"reset raised {first_line(e, 120)}"}
    try:
        if value is None:
            return {"text": None, "truncated": False}
        if isinstance(value, str):
            text, truncated = cut(value, limit)
            return {"text": text, "truncated": truncated}
    except BaseException:  # noqa: BLE001 - a value whose type checks raise: refused below
        pass
    return {"error": "bad_return", "message": f"reset() must return text or None, got {type_name(value)}"}


def check_step(value: Any, limit: int) -> dict[str, Any]:
    """A ``step`` result as a reply: ``(observation: text or None, reward: a finite number (None reads as 0),
    done: a bool)``, or an object with those three attributes; anything looser is an error (a reward ``"1.5"``,
    ``done="no"``)."""
    try:
        if isinstance(value, tuple | list):
            if len(value) != 3:
                return _bad(f"step() must return (observation, reward, done), got a {type_name(value)} of "
                            f"{len(value)}")
            obs, reward, done = value
        elif all(hasattr(value, a) for a in ("observation", "reward", "done")):
            obs, reward, done = value.observation, value.reward, value.done
        else:
            return _bad(f"step() must return (observation, reward, done), got {type_name(value)}")
        if obs is not None and not isinstance(obs, str):
            return _bad(f"the observation must be text or None, got {type_name(obs)}")
        if reward is None:
            reward = 0.0
        elif isinstance(reward, numbers.Real) and not isinstance(reward, str):
            reward = float(reward)
        else:
            return _bad(f"the reward must be a number, got {type_name(reward)}")
        if not math.isfinite(reward):
            return _bad("the reward is not finite")
        if isinstance(done, bool):
            done = bool.__bool__(done)
        elif type(done).__module__ == "numpy" and type(done).__name__ in ("bool_", "bool"):
            done = bool(done)
        else:
            return _bad(f"done must be True or False, got {type_name(done)}")
        text, truncated = cut(obs, limit) if obs is not None else (None, False)
    except BaseException as e:  # noqa: BLE001 - a value whose checks raise
        return _bad(f"step() returned a value that cannot be read ({first_line(e, 80)})")
    return {"observation": text, "reward": reward, "done": done, "truncated": truncated}


def _bad(message: str) -> dict[str, Any]:
    return {"error": "bad_return", "message": message}


def env_step(instance: Any, text: str, limit: int) -> dict[str, Any]:
    """``instance.step(text)`` (awaited when it is ``async``) as a reply, checked by ``check_step``."""
    try:
        value = settle(instance.step(text))
    except BaseException as e:  # noqa: BLE001 - the user's environment: the episode's error
        return {"error": "raised", "message": f"step raised {first_line(e, 120)}"}
    return check_step(value, limit)


# ------------------------------------------------------------------------------------------------ the worker
def _send(fd: int, obj: Any) -> None:
    data = (json.dumps(obj, ensure_ascii=True) + "\n").encode("ascii")
    while data:
        data = data[os.write(fd, data):]


def _import(path: str, name: str | None) -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("dschat_user", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["dschat_user"] = module
    spec.loader.exec_module(module)
    if name is None:
        return module
    if not hasattr(module, name):
        raise AttributeError(f"{path} has no {name!r}")
    return getattr(module, name)


def _watch(parent: int) -> None:
    """Kill this worker's process group (it and what the user's code forked) once the run is gone."""

    def run() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:  # the run is gone: end this worker's group (it leads it), then itself
                try:
                    os.killpg(0, signal.SIGKILL)
                finally:
                    os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=run, name="dschat-watch", daemon=True).start()


def worker_main(argv: list[str]) -> None:
    """The worker: ``MODE SPEC`` (SPEC a JSON object: path, name, limit, sys_path, parent, takes_row)."""
    mode, spec = argv[0], json.loads(argv[1])
    proto_in, proto_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    # the protocol has pipes of its own: what a tool prints outside a call goes nowhere (during one, it is the
    # call's output), what an environment prints goes to the run's stderr
    os.dup2(2 if mode == "env" else null, 1)
    os.close(null)

    def forget() -> None:  # a process forked by user code never holds the protocol's pipes
        for fd in (proto_in, proto_out):
            try:
                os.close(fd)
            except OSError:
                pass

    os.register_at_fork(after_in_child=forget)
    sys.path[:] = spec["sys_path"]
    _watch(int(spec["parent"]))
    try:
        obj = _import(spec["path"], spec.get("name"))
    except BaseException as e:  # noqa: BLE001 - the file's failure, told to the run in one line
        _send(proto_out, {"failed": first_line(e)})
        return
    if mode == "probe":
        _send(proto_out, {"ok": True})
        return
    _send(proto_out, {"ready": True})
    limit, takes_row = int(spec["limit"]), spec.get("takes_row", "positional")
    instances: dict[int, Any] = {}
    with os.fdopen(proto_in, "rb") as requests:
        for line in requests:
            req = json.loads(line)
            if mode == "tool":
                _send(proto_out, call_tool(obj, req["args"], limit))
                continue
            op, key = req["op"], req["id"]
            if op == "close":
                instances.pop(key, None)
                continue
            if op == "reset":
                instance, error = env_new(obj)
                if error is None:
                    instances[key] = instance
                    reply = env_reset(instance, req["row"], takes_row, limit)
                    if "error" in reply:
                        instances.pop(key, None)
                else:
                    reply = error
            else:
                instance = instances.get(key)
                reply = env_step(instance, req["text"], limit) if instance is not None else \
                    {"error": "lost", "message": "no such episode"}
            _send(proto_out, reply)
    os.killpg(0, signal.SIGKILL)  # the run closed the pipe (or is gone): this worker and what it forked end here


# ------------------------------------------------------------------------------------------------ the run's side
def _describe_end(code: int | None) -> str:
    """How a worker ended, to follow "its process": ``exited with code 7``, ``was killed by SIGSEGV``."""
    if code is None:
        return "ended"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _Channel:
    """A worker process and its two pipes (non-blocking), read a line at a time under a deadline."""

    def __init__(self, mode: str, spec: dict[str, Any], max_line: int, stderr: Any = None):
        self.proc = subprocess.Popen([sys.executable, WORKER_FILE, mode, json.dumps(spec)],
                                     stdin=subprocess.PIPE if mode != "probe" else subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=stderr, start_new_session=True, bufsize=0)
        self.owner = os.getpid()
        self.buf = bytearray()
        self.max_line = max_line
        self.lock = threading.Lock()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                os.set_blocking(pipe.fileno(), False)

    def write(self, data: bytes, deadline: float) -> str | None:
        """None once written, else ``timeout`` or ``ended``."""
        assert self.proc.stdin is not None
        fd, view = self.proc.stdin.fileno(), memoryview(data)
        while view:
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            _, ready, _ = select.select([], [fd], [], min(left, 0.5))
            if not ready:
                if self.proc.poll() is not None:
                    return "ended"
                continue
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:
                continue
            except OSError:
                return "ended"
        return None

    def read(self, deadline: float) -> tuple[bytes | None, str]:
        """The next line (without its newline), or ``(None, why)``: ``timeout``, ``ended``, ``too_long``."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            end = self.buf.find(b"\n")
            if end >= 0:
                line = bytes(self.buf[:end])
                del self.buf[:end + 1]
                return line, ""
            if len(self.buf) > self.max_line:
                return None, "too_long"
            left = deadline - time.monotonic()
            if left <= 0:
                return None, "timeout"
            ready, _, _ = select.select([fd], [], [], min(left, 0.5))
            if not ready:
                if self.proc.poll() is not None:  # ended while something it forked holds the pipe open
                    return None, "ended"
                continue
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            except OSError:
                return None, "ended"
            if not chunk:
                return None, "ended"
            self.buf += chunk

    def kill(self) -> int | None:
        """Kill the worker's process group (the worker and what it forked); its exit status."""
        with self.lock:
            if self.owner == os.getpid():
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    try:
                        pipe.close()
                    except OSError:
                        pass
            try:
                return self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                return None


def _reply(line: bytes) -> dict[str, Any] | None:
    """A worker's line as a reply (a JSON object), None when it is not one."""
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


_probed: dict[str, str | None] = {}


def probe(path: str) -> str | None:
    """Import ``path`` in a child process first: None when it imports, else what went wrong, to follow
    ``importing FILE`` (it exited or killed its process at import, raised, or did not finish)."""
    key = os.path.realpath(path)
    if key in _probed:
        return _probed[key]
    channel = _Channel("probe", {"path": key, "name": None, "sys_path": list(sys.path), "parent": os.getpid()},
                       1 << 16, stderr=subprocess.DEVNULL)
    line, why = channel.read(time.monotonic() + PROBE_S)
    code = channel.kill()
    reply = _reply(line) if line is not None else None
    if reply is not None and reply.get("ok") is True:
        out = None
    elif reply is not None and isinstance(reply.get("failed"), str):
        out = f"failed: {clean(reply['failed'])[:300]}"
    elif why == "timeout":
        out = f"did not finish within {PROBE_S:g} s"
    else:
        out = (f"ended its process before it finished (the process {_describe_end(code)}): a tool or environment "
               "file must not end its process at import")
    _probed[key] = out
    return out


_slots: weakref.WeakSet[Slot] = weakref.WeakSet()


class Slot:
    """One worker process (started on first use, again after a fault) and the run's thread that talks to it:
    each job of ``jobs`` is written to the worker and its reply awaited under ``timeout`` seconds."""

    def __init__(self, mode: str, spec: dict[str, Any], label: str, timeout: float, jobs: queue.Queue[Any],
                 start: bool = False):
        self.mode, self.spec, self.label, self.timeout, self.jobs = mode, spec, label, timeout, jobs
        self.start_now = start  # start the worker before the first job arrives
        self.channel: _Channel | None = None
        self.generation = 0  # one more each time the worker goes: an environment instance lives in one generation
        self.live: set[int] = set()  # environments: the episode ids this worker holds
        self.busy = False
        self.max_line = 16 * int(spec["limit"]) + (1 << 16)
        _slots.add(self)
        threading.Thread(target=self._serve, name=f"dschat-{label}", daemon=True).start()

    def _serve(self) -> None:
        if self.start_now:
            try:
                self._start()  # a failure leaves no worker: the first job starts one again and reports why
            except BaseException:  # noqa: BLE001 - the same
                self.stop()
        while True:
            job = self.jobs.get()
            if job is None:
                self.stop()
                return
            self.busy = True
            try:
                reply = self._run(job)
            except BaseException as e:  # noqa: BLE001 - a fault on the run's side: the job gets it, a fresh worker
                self.stop()
                reply = {"error": "crashed", "message": f"the worker failed ({first_line(e, 120)})"}
            self.busy = False
            if job.answers:
                job.finish(reply)

    def _run(self, job: Job) -> dict[str, Any] | None:
        if job.generation is not None and job.generation != self.generation:
            return {"error": "lost", "message": "lost"}
        if self.channel is None and not job.answers:  # nothing to tell a worker that is gone
            return None
        if self.channel is None:
            why = self._start()
            if why is not None:
                return {"error": "crashed", "message": why}
        assert self.channel is not None
        job.generation = self.generation
        data = (json.dumps(job.payload, ensure_ascii=True, default=_jsonable) + "\n").encode("ascii")
        deadline = time.monotonic() + self.timeout
        why = self.channel.write(data, deadline)
        if why is None and not job.answers:
            return None
        line = None
        if why is None:
            line, why = self.channel.read(deadline)
        if line is not None:
            reply = _reply(line)
            if reply is not None:
                return reply
            why = "junk"
        if why == "timeout":
            self.stop()
            return {"error": "timeout", "message": "timeout"}
        if why == "ended":
            return {"error": "crashed", "message": f"its process {_describe_end(self.stop())}"}
        self.stop()
        return {"error": "crashed", "message": "its process wrote something that is not a reply"}

    def _start(self) -> str | None:
        self.channel = _Channel(self.mode, {**self.spec, "parent": os.getpid()}, self.max_line)
        line, why = self.channel.read(time.monotonic() + STARTUP_S)
        reply = _reply(line) if line is not None else None
        if reply is not None and reply.get("ready") is True:
            return None
        if reply is not None and isinstance(reply.get("failed"), str):
            self.stop()
            return f"its process could not start: importing {self.spec['path']} failed: {clean(reply['failed'])[:200]}"
        if why == "timeout":
            self.stop()
            return f"its process did not start within {STARTUP_S:g} s"
        return f"its process {_describe_end(self.stop())} before it was ready"

    def stop(self) -> int | None:
        """Kill the worker's process group (a fresh worker starts with the next job); its exit status."""
        channel, self.channel = self.channel, None
        if channel is None:
            return None
        self.generation += 1
        self.live.clear()
        return channel.kill()


def _jsonable(value: Any) -> Any:
    """What a data row holds that JSON does not (an array, a date): as a list, else as text."""
    tolist = getattr(value, "tolist", None)
    return tolist() if callable(tolist) else str(value)


class Job:
    """One request to a worker; its ``reply`` (plain data) once ``done()``."""

    __slots__ = ("payload", "answers", "generation", "reply", "_event")

    def __init__(self, payload: dict[str, Any] | None = None, answers: bool = True, generation: int | None = None,
                 reply: dict[str, Any] | None = None):
        self.payload, self.answers, self.generation, self.reply = payload, answers, generation, reply
        self._event = threading.Event()
        if reply is not None:
            self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self) -> dict[str, Any]:
        self._event.wait()
        assert self.reply is not None
        return self.reply

    def finish(self, reply: dict[str, Any] | None) -> None:
        self.reply = reply if reply is not None else {"error": "crashed", "message": "no reply"}
        self._event.set()


def worker_spec(path: str, name: str, limit: int, takes_row: str = "positional") -> dict[str, Any]:
    return {"path": os.path.realpath(path), "name": name, "limit": int(limit), "sys_path": list(sys.path),
            "takes_row": takes_row}


class ToolPool:
    """The workers of one tool: up to ``size``, started as calls need them; a call waits in the queue for a free
    one (its deadline starts when it runs)."""

    def __init__(self, spec: dict[str, Any], label: str, timeout: float, size: int = WORKERS):
        self.spec, self.label, self.timeout, self.size = spec, label, timeout, size
        self.jobs: queue.Queue[Any] = queue.Queue()
        self.slots: list[Slot] = []
        self.lock = threading.Lock()

    def warm(self) -> None:
        """Start the first worker now (in its thread), ahead of the first call."""
        with self.lock:
            if not self.slots:
                self.slots.append(Slot("tool", self.spec, self.label, self.timeout, self.jobs, start=True))

    def submit(self, arguments: dict[str, Any]) -> Job:
        job = Job({"args": arguments})
        with self.lock:
            waiting = sum(s.busy for s in self.slots) + self.jobs.qsize()
            if waiting >= len(self.slots) and len(self.slots) < self.size:
                self.slots.append(Slot("tool", self.spec, self.label, self.timeout, self.jobs))
        self.jobs.put(job)
        return job

    def close(self) -> None:
        for slot in self.slots:
            self.jobs.put(None)
            slot.stop()
        self.slots = []


class EnvPool:
    """The workers of one environment class: up to ``size``; each episode's instance lives in one of them (a free
    worker first, else the one holding the fewest), and its requests queue on that worker."""

    def __init__(self, spec: dict[str, Any], label: str, timeout: float, size: int = WORKERS):
        self.spec, self.label, self.timeout, self.size = spec, label, timeout, size
        self.slots: list[Slot] = []
        self.lock = threading.Lock()
        self.next_id = 0

    def open(self) -> tuple[Slot, int]:
        with self.lock:
            self.next_id += 1
            free = [s for s in self.slots if not s.live]
            if free:
                slot = free[0]
            elif len(self.slots) < self.size:
                slot = Slot("env", self.spec, self.label, self.timeout, queue.Queue())
                self.slots.append(slot)
            else:
                slot = min(self.slots, key=lambda s: len(s.live))
            slot.live.add(self.next_id)
            return slot, self.next_id

    def close(self) -> None:
        for slot in self.slots:
            slot.jobs.put(None)
            slot.stop()
        self.slots = []


@atexit.register
def _kill_workers() -> None:
    """At the run's end every worker's process group goes, with whatever the user's code forked."""
    for slot in list(_slots):
        channel = slot.channel
        if channel is not None and channel.owner == os.getpid():
            try:
                os.killpg(channel.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


if __name__ == "__main__":
    worker_main(sys.argv[1:])
