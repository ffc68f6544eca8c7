"""The parsing stage of ``dschat serve``: a request body becomes a scoring job (JSON, shape checks, the rows
encoded with the reward model's tokenizer) off the event loop, in bounded steps, fairly, with a backlog bound and
cancellation.

A request's preparation is a generator (``RewardService.prepare``) that yields between bounded steps: the JSON
walk, the request's shape, each chunk of rows encoded. Two lanes, each one thread with its own copy of the
tokenizer (a fast tokenizer must not be called from two threads at once), run the steps of their requests in
turn, one step of each before the next of any, so a small request waits for at most one step of each request
ahead of it, never for a whole large one:

- the ``small`` lane takes bodies of at most ``bulk_bytes``;
- the ``bulk`` lane takes the larger ones, so even a single long row (one step that cannot be cut) never delays
  a small request.

A request whose client has gone (``ParseTask.cancel``) is dropped before its next step. At most ``max_pending``
requests are in the stage, being parsed or waiting for it; ``submit`` refuses more (``QueueFull``: 429). No HTTP
here (``server`` is the app).
"""

from __future__ import annotations

import copy
import threading
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import Future
from typing import Any

from dschat.serving.batcher import ClientGone, QueueFull

BULK_BYTES = 1 << 20  # bodies larger than this go to the bulk lane


class ParseTask:
    """One request in the stage: ``steps(tokenizer)`` builds its generator on the lane's thread; ``future`` gets
    the generator's return value or its exception (``ClientGone`` once cancelled)."""

    def __init__(self, steps: Callable[[Any], Generator[None, None, Any]], size: int):
        self.make, self.size = steps, size
        self.steps: Generator[None, None, Any] | None = None
        self.future: Future = Future()
        self.cancelled = False
        self.done_steps = 0

    def cancel(self) -> None:
        """The client is gone: the task is dropped before its next step (a step running now finishes)."""
        self.cancelled = True


class _Lane:
    def __init__(self, parser: Parser, name: str, tokenizer: Any):
        self.parser, self.tokenizer = parser, tokenizer
        self.tasks: deque[ParseTask] = deque()
        self.thread = threading.Thread(target=self._run, name=f"dschat-serve-parse-{name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        cond = self.parser.cond
        while True:
            with cond:
                while not self.tasks and not self.parser.closing:
                    cond.wait()
                if not self.tasks:
                    return
                task = self.tasks.popleft()
            if self._step(task):
                with cond:
                    self.tasks.append(task)  # its next step after one of every other task's
            else:
                self.parser.finished(task)

    def _step(self, task: ParseTask) -> bool:
        """One step of ``task``; False once it is over (a result, an error, or dropped)."""
        if task.cancelled or self.parser.closing:
            if task.steps is not None:
                task.steps.close()
            task.future.set_exception(ClientGone("the client disconnected") if task.cancelled else
                                      QueueFull("the server is shutting down"))
            if task.cancelled:
                with self.parser.cond:
                    self.parser.dropped += 1
            return False
        try:
            if task.steps is None:
                task.steps = task.make(self.tokenizer)
            next(task.steps)
            task.done_steps += 1
            return True
        except StopIteration as done:
            task.future.set_result(done.value)
        except Exception as e:  # noqa: BLE001 - the request's error (BadRequest, ...) goes to its caller
            task.future.set_exception(e)
        return False


class Parser:
    """The stage: ``submit`` a request's steps, await ``task.future``. ``tokenizer``: the reward model's (None
    without one); the bulk lane uses a copy. ``dropped`` counts tasks dropped for a client that left."""

    def __init__(self, tokenizer: Any, max_pending: int, bulk_bytes: int = BULK_BYTES):
        self.max_pending, self.bulk_bytes = max_pending, bulk_bytes
        self.cond = threading.Condition()
        self.closing = False
        self.pending = 0
        self.dropped = 0
        self.small = _Lane(self, "small", tokenizer)
        try:
            other = copy.deepcopy(tokenizer)
        except Exception:  # noqa: BLE001 - a tokenizer that cannot be copied: one lane for every body
            other = None
        self.bulk = _Lane(self, "bulk", other) if other is not None or tokenizer is None else None

    def submit(self, steps: Callable[[Any], Generator[None, None, Any]], size: int) -> ParseTask:
        """Queue a request of ``size`` body bytes; ``QueueFull`` when ``max_pending`` are in the stage."""
        task = ParseTask(steps, size)
        lane = self.bulk if self.bulk is not None and size > self.bulk_bytes else self.small
        with self.cond:
            if self.closing:
                raise QueueFull("the server is shutting down")
            if self.pending >= self.max_pending:
                raise QueueFull(f"{self.max_pending} requests are being parsed or wait for it (--max-queue); retry "
                                "later")
            self.pending += 1
            lane.tasks.append(task)
            self.cond.notify_all()
        return task

    def finished(self, task: ParseTask) -> None:
        with self.cond:
            self.pending -= 1

    def close(self, timeout: float | None = None) -> None:
        """Stop: the tasks still in the stage are refused (their clients have had uvicorn's graceful shutdown to
        get their answers)."""
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        for lane in (self.small, self.bulk):
            if lane is not None:
                lane.thread.join(timeout)
