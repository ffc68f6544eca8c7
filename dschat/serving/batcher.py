"""Dynamic batching for ``dschat serve``: a bounded queue of scoring jobs and one worker thread that drains it,
packs the reward-model rows of as many waiting jobs as fit a token budget into one call of the scoring function,
and hands each job its own scores back.

Packing never changes a score: ``dschat.rlhf.scoring.score_rows`` pads a row to a width that depends on its own
length alone, so a row's score is the same whatever rows share its forward. No HTTP here (``server`` is the app).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Job:
    """One request: the reward model's token rows (empty without a reward model) and what the finishing step
    needs; ``future`` receives ``finish(job, rm_scores)``'s result or its exception."""

    rows: list[list[int]]
    payload: dict[str, Any]
    tokens: int = 0  # padded tokens of ``rows``, what the job costs of the budget
    future: Future = field(default_factory=Future)


class QueueFull(Exception):
    pass


class Batcher:
    """``submit`` jobs; the worker scores them in packs of at most ``max_batch_tokens`` padded tokens (a job larger
    than the budget goes alone, in forwards of at most the budget).

    ``score(rows) -> (N,) tensor`` is the reward model's scoring function; ``finish(job, scores)`` turns a job's
    scores into its answer (mixing in rule and judge sources). ``close`` stops taking jobs and, by default,
    finishes every job already queued before the worker ends.
    """

    def __init__(self, score: Callable[[list[list[int]]], torch.Tensor],
                 finish: Callable[[Job, torch.Tensor], Any], max_batch_tokens: int, max_queue: int):
        self.score, self.finish, self.budget = score, finish, max_batch_tokens
        self.queue: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self._closing = threading.Event()
        self._carry: Job | None = None  # drawn but over the budget: first in the next pack
        self.batches = 0
        self.jobs_done = 0
        self._thread = threading.Thread(target=self._run, name="dschat-serve-batcher", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> Future:
        if self._closing.is_set():
            raise QueueFull("the server is shutting down")
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"{self.queue.maxsize} requests are waiting; retry later") from None
        return job.future

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking jobs; the worker finishes the pack in hand and (``drain``) every queued job, then ends."""
        if not drain:
            while True:
                try:
                    self.queue.get_nowait().future.set_exception(QueueFull("the server is shutting down"))
                except queue.Empty:
                    break
        self._closing.set()
        self._thread.join(timeout)

    def _next_pack(self) -> list[Job]:
        first = self._carry
        self._carry = None
        if first is None:
            try:
                first = self.queue.get(timeout=0.05)
            except queue.Empty:
                return []
        pack, tokens = [first], first.tokens
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                break
            if tokens + job.tokens > self.budget:
                self._carry = job
                break
            pack.append(job)
            tokens += job.tokens
        return pack

    def _run(self) -> None:
        while True:
            pack = self._next_pack()
            if not pack:
                if self._closing.is_set() and self._carry is None and self.queue.empty():
                    return
                continue
            self._score_pack(pack)

    def _score_pack(self, pack: list[Job]) -> None:
        rows = [r for job in pack for r in job.rows]
        try:
            scores = self.score(rows) if rows else torch.zeros(0)
        except Exception as e:  # noqa: BLE001 - every job of the pack gets the error, the worker lives on
            for job in pack:
                job.future.set_exception(e)
            return
        self.batches += 1
        start = 0
        for job in pack:
            mine = scores[start: start + len(job.rows)]
            start += len(job.rows)
            try:
                job.future.set_result(self.finish(job, mine))
            except Exception as e:  # noqa: BLE001
                job.future.set_exception(e)
            self.jobs_done += 1
