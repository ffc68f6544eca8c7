"""User-facing errors (one line, no traceback) and the exit codes of every dschat command, each with one meaning
(``ExitCode``; docs/cli.md lists them)."""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """What a dschat process's exit status means. The one table: commands and errors take their code from here."""

    OK = 0  # done
    FAILED = 1  # a check found an error (dschat doctor), or an unexpected failure (a Python traceback)
    USAGE = 2  # a mistake in the input (flag, file, data, environment), told in one line before anything ran
    DOES_NOT_FIT = 3  # dschat plan / train --plan: the run does not fit in memory
    STOPPED = 4  # stopped with a resumable training state (a health alarm, a reward server down): --resume goes on
    TIMED_OUT = 5  # a step that hung past its limit (the vLLM weight sync's --sync-timeout), stopped without a state
    INTERRUPTED = 130  # Ctrl-C (a state saved where one could be)


class UserError(Exception):
    """A mistake in the user's input (file, flag, data). Printed as one line; the process exits with 2."""

    exit_code: int = ExitCode.USAGE


class TimedOut(UserError):
    """A step that did not finish within its limit (``stop_hung_process``); exit code 5."""

    exit_code = ExitCode.TIMED_OUT
    message = "timed out"

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else self.message


def first_line(error: BaseException | str, limit: int = 200) -> str:
    """The first non-blank line of an exception's message, cut to ``limit`` characters; the exception's type name
    when the message is empty. The one way dschat quotes an error inside its own one-line messages."""
    text = str(error).strip()
    if not text:
        return type(error).__name__ if isinstance(error, BaseException) else ""
    return text.splitlines()[0][:limit]


def stop_hung_process(message: str, grace_s: float = 30.0) -> None:
    """From a watchdog thread: stop a process whose main thread is stuck, as cleanly as it allows.

    ``TimedOut(message)`` is raised in the main thread, which unwinds as from any error: the trackers' runs end,
    the command prints the line and exits with code 5, the exit handlers (the output folder's lock) run. A main
    thread blocked inside native code (a collective waiting forever) only sees it once that call returns; if it has
    not exited after ``grace_s``, this thread prints the line, runs the exit handlers itself and ends the process
    with the same code."""
    import atexit
    import ctypes
    import os
    import sys
    import threading

    hung = type("TimedOut", (TimedOut,), {"message": message})  # the async raise takes a class, not an instance
    main = threading.main_thread()
    if main.ident is not None and main.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main.ident), ctypes.py_object(hung))
        main.join(grace_s)
        if not main.is_alive():  # it unwound: the interpreter is exiting as after any error
            return
    print(f"dschat: error: {message}", file=sys.stderr, flush=True)
    atexit._run_exitfuncs()  # what a normal exit runs (os._exit skips it): the lock's release, the trackers' close
    sys.stderr.flush()
    os._exit(ExitCode.TIMED_OUT)
