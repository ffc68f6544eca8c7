"""Dynamic batching for ``dschat serve``: a bounded queue of scoring jobs and one worker thread that drains it,
packs the reward-model rows of waiting jobs into forwards of at most a token budget, and hands each job its own
scores back.

A job larger than what is left of a forward is scored in chunks over several forwards, and small jobs that arrive
meanwhile share those forwards: while a large job is in progress, whole small jobs take up to half of each
forward's budget and the large job the rest, so a one-row request waits for one forward, not for the whole large
job, and the large job still advances by at least half a budget per forward. A job whose client has gone
(``Job.cancel``) is dropped between forwards.

Packing and chunking never change a score: ``dschat.rlhf.scoring.score_rows`` pads a row to a width that depends
on its own length alone, so a row's score is the same whatever rows share its forward. No HTTP here (``server`` is
the app).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Job:
    """One request: the reward model's token rows (empty without a reward model), each row's cost in padded
    tokens (``widths``), and what the finishing step needs; ``future`` receives ``finish(job, rm_scores)``'s
    result or its exception."""

    rows: list[list[int]]
    payload: dict[str, Any]
    widths: list[int] = field(default_factory=list)
    future: Future = field(default_factory=Future)
    done: int = 0  # rows scored so far
    scores: list[torch.Tensor] = field(default_factory=list)
    cancelled: bool = False

    def __post_init__(self) -> None:
        if len(self.widths) != len(self.rows):
            self.widths = [max(1, len(r)) for r in self.rows]

    @property
    def tokens(self) -> int:
        """Padded tokens of the rows not scored yet: what the job still costs of the budget."""
        return sum(self.widths[self.done:])

    def cancel(self) -> None:
        """The client is gone: drop the job before its next forward (one running now finishes)."""
        self.cancelled = True


class QueueFull(Exception):
    pass


class ClientGone(Exception):
    """The job was dropped because its client disconnected."""


class Batcher:
    """``submit`` jobs; the worker scores them in forwards of at most ``max_batch_tokens`` padded tokens (at least
    one row each).

    ``score(rows) -> (N,) tensor`` is the reward model's scoring function; ``finish(job, scores)`` turns a job's
    scores into its answer (mixing in rule and judge sources). At most ``max_queue`` jobs wait (the large job in
    progress does not count). ``close`` stops taking jobs and, by default, finishes every job already queued
    before the worker ends.
    """

    def __init__(self, score: Callable[[list[list[int]]], torch.Tensor],
                 finish: Callable[[Job, torch.Tensor], Any], max_batch_tokens: int, max_queue: int):
        self.score, self.finish, self.budget, self.max_queue = score, finish, max_batch_tokens, max_queue
        self.waiting: deque[Job] = deque()
        self._large: Job | None = None  # the job being scored in chunks
        self._starved = False  # the large job got no row in the last forward
        self._cond = threading.Condition()
        self._closing = False
        self.batches = 0
        self.jobs_done = 0
        self.dropped = 0  # jobs dropped because their client disconnected
        self._thread = threading.Thread(target=self._run, name="dschat-serve-batcher", daemon=True)
        self._thread.start()

    def queued(self) -> int:
        with self._cond:
            return len(self.waiting)

    def submit(self, job: Job) -> Future:
        with self._cond:
            if self._closing:
                raise QueueFull("the server is shutting down")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{self.max_queue} requests are waiting; retry later")
            self.waiting.append(job)
            self._cond.notify()
        return job.future

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking jobs; the worker finishes the forward in hand and (``drain``) every queued job, then
        ends."""
        with self._cond:
            if not drain:
                for job in self.waiting:
                    job.future.set_exception(QueueFull("the server is shutting down"))
                self.waiting.clear()
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout)

    # ------------------------------------------------------------------------------------------- the worker
    def _drop(self, job: Job) -> None:
        self.dropped += 1
        if not job.future.done():
            job.future.set_exception(ClientGone("the client disconnected"))

    def _next_pack(self) -> list[tuple[Job, int, int]]:
        """The next forward: ``(job, start, end)`` row ranges of at most the budget's padded tokens in all (at
        least one row). Jobs with no rows to score (rule sources only) come as ``(job, 0, 0)``."""
        with self._cond:
            if not self.waiting and self._large is None:
                if self._closing:
                    return []
                self._cond.wait(0.05)
            for job in [j for j in self.waiting if j.cancelled]:
                self.waiting.remove(job)
                self._drop(job)
            if self._large is not None and self._large.cancelled:
                self._drop(self._large)
                self._large = None
            pack: list[tuple[Job, int, int]] = []
            used = 0
            if self._large is None:
                # whole jobs in arrival order; the first that does not fit becomes the large job
                while self.waiting:
                    job = self.waiting[0]
                    if used + job.tokens > self.budget:
                        self._large = self.waiting.popleft()
                        break
                    pack.append((self.waiting.popleft(), 0, len(job.rows)))
                    used += job.tokens
            elif not self._starved:
                # a large job in progress: whole small jobs (any that fit, in arrival order) up to half the
                # budget, the large job the rest
                kept: deque[Job] = deque()
                for job in self.waiting:
                    if used + job.tokens <= self.budget // 2:
                        pack.append((job, 0, len(job.rows)))
                        used += job.tokens
                    else:
                        kept.append(job)
                self.waiting = kept
            if self._large is not None:  # its next rows, as many as fit
                job = self._large
                end = job.done
                while end < len(job.rows) and used + job.widths[end] <= self.budget:
                    used += job.widths[end]
                    end += 1
                if end == job.done and not pack:
                    end += 1  # a row wider than the budget goes alone
                # a large job that got no row beside the small ones goes first next time
                self._starved = end == job.done
                if end > job.done:
                    pack.append((job, job.done, end))
                if end == len(job.rows):
                    self._large = None
            return pack

    def _run(self) -> None:
        while True:
            pack = self._next_pack()
            if not pack:
                with self._cond:
                    if self._closing and not self.waiting and self._large is None:
                        return
                continue
            self._score_pack(pack)

    def _score_pack(self, pack: list[tuple[Job, int, int]]) -> None:
        rows = [r for job, a, b in pack for r in job.rows[a:b]]
        try:
            scores = self.score(rows) if rows else torch.zeros(0)
        except Exception as e:  # noqa: BLE001 - every job of the pack gets the error, the worker lives on
            with self._cond:
                for job, _, _ in pack:
                    if self._large is job:
                        self._large = None
                    if not job.future.done():
                        job.future.set_exception(e)
            return
        if rows:
            self.batches += 1
        start = 0
        for job, a, b in pack:
            job.scores.append(scores[start: start + b - a])
            start += b - a
            job.done = b
            if job.done < len(job.rows):
                continue
            if job.cancelled:
                self._drop(job)
                continue
            try:
                job.future.set_result(self.finish(job, torch.cat(job.scores) if job.scores else torch.zeros(0)))
            except Exception as e:  # noqa: BLE001
                job.future.set_exception(e)
            self.jobs_done += 1
