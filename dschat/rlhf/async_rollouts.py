"""Where stage 3's answers come from: the trainer samples them itself between its updates (``Lockstep``, the
default), or a sampler in a process of its own samples them while the trainer trains (``AsyncRollouts``:
``--async-rollouts`` starts one, ``--sampler HOST:PORT`` uses one started apart; docs/generation.md,
Asynchronous rollouts).

Both give the algorithm what it samples through (``engine``: the hybrid engine, or this object standing in for
it), so no algorithm knows which it runs with. The asynchronous one:

- **samples ahead.** Each prompt batch an algorithm draws is sampled by one or more calls (GRPO: each prompt
  ``G`` times; ReMax: a greedy answer, then ``G`` sampled ones). The calls of the last batch are the pattern:
  when the algorithm draws batch ``b``, the sampler is asked for the pattern's calls of every batch up to
  ``b + K * n`` (``K`` = ``--max-staleness``, ``n`` the fewest batches a step has drawn), so it samples the next
  steps' answers while this step trains. A call that does not match what was sampled ahead for it (a step that
  drew otherwise) is asked for then, and the answers sampled ahead for it are dropped (``async/dropped``).
- **bounds staleness.** A request is sampled with the last weight update sent before it, and the trainer sends
  one after every step (``updated``): answers asked for at step ``s`` come from version ``s`` and are trained at
  a step no later than ``s + K`` (each step draws at least one batch). An answer more than ``K`` versions old
  is dropped and sampled again. ``K = 0`` asks for each call when the algorithm makes it, and sends the
  trainer's RNG state with it, so the run is the synchronous run, figure for figure.
- **marks what sampled.** With ``K > 0`` the sampler's log-probs are the behaviour policy's: the rollout holds
  them as ``engine_logprobs`` under ``async/``, and PPO and the GRPO family weigh their loss by
  ``min(pi_prox / mu, C)`` (``rollout.importance_weights``, the decoupled objective), ``pi_prox`` being the
  trainer's log-probs before its update (the old log-probs they already take).
- **keeps its answers in the state.** Answers sampled but not yet trained on are part of a saved state
  (safetensors; JSON for their bookkeeping): a resumed run trains on the very answers, from the very versions,
  that the uninterrupted run would have. (Sampling them again would need the older weights they came from.)

Evaluations sample on the trainer, with its current weights, as in lockstep.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass
from typing import Any

import torch

from dschat import engine as E
from dschat.errors import UserError
from dschat.generation.decode import Generated, GenerationConfig, Prompts
from dschat.generation.sampler import PARENT_ENV, Answer, SamplerClient, SamplerLost, open_sampler
from dschat.generation.weight_plane import Sender, Update, WeightLinkError
from dschat.rlhf.rollout import episode_rows, repeat_prompts


class Lockstep:
    """The trainer samples every answer itself, between its updates."""

    can_fail = False  # nothing outside the trainer to lose mid-step

    def __init__(self, hybrid: Any):
        self.engine = hybrid

    def watch(self, stream: Any) -> Any:
        return stream

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        yield

    def updated(self, version: int) -> None:
        pass

    def take_metrics(self) -> dict[str, float]:
        return {}

    def state(self, wait: bool = True) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return {}, {}

    def describe(self) -> str:
        return f"sampling on {self.engine.backend.name}"

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class Call:
    """One sampling call of a prompt batch: each prompt ``copies`` times in a row, sampled with ``settings`` (a
    ``GenerationConfig``'s fields but ``logprobs``, which the sampler always computes), as episodes or not."""

    copies: int
    settings: tuple[tuple[str, Any], ...]
    episodes: bool = False

    @staticmethod
    def of(config: GenerationConfig, copies: int, episodes: bool) -> Call:
        return Call(copies, tuple((k, v) for k, v in asdict(config).items() if k != "logprobs"), episodes)

    def config(self) -> GenerationConfig:
        return GenerationConfig(**dict(self.settings))

    def to_json(self) -> list[Any]:
        return [self.copies, dict(self.settings), self.episodes]

    @staticmethod
    def from_json(data: list[Any]) -> Call:
        return Call(int(data[0]), tuple(data[1].items()), bool(data[2]))


@dataclass
class Ticket:
    """One request to the sampler: asked for (``future``, on the trainer's first rank) or answered (``answer``,
    the rows of every trainer rank, on every rank). ``rows``, ``widths``: each trainer rank's rows and prompt
    width, in rank order (the request holds them all, left-padded to the widest)."""

    call: Call | None
    seed: int | None
    rows: list[int]
    widths: list[int]
    future: Future | None = None
    answer: Answer | None = None


class _Stream:
    """The prompt stream as the algorithm draws from it: each draw tells the rollouts which batch is current."""

    def __init__(self, owner: AsyncRollouts):
        self.owner = owner

    @property
    def consumed(self) -> int:  # batches handed to the algorithm (those pulled ahead to sample are not)
        return self.owner.index

    def __iter__(self) -> _Stream:
        return self

    def __next__(self) -> Any:
        return self.owner.draw()


class AsyncRollouts:
    """Answers from a sampler in another process, up to ``max_staleness`` updates ahead of the trainer; stands in
    for the hybrid engine (``engine``) and passes everything but training-time sampling on to it."""

    can_fail = True  # the sampler can die mid-step: the stage keeps each step's starting state to save

    def __init__(self, hybrid: Any, client: SamplerClient | None, max_staleness: int, version: int,
                 state: dict[str, Any], tensors: dict[str, torch.Tensor], timeout_s: float,
                 process: subprocess.Popen | None = None, where: str = "", tokenizer: Any = None,
                 staging: str = "auto"):
        self.hybrid, self.client, self.K, self.version = hybrid, client, max_staleness, version
        self.tokenizer = tokenizer  # episodes sampled ahead: their rows are made from the batch as the rollout does
        self.timeout_s, self.process, self.where = timeout_s, process, where
        self.engine = self
        self.behaviour = "async" if max_staleness > 0 else hybrid.behaviour
        self.last_generate_seconds = 0.0
        self.stream: Any = None
        self.index = 0  # batches handed to the algorithm
        self.ahead: collections.deque[Any] = collections.deque()  # pulled from the stream to sample, not handed out
        self.current: tuple[int, Any] | None = None
        self.recording: list[Call | None] = []  # the sampling calls made on the current batch, as a pattern
        self.pattern: list[Call] | None = None
        self.fewest = 0  # the fewest batches a step has drawn (0: no step yet)
        self.step_batches = 0
        self.in_step = False
        self.tickets: dict[tuple[int, int], Ticket] = {}
        self.issued: set[int] = set()  # batches whose calls were asked for ahead
        self.pushes: list[Future] = []
        self.lags: list[int] = []
        self.dropped = 0
        self.wait_s = self.sampler_s = 0.0
        self.sync: dict[str, float] = {}
        keeping = client is not None
        self.sender = Sender(hybrid.module, keeping, streaming=max_staleness == 0, staging=staging, timeout_s=timeout_s)
        self.sent_full = False
        self.trained = False  # a training step has run in this process (the staging's placement waits for one)
        if client is not None:
            client.sender = self.sender
            self.sender.group_device = client.group.device
        self._restore(state.get("async") or {}, tensors)
        self.updated(version)  # the sampler starts from the trainer's weights (a resumed run's too)

    def __getattr__(self, name: str) -> Any:  # the hybrid engine's: backend, agent, release, close, ...
        if name == "hybrid":
            raise AttributeError(name)
        return getattr(self.hybrid, name)

    def describe(self) -> str:
        return f"sampling on a sampler process ({self.where}), at most {self.K} update(s) behind"

    # ----------------------------------------------------------------------------------------------- the stream
    def watch(self, stream: Any) -> _Stream:
        self.stream, self.index = stream, stream.consumed
        self.issued = {b for b in self.issued if b >= self.index}
        return _Stream(self)

    def draw(self) -> Any:
        self._learn()
        batch = self.ahead.popleft() if self.ahead else next(self.stream)
        b = self.index
        self.index += 1
        self.current = (b, batch)
        self.step_batches += 1
        if self.K > 0 and self.pattern is not None:
            self._look_ahead(b, batch)
        return batch

    def _peek(self, b: int) -> Any:
        while len(self.ahead) <= b - self.index:
            self.ahead.append(next(self.stream))
        return self.ahead[b - self.index]

    def _learn(self) -> None:
        """The current batch's calls become the pattern (none when a call's prompts were not its batch's)."""
        if self.recording:
            ok = all(c is not None for c in self.recording)
            self.pattern = [c for c in self.recording if c is not None] if ok else None
        self.recording = []

    def _look_ahead(self, b: int, batch: Any) -> None:
        assert self.pattern is not None
        for x in range(b, b + self.K * max(self.fewest, 1) + 1):
            if x in self.issued:
                continue
            self.issued.add(x)
            rows = batch if x == b else self._peek(x)
            for j, call in enumerate(self.pattern):  # the call as the algorithm will make it
                asked = repeat_prompts(rows, call.copies)
                data = episode_rows(self.tokenizer, asked) if call.episodes else None
                self.tickets[(x, j)] = self._submit(call, asked["prompt"], asked["prompt_att_mask"], self._seed(),
                                                    None, data=data)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One training step: its sampling calls come from the sampler."""
        self.in_step, self.step_batches = True, 0
        try:
            yield
        finally:
            self.in_step = False
        self._learn()
        if self.step_batches:
            self.fewest = min(self.fewest or self.step_batches, self.step_batches)
        for key in [k for k in self.tickets if k[0] < self.index]:  # asked for, never called for: not trained
            self._drop(self.tickets.pop(key))
        self.issued = {b for b in self.issued if b >= self.index}

    # --------------------------------------------------------------------------------------------- sampling
    @torch.no_grad()
    def sample(self, prompt: torch.Tensor, prompt_mask: torch.Tensor, config: GenerationConfig,
               generator_seed: int | None = None, *, episodes: Any = None, on_token: Any = None) -> Generated:
        """A training step's call: its answers from the sampler (sampled ahead, or asked for now). Any other call
        (an evaluation's, seeded) samples on the trainer."""
        if not self.in_step or generator_seed is not None or self.current is None:
            return self.hybrid.sample(prompt, prompt_mask, config, generator_seed, episodes=episodes,
                                      on_token=on_token)
        if on_token is not None:
            raise UserError("asynchronous rollouts do not stream tokens")
        t0 = time.time()
        b, batch = self.current
        j = len(self.recording)  # the call's place among its batch's calls
        call = self._call_of(prompt, prompt_mask, batch, config, episodes is not None)
        # each decision that chooses a collective path is taken for all ranks at once: one rank seeing otherwise
        # (its batch off the pattern, its rows not the answers') would leave the others waiting
        if E.any_rank(call is None):
            call = None
        self.recording.append(call)
        ticket = self.tickets.pop((b, j), None)
        if ticket is not None and E.any_rank(ticket.call != call):
            self._drop(ticket)
            ticket = None
        while True:
            if ticket is None:  # asked for now: K = 0 carries the trainer's RNG state, as if it sampled itself
                exact = self.K == 0 and E.world_size() == 1
                ticket = self._submit(call, prompt, prompt_mask, None if exact else self._seed(),
                                      torch.get_rng_state() if exact else None, config,
                                      None if episodes is None else list(episodes.rows))
            answer = self._collect(ticket)
            fits = answer.sequences.shape[1] >= prompt.shape[1] and \
                torch.equal(answer.sequences[:, :prompt.shape[1]], prompt.cpu().long())
            if not E.any_rank(not fits) and self.version - answer.version <= self.K:
                break
            self._drop(ticket)  # too old (or not these prompts: a state resumed on other data): sampled again
            ticket = None
        if answer.rng_state is not None:
            torch.set_rng_state(answer.rng_state)
        self.lags.extend([self.version - answer.version] * answer.sequences.shape[0])
        self.sampler_s += answer.seconds
        self.last_generate_seconds = time.time() - t0
        if episodes is not None:
            assert answer.episodes is not None
            episodes.adopt(answer.episodes)
        return self._generated(answer, config, prompt.device)

    def _call_of(self, prompt: torch.Tensor, mask: torch.Tensor, batch: Any, config: GenerationConfig,
                 episodes: bool) -> Call | None:
        """The call as a pattern entry: its prompts are each of the batch's ``copies`` times in a row (else None)."""
        rows = batch["prompt"]
        if prompt.shape[0] % rows.shape[0] or prompt.shape[1] != rows.shape[1]:
            return None
        copies = prompt.shape[0] // rows.shape[0]
        asked = repeat_prompts(batch, copies)
        same = torch.equal(prompt.cpu(), asked["prompt"].cpu()) and \
            torch.equal(mask.cpu().long(), asked["prompt_att_mask"].cpu().long())
        return Call.of(config, copies, episodes) if same else None

    def _generated(self, answer: Answer, config: GenerationConfig, device: torch.device) -> Generated:
        seqs, logps = answer.sequences.to(device), answer.logprobs.to(device)
        masks = {"policy_mask": None if answer.policy_mask is None else answer.policy_mask.to(device),
                 "real_mask": None if answer.real_mask is None else answer.real_mask.to(device)}
        if self.K > 0 or answer.engine:  # the behaviour policy's, for the correction: the trainer takes its own
            return Generated(seqs, None, engine_logprobs=logps, **masks)
        fp32 = next(self.hybrid.module.parameters()).dtype == torch.float32  # as the hybrid engine keeps them
        return Generated(seqs, logps if config.logprobs and fp32 else None, **masks)

    def _seed(self) -> int:
        return int(torch.randint(0, 2**62, (1,)).item())

    def _submit(self, call: Call | None, ids: torch.Tensor, mask: torch.Tensor,
                seed: int | None, rng_state: torch.Tensor | None, config: GenerationConfig | None = None,
                data: list[dict[str, Any]] | None = None) -> Ticket:
        """Ask for one call's answers (``data``: each prompt's row, for episodes); every trainer rank calls it (the
        first sends all ranks' prompts)."""
        ids, mask = ids.detach().cpu().long(), mask.detach().cpu().long()
        parts = E.gather_objects((ids, mask, data)) if E.world_size() > 1 else [(ids, mask, data)]
        rows, widths = [p[0].shape[0] for p in parts], [p[0].shape[1] for p in parts]
        ticket = Ticket(call, seed, rows, widths)
        if self.client is not None:
            W = max(widths)
            pad = self.hybrid.pad_token_id
            all_ids = torch.cat([torch.nn.functional.pad(i, (W - i.shape[1], 0), value=pad) for i, _, _ in parts])
            all_mask = torch.cat([torch.nn.functional.pad(m, (W - m.shape[1], 0), value=0) for _, m, _ in parts])
            all_data = None if data is None else [r for _, _, d in parts for r in d]
            settings = config if config is not None else call.config()  # type: ignore[union-attr]
            ticket.future = self.client.sample(Prompts(all_ids, all_mask, self.hybrid.eos_token_id, pad),
                                               settings, seed, rng_state, all_data)
        return ticket

    def _wait(self, future: Future) -> Answer:
        """The future's answer; the link's own timeout fails a silent sampler, and this one a courier that stopped
        making progress (no exchange finished for longer than the timeout, with requests queued ahead)."""
        assert self.client is not None
        while True:
            try:
                return future.result(timeout=5.0)
            except FutureTimeout:
                idle = time.monotonic() - self.client.progress
                if idle > self.timeout_s + 30:
                    raise SamplerLost(f"the sampler stopped answering: no exchange finished in {idle:.0f} s "
                                      "(--sampler-timeout)") from None

    def _collect(self, ticket: Ticket, count: bool = True) -> Answer:
        """This rank's rows of the ticket's answers (every rank calls it; the first reads the future)."""
        if ticket.answer is None:
            t0 = time.time()
            if E.world_size() == 1:
                assert ticket.future is not None
                ticket.answer = self._wait(ticket.future)
            else:
                payload: Any = None
                if self.client is not None:
                    try:
                        payload = self._wait(ticket.future)  # type: ignore[arg-type]
                    except BaseException as e:  # noqa: BLE001 - every rank raises it, not the first alone
                        payload = failure(e)
                payload = E.broadcast_object(payload)
                if isinstance(payload, tuple):
                    raise reraise(payload)
                ticket.answer = payload
            if count:
                self.wait_s += time.time() - t0
        a, r = ticket.answer, E.rank() if E.world_size() > 1 else 0
        if len(ticket.rows) == 1:
            return a
        start, W = sum(ticket.rows[:r]), max(ticket.widths)
        rows = slice(start, start + ticket.rows[r])
        record = None
        if a.episodes is not None:  # this rank's rows of the lists, and of the counts all of them (ranks sum them)
            record = {"finished": a.episodes["finished"][rows],
                      "info": {k: v[rows] for k, v in a.episodes["info"].items()}, "counts": a.episodes["counts"]}
            if r:
                record["counts"] = {**record["counts"], **{k: 0 for k in record["counts"] if k != "kinds"},
                                    "kinds": {}}
        return dataclasses.replace(a, sequences=a.sequences[rows, W - ticket.widths[r]:], logprobs=a.logprobs[rows],
                                   policy_mask=None if a.policy_mask is None else a.policy_mask[rows],
                                   real_mask=None if a.real_mask is None else a.real_mask[rows], episodes=record,
                                   rng_state=None)

    def _drop(self, ticket: Ticket) -> None:
        if ticket.future is not None:
            ticket.future.cancel()  # not yet sent: never sampled
        self.dropped += ticket.rows[E.rank() if E.world_size() > 1 else 0]

    # ---------------------------------------------------------------------------------------------- weights
    def updated(self, version: int) -> None:
        """The trainer's weights after update ``version``: to the sampler over the weight plane. Every rank walks
        them (ZeRO-3 gathers are collective, its prefetches settled first); the first stages each bucket, checksummed
        on the device, while its courier sends what is staged (``weight_plane.Sender``): with ``K = 0`` as it is
        packed, with ``K > 0`` once the sampler has answered the requests sent before it, training meanwhile. A
        model with LoRA sends its base once, then the adapters alone."""
        self.version = version
        module = self.hybrid.module
        E.settle_partitions(self.hybrid.actor)
        kind = "adapter" if self.sent_full and self.sender.layout("full").lora is not None else "full"
        dtype = next((str(p.dtype) for p in module.parameters() if p.is_floating_point()), "torch.float32")
        update = Update(version, self.sender.layout(kind), dtype)
        if self.client is not None:  # first in the courier's queue, so a K = 0 update streams as it is packed
            self.pushes.append(self.client.push(update))
        self.sender.pack(update, trained=self.trained)
        self.sent_full = self.trained = True  # (every call after the first follows a step)

    def take_metrics(self) -> dict[str, float]:
        """``async/*`` for the step just run, and ``sync/*`` of the last weight update the sampler has checked;
        a refused update stops the run here (``WeightLinkError``), if no answer read has stopped it first (a lost
        sampler stops it at the next read, inside a step)."""
        refused: Any = None
        for f in [f for f in self.pushes if f.done()]:
            self.pushes.remove(f)
            if isinstance(f.exception(), SamplerLost):
                continue  # the next answer read stops the run, inside a step, whose start is kept to save
            if f.exception() is not None:
                refused = failure(f.exception())  # type: ignore[arg-type]
                break
            self.sync = f.result()
        if E.world_size() > 1:  # what the sampler said of an update, on every rank
            refused = E.broadcast_object(refused)
        if refused is not None:
            raise reraise(refused)
        lags = self.lags or [0]
        dropped = float(E.all_reduce_sum(torch.tensor(float(self.dropped))).item()) if E.world_size() > 1 \
            else float(self.dropped)
        out = {"async/lag_mean": sum(lags) / len(lags), "async/lag_max": float(max(lags)), "async/dropped": dropped,
               "async/wait_s": self.wait_s, "async/sampler_s": self.sampler_s, **self.sync}
        self.lags, self.dropped, self.wait_s, self.sampler_s, self.sync = [], 0, 0.0, 0.0, {}
        return out

    # ------------------------------------------------------------------------------------------------ state
    def state(self, wait: bool = True) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The answers sampled ahead, for a saved state. ``wait``: those still being sampled are waited for, so
        the state holds them all (a periodic save); else only those already here (the copy kept at each step's
        start, saved if the sampler is lost mid-step: a resumed run asks again for the rest)."""
        entries, tensors = [], {}
        waiting = [t for _, t in sorted(self.tickets.items()) if t.answer is None]
        ready = [wait or (t.future is not None and t.future.done() and not t.future.cancelled()
                          and t.future.exception() is None) for t in waiting]
        if E.world_size() > 1:  # the first rank knows what has arrived; every rank collects the same tickets
            ready = E.broadcast_object(ready)
        for t, ok in zip(waiting, ready, strict=True):
            if ok:
                with contextlib.suppress(SamplerLost):  # lost with the sampler: a resumed run asks again
                    self._collect(t, count=False)
        for (b, j), t in sorted(self.tickets.items()):
            if t.answer is None:
                continue
            a = t.answer
            assert a is not None
            n = len(entries)
            entries.append({"batch": b, "index": j, "call": None if t.call is None else t.call.to_json(),
                            "seed": t.seed, "rows": t.rows, "widths": t.widths, "version": a.version,
                            "engine": a.engine, "seconds": a.seconds, "episodes": a.episodes})
            tensors[f"async.{n}.sequences"] = a.sequences
            tensors[f"async.{n}.logprobs"] = a.logprobs
            if a.policy_mask is not None and a.real_mask is not None:
                tensors[f"async.{n}.masks"] = torch.stack([a.policy_mask, a.real_mask])
        fields = {"pattern": None if self.pattern is None else [c.to_json() for c in self.pattern],
                  "recording": [None if c is None else c.to_json() for c in self.recording],
                  "fewest": self.fewest, "answers": entries}
        return {"async": fields}, tensors

    def _restore(self, saved: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        if not saved:
            return
        self.pattern = None if saved["pattern"] is None else [Call.from_json(c) for c in saved["pattern"]]
        self.recording = [None if c is None else Call.from_json(c) for c in saved["recording"]]
        self.fewest = int(saved["fewest"])
        world = E.world_size()
        for n, e in enumerate(saved["answers"]):
            if len(e["rows"]) != world:  # saved by another number of ranks: asked for again
                continue
            masks = tensors.get(f"async.{n}.masks")
            answer = Answer(tensors[f"async.{n}.sequences"], tensors[f"async.{n}.logprobs"], bool(e["engine"]),
                            int(e["version"]), float(e["seconds"]), None, None if masks is None else masks[0],
                            None if masks is None else masks[1], e.get("episodes"))
            call = None if e["call"] is None else Call.from_json(e["call"])
            self.tickets[(e["batch"], e["index"])] = Ticket(call, e["seed"], e["rows"], e["widths"], None, answer)
            self.issued.add(e["batch"])

    def close(self) -> None:
        """Stop the sampler (one this run started is waited for, then killed if it lingers)."""
        for t in self.tickets.values():
            if t.future is not None:
                t.future.cancel()
        if self.client is not None:
            self.client.stop()
        if self.process is not None:
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()


def failure(e: BaseException) -> tuple[str, str]:
    """An exception as (kind, message), to raise the same on every rank (``reraise``)."""
    kind = "lost" if isinstance(e, SamplerLost) else "refused" if isinstance(e, WeightLinkError) else \
        "user" if isinstance(e, UserError) else "error"
    return kind, str(e) if kind != "error" else f"{type(e).__name__}: {e}"


def reraise(failed: tuple[str, str]) -> BaseException:
    kind, message = failed
    return {"lost": SamplerLost, "refused": WeightLinkError, "user": UserError}.get(kind, RuntimeError)(message)


# ---------------------------------------------------------------------------------------------------- set-up
def make_rollouts(cfg: Any, hybrid: Any, tokenizer: Any, step: int, state: dict[str, Any],
                  tensors: dict[str, torch.Tensor], log: Any) -> Lockstep | AsyncRollouts:
    """Lockstep sampling, or asynchronous rollouts from a sampler this run starts (``--async-rollouts``) or one
    started apart (``--sampler``), connected to the trainer's first rank (``connect_sampler``), from the trainer's
    weights of ``step``. A sampler that cannot be reached or refuses the run stops every rank in one line before
    anything trains (exit 2: no state to keep yet)."""
    a = cfg.rollouts
    if not a.enabled:
        return Lockstep(hybrid)
    from dschat.generation.channel import load_secret, new_secret
    from dschat.rlhf.config import sampler_devices
    from dschat.utils import address, free_port

    client, process = None, None
    if a.sampler:
        host, port = address(a.sampler)
        where = f"at {a.sampler}"
    else:
        device, cores = sampler_devices(a.sampler_devices)
        host, port = "127.0.0.1", free_port()
        where = f"on {a.sampler_devices}"
    failed: Any = None
    if E.is_main():
        try:
            secret = load_secret(a.sampler_token_file, "--sampler-token-file") if a.sampler else new_secret()
            if not a.sampler:
                dtype = DTYPE_FLAGS.get(next(hybrid.module.parameters()).dtype, cfg.model.dtype)  # the trainer's own
                cmd, env = sampler_launch(cfg, port, device, cores, dtype, secret)
                process = start_sampler(cmd, env, cores)
                log(f"started a sampler on {a.sampler_devices} (pid {process.pid}), at {host}:{port}")
            client = connect_sampler(cfg, hybrid, host, port, secret, process)
        except BaseException as e:
            if process is not None:
                process.kill()
            if E.world_size() == 1:
                raise
            failed = failure(e)
    if E.world_size() > 1:  # every rank stops, not the first alone
        failed = E.broadcast_object(failed)
    if failed is not None:
        raise reraise(failed)
    return AsyncRollouts(hybrid, client, a.max_staleness, step, state, tensors, a.sampler_timeout, process, where,
                         tokenizer, a.weight_staging)


def run_settings(cfg: Any, hybrid: Any) -> dict[str, Any]:
    """What a sampler learns of the run in the trainer's hello: the trainer's dtype, the longest sequence, K (vLLM
    keeps ``K + 1`` adapters), the adapters' shape, the sampling settings (which log-probs vLLM must return), and
    the tools and environments its episodes run."""
    from dschat.generation.weight_plane import lora_spec

    module = hybrid.module
    return {"dtype": str(next(module.parameters()).dtype), "max_staleness": cfg.rollouts.max_staleness,
            "max_model_len": cfg.data.max_prompt_seq_len + cfg.rl.max_answer_seq_len, "lora": lora_spec(module),
            "sampling": {"temperature": cfg.rl.temperature, "top_p": cfg.rl.top_p, "top_k": cfg.rl.top_k},
            "agent": asdict(cfg.agent) if hybrid.agent is not None else None}


def connect_sampler(cfg: Any, hybrid: Any, host: str, port: int, secret: str,
                    process: subprocess.Popen | None = None) -> SamplerClient:
    """The first rank's side of the run's sampler (``sampler.open_sampler`` with the run's settings), its
    weight sender attached by ``AsyncRollouts``."""
    return open_sampler(host, port, secret, run_settings(cfg, hybrid), cfg.rollouts.sampler_timeout, process)


DTYPE_FLAGS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# what a launcher tells its ranks: a sampler is not one of them
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "CROSS_RANK", "CROSS_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


def sampler_launch(cfg: Any, port: int, device: str, cores: list[int], dtype: str,
                   secret: str) -> tuple[list[str], dict[str, str]]:
    """The command and environment of the ``dschat sampler`` this run starts: this run's actor in ``dtype``,
    listening on the loopback at ``port``, with the run's secret in its environment (never on its command line,
    which any user can read). ``cuda:N`` runs it with ``CUDA_VISIBLE_DEVICES`` set to that GPU alone (as this
    process numbers it), so the sampler, its vLLM engine and its weight transfers all use their ``cuda:0``, that
    GPU; no launcher variable reaches it. Every ``--vllm-*`` engine flag the run set reaches a vLLM sampler; on a
    GPU it shares with a trainer rank (``--sampler-share-gpu``) it takes 0.3 of its memory and sleeps between
    samples, as a colocated engine does, unless told otherwise."""
    from dschat.config import VLLM_ENGINE_FLAGS
    from dschat.generation.backends import resolve_backend
    from dschat.rlhf.config import vllm_inert

    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env["DSCHAT_SAMPLER_TOKEN"] = secret
    env[PARENT_ENV] = str(os.getpid())  # the sampler ends with this process (``sampler.follow_parent``)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    where = device
    if device.startswith("cuda:"):
        index = int(device.partition(":")[2])
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        env["CUDA_VISIBLE_DEVICES"] = visible[index] if index < len(visible) else str(index)
        where = "cuda:0"
    cmd = [sys.executable, "-m", "dschat.cli", "sampler", "--model", cfg.actor.model, "--listen",
           f"127.0.0.1:{port}", "--device", where, "--generation-backend", cfg.rl.generation_backend,
           "--dtype", dtype, "--timeout", str(cfg.rollouts.sampler_timeout)]
    if cores:
        cmd += ["--threads", str(len(cores)), "--cpus", ",".join(map(str, cores))]
    else:
        cmd += ["--threads", str(torch.get_num_threads())]
    if cfg.model.trust_remote_code:
        cmd.append("--trust-remote-code")
    vllm = cfg.vllm
    if resolve_backend(cfg.rl.generation_backend) == "vllm" or cfg.rl.generation_backend == "vllm":
        values = {name: getattr(vllm, name) for name in VLLM_ENGINE_FLAGS}
        if cfg.rollouts.sampler_share_gpu:
            values["vllm_gpu_memory_utilization"] = values["vllm_gpu_memory_utilization"] or 0.3
            values["vllm_enable_sleep"] = True if values["vllm_enable_sleep"] is None else values["vllm_enable_sleep"]
        inert = vllm_inert("vllm", with_training=True) if where == "cpu" else {}
        defaults = {"vllm_kv_cache_memory": 0, "vllm_tensor_parallel_size": 1}
        for name, value in values.items():
            if value is None or value == defaults.get(name) or name in inert:
                continue
            flag = "--" + name.replace("_", "-")
            cmd += [flag] if value is True else [f"--no-{flag[2:]}"] if value is False else [flag, str(value)]
    return cmd, env


def start_sampler(cmd: list[str], env: dict[str, str], cores: list[int]) -> subprocess.Popen:
    """Start the sampler (``sampler_launch``) on ``cores`` (which this process then leaves); its messages go to this
    run's stderr. It ends with this process: killed at exit, and (Linux) signalled by the kernel if this process
    dies without an exit (``sampler.follow_parent``; it would also exit by itself at its first read, its trainer
    gone)."""
    if cores:
        mine = sorted(set(os.sched_getaffinity(0)) - set(cores))
        if mine:  # the trainer keeps the other cores: every thread of it (torch's pool is already running)
            for tid in os.listdir("/proc/self/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(tid), mine)
            torch.set_num_threads(len(mine))
    process = subprocess.Popen(cmd, env=env)
    atexit.register(lambda: process.poll() is None and process.kill())
    return process
