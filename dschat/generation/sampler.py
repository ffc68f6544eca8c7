"""A sampler in a process of its own: it holds a copy of the policy on its own devices and answers batches of
prompts, and the trainer keeps its copy current over a link (``dschat.engine.Link``; weights as
``dschat.generation.weight_link`` sends them).

Who sends what, in the order both sides follow (the link's messages are collective, so the order is the
protocol):

```
trainer (SamplerClient, link rank 0)             sampler (SamplerServer, link rank 1)
  {"op": "weights"}  + the weight update   ->      receive_weights: checksums, probe
                                           <-      the verdict
  {"op": "sample", settings, seed, shape}
     + prompt ids, prompt mask (+ an RNG state)
                                           ->      generate(...) through the one entry, from its copy
                                           <-      {"version", "shape", ...} + sequences + the log-probs of its
                                                   samples (+ the RNG state it ended with)
  {"op": "ping"}                           ->      (nothing: sent while the trainer is idle, every 10 s at most,
                                                   so a long evaluation is not taken for a death)
  {"op": "stop"}                           ->      returns
```

The trainer's side is a courier: a thread of its own that runs these exchanges one after the other, in the order
they were submitted, while the trainer trains; each submission returns a future. One exchange is on the link at a
time (a message completes only when the other side takes it), so a weight update submitted while the sampler
samples travels once it has answered, and the sampler samples each request with the last update submitted before
it: which version samples what depends on the order of submissions alone, never on timing. The answers carry that
version and the sampler's own log-probs of its tokens (the behaviour policy's). A request either carries a seed
(its own random stream) or the trainer's RNG state (the sampler draws from it and sends back where it ended, so
the trainer's stream goes on as if it had sampled itself). A peer that dies or stops answering fails the other
side's next message within the link's timeout, in one line (``SamplerLost``).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, replace
from types import SimpleNamespace
from typing import Any

import torch

from dschat.devices import forked_rng
from dschat.errors import ExitCode, UserError
from dschat.generation.backends import generate
from dschat.generation.decode import Backend, GenerationConfig, Prompts
from dschat.generation.weight_link import Snapshot, receive_weights, send_snapshot

SAMPLER_RANK = 1


class SamplerLost(UserError):
    """The sampler died or stopped answering. Stage 3 saves the state of its last completed step first; exit code
    4, as a run stopped with a state."""

    exit_code = ExitCode.STOPPED


def _lost(what: str, error: BaseException, kind: type[UserError] = SamplerLost) -> UserError:
    from dschat.errors import first_line

    return kind(f"{what}: {first_line(error)}")


@dataclass
class Answer:
    """A sampler's answers to one request."""

    sequences: torch.Tensor  # (B, P + A) on the CPU
    logprobs: torch.Tensor  # (B, A) float32: the sampler's log-probs of its tokens (the behaviour policy's)
    engine: bool  # a serving engine's log-probs (vLLM), not exactly the trainer's numerics
    version: int  # the weight update that sampled them
    seconds: float  # the sampler's time on them
    rng_state: torch.Tensor | None = None  # where the trainer's RNG stream ended, for a request that sent it
    # episodes (tools, environments): (B, A) bool, the policy's own tokens and the tokens fed at all; and what the
    # episodes did (``episode_record``: finished, info, counts), JSON
    policy_mask: torch.Tensor | None = None
    real_mask: torch.Tensor | None = None
    episodes: dict[str, Any] | None = None


class SamplerClient:
    """The trainer's side of a sampler (its link's rank 0): ``push`` and ``sample`` submit an exchange and return
    its future; a courier thread runs them in order. After a failure every later future fails the same way."""

    def __init__(self, link: Any):
        self.link = link
        self._jobs: queue.Queue[tuple[Any, Future] | None] = queue.Queue()
        self._failed: BaseException | None = None
        self.progress = time.monotonic()  # when the courier last finished an exchange (or was idle)
        self._courier = threading.Thread(target=self._run, name="dschat-sampler-courier", daemon=True)
        self._courier.start()

    def push(self, snapshot: Snapshot, version: int) -> Future:
        """Send a weight snapshot as ``version``; the future's result is its ``sync/*`` figures, or
        ``WeightLinkError`` when the sampler refused it."""
        return self._submit(lambda: self._push(snapshot, version))

    def agent(self, args: dict[str, Any]) -> Future:
        """Give the sampler the run's tools and environments (``AgentArgs`` as JSON: its files are loaded on the
        sampler's host); the future fails with the sampler's one line if it cannot build them."""
        return self._submit(lambda: self._agent(args))

    def sample(self, prompts: Prompts, settings: GenerationConfig, seed: int | None = None,
               rng_state: torch.Tensor | None = None, rows: list[dict[str, Any]] | None = None) -> Future:
        """Ask for answers to ``prompts`` (left-padded), sampled with ``settings`` from a stream seeded with
        ``seed``, or from the CPU RNG state ``rng_state``; with ``rows`` (each prompt's data row) as episodes of
        the tools and environments given by ``agent``. The future's result is an ``Answer``."""
        ids = prompts.ids.detach().to("cpu", torch.long, copy=True)
        mask = prompts.mask.detach().to("cpu", torch.long, copy=True)
        state = None if rng_state is None else rng_state.detach().clone()
        return self._submit(lambda: self._sample(ids, mask, prompts.eos_token_id, prompts.pad_token_id, settings,
                                                 seed, state, rows))

    def stop(self, wait: float = 30.0) -> None:
        """Tell the sampler to exit once it has answered what it was asked, and end the courier."""
        self._jobs.put(None)
        self._courier.join(wait)

    def _submit(self, job: Any) -> Future:
        future: Future = Future()
        self._jobs.put((job, future))
        return future

    def _run(self) -> None:
        stream: Any = contextlib.nullcontext()
        if self.link.bulk_device.type == "cuda":  # the transfers on a stream of their own: training never waits
            torch.cuda.set_device(self.link.bulk_device)
            stream = torch.cuda.stream(torch.cuda.Stream())
        with stream:
            self._serve_jobs()

    def _serve_jobs(self) -> None:
        while True:
            try:  # idle (the trainer evaluates, saves, ...): the sampler hears from it at least every 10 s
                item = self._jobs.get(timeout=min(self.link.timeout_s / 3, 10.0))
            except queue.Empty:
                self.progress = time.monotonic()
                if self._failed is None:
                    try:
                        self.link.broadcast_json({"op": "ping"})
                    except RuntimeError as e:
                        self._failed = _lost("the sampler died or stopped answering", e)
                continue
            if item is None:
                if self._failed is None:
                    try:
                        self.link.broadcast_json({"op": "stop"})
                    except RuntimeError:
                        pass  # already gone
                return
            job, future = item
            if not future.set_running_or_notify_cancel():  # dropped before it was sent
                continue
            if self._failed is not None:
                future.set_exception(self._failed)
                continue
            try:
                future.set_result(job())
            except BaseException as e:  # noqa: BLE001 - the trainer reads it from the future
                self._failed = e
                future.set_exception(e)
            self.progress = time.monotonic()
            item = job = future = None  # a sent snapshot is not kept alive while the courier idles

    def _push(self, snapshot: Snapshot, version: int) -> dict[str, float]:
        try:
            self.link.broadcast_json({"op": "weights"})
            return send_snapshot(self.link, snapshot, version)
        except RuntimeError as e:
            raise _lost(f"the sampler is gone (sending weight update {version})", e) from None

    def _agent(self, args: dict[str, Any]) -> None:
        try:
            self.link.broadcast_json({"op": "agent", "args": args})
            verdict = self.link.broadcast_json(None, src=SAMPLER_RANK)
        except RuntimeError as e:
            raise _lost("the sampler is gone (sending the tools and environments)", e) from None
        if not verdict["ok"]:
            raise UserError(f"the sampler could not load the tools and environments: {verdict['message']}")

    def _sample(self, ids: torch.Tensor, mask: torch.Tensor, eos: Any, pad: int, settings: GenerationConfig,
                seed: int | None, state: torch.Tensor | None, rows: list[dict[str, Any]] | None) -> Answer:
        dev = self.link.device
        try:
            self.link.broadcast_json({"op": "sample", "settings": asdict(settings), "seed": seed,
                                      "rng": 0 if state is None else state.numel(), "shape": list(ids.shape),
                                      "eos": eos, "pad": pad, "rows": rows})
            self.link.broadcast(ids.to(dev))
            self.link.broadcast(mask.to(dev))
            if state is not None:
                self.link.broadcast(state.to(dev))
        except RuntimeError as e:
            raise _lost("the sampler is gone (sending a request)", e) from None
        try:
            head = self.link.broadcast_json(None, src=SAMPLER_RANK)
            B, W = head["shape"]
            seqs = self.link.broadcast(torch.empty(B, W, dtype=torch.long, device=dev), SAMPLER_RANK)
            logps = self.link.broadcast(torch.empty(B, W - head["prompt"], dtype=torch.float32, device=dev),
                                        SAMPLER_RANK)
            end = policy = real = None
            if head["rng"]:
                end = self.link.broadcast(torch.empty(head["rng"], dtype=torch.uint8, device=dev), SAMPLER_RANK)
            if head.get("episodes") is not None:
                masks = self.link.broadcast(torch.empty(2, B, W - head["prompt"], dtype=torch.uint8, device=dev),
                                            SAMPLER_RANK).cpu().bool()
                policy, real = masks[0], masks[1]
        except RuntimeError as e:
            raise _lost("the sampler died or stopped answering", e) from None
        return Answer(seqs.cpu(), logps.cpu(), bool(head["engine"]), int(head["version"]), float(head["seconds"]),
                      None if end is None else end.cpu(), policy, real, head.get("episodes"))


class SamplerServer:
    """The sampler's side (its link's rank 1): ``serve`` answers the trainer until it says stop or is gone."""

    def __init__(self, link: Any, module: torch.nn.Module, backend: Backend, version: int = 0,
                 tokenizer: Any = None):
        self.link, self.module, self.backend, self.version = link, module.eval(), backend, version
        self.tokenizer = tokenizer  # for episodes: the turns the tools and environments add are tokenized here
        self.agent: Any = None

    def serve(self) -> None:
        """Answer weight updates and sample requests in the order they come. Returns on ``stop``; raises
        ``UserError`` when the trainer is gone, ``WeightLinkError`` on a bad update."""
        while True:
            try:
                msg = self.link.broadcast_json(None)
            except RuntimeError as e:
                raise _lost("the trainer is gone", e, UserError) from None
            if msg["op"] == "stop":
                return
            if msg["op"] == "ping":
                continue
            if msg["op"] == "weights":
                self.version = receive_weights(self.link, self.module)
            elif msg["op"] == "agent":
                self._build_agent(msg["args"])
            elif msg["op"] == "sample":
                self._answer(msg)

    def close(self) -> None:
        """Stop the tools' and environments' workers."""
        if self.agent is not None:
            self.agent.close()

    def _build_agent(self, args: dict[str, Any]) -> None:
        from dschat.agents.agent import build_agent
        from dschat.config import AgentArgs

        problem = ""
        try:
            if self.tokenizer is None:
                raise UserError("this sampler has no tokenizer to run episodes with")
            if self.agent is not None:
                self.agent.close()
            self.agent = build_agent(AgentArgs(**args))
            if self.agent is not None:
                self.agent.warm()
        except UserError as e:
            problem = str(e)
        self.link.broadcast_json({"ok": not problem, "message": problem}, src=SAMPLER_RANK)
        if problem:
            raise UserError(f"the tools and environments: {problem}")

    @torch.no_grad()
    def _answer(self, msg: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        B, P = msg["shape"]
        ids = self.link.broadcast(torch.empty(B, P, dtype=torch.long, device=self.link.device))
        mask = self.link.broadcast(torch.empty(B, P, dtype=torch.long, device=self.link.device))
        state = None
        if msg.get("rng"):
            state = self.link.broadcast(torch.empty(msg["rng"], dtype=torch.uint8, device=self.link.device)).cpu()
        device = next(self.module.parameters()).device
        # the behaviour policy's log-probs always: they are what the trainer's correction weighs against
        settings = replace(GenerationConfig(**msg["settings"]), logprobs=True)
        episodes = None
        if msg.get("rows") is not None:
            from dschat.agents.episode import Episodes

            eos = msg["eos"] if isinstance(msg["eos"], list) else [msg["eos"]]
            episodes = Episodes(self.agent, self.tokenizer, msg["rows"], eos, msg["pad"])
        with forked_rng(msg.get("seed")):  # a backend with its own copy resyncs when the version moves
            if state is not None:  # the trainer's own stream: drawn from here, and where it ends goes back
                torch.set_rng_state(state)
                if device.type == "cuda":
                    torch.cuda.manual_seed(int(torch.randint(2**62, (1,)).item()))
            out = generate(self.backend, self.module, Prompts(ids.to(device), mask.to(device), msg["eos"], msg["pad"]),
                           settings, episodes=episodes, engine=SimpleNamespace(global_steps=self.version))
            end = torch.get_rng_state() if state is not None else None
        engine = out.logprobs is None and out.engine_logprobs is not None
        logps = out.engine_logprobs if engine else out.logprobs
        seqs = out.sequences.to(self.link.device, torch.long)
        answer = torch.zeros(B, seqs.shape[1] - P, dtype=torch.float32, device=self.link.device)
        if logps is not None:
            answer.copy_(logps.float().to(self.link.device))
        record = None
        if episodes is not None:
            assert out.policy_mask is not None and out.real_mask is not None
            record = episode_record(episodes, seqs[:, P:].cpu(), out.policy_mask.cpu(), out.real_mask.cpu())
        self.link.broadcast_json({"version": self.version, "shape": list(seqs.shape), "prompt": P, "engine": engine,
                                  "rng": 0 if end is None else end.numel(), "episodes": record,
                                  "seconds": time.perf_counter() - t0}, src=SAMPLER_RANK)
        self.link.broadcast(seqs.contiguous(), SAMPLER_RANK)
        self.link.broadcast(answer, SAMPLER_RANK)
        if end is not None:
            self.link.broadcast(end.to(self.link.device), SAMPLER_RANK)
        if record is not None:
            masks = torch.stack([out.policy_mask.bool(), out.real_mask.bool()]).to(self.link.device, torch.uint8)
            self.link.broadcast(masks.contiguous(), SAMPLER_RANK)


def episode_record(episodes: Any, answers: torch.Tensor, policy: torch.Tensor, real: torch.Tensor) -> dict[str, Any]:
    """What a batch of episodes did, as JSON: which ended, their ``EpisodeInfo`` and their ``EpisodeCounts``
    (``Episodes.adopt`` takes it on the trainer's side)."""
    counts = episodes.counts(real, policy)
    return {"finished": episodes.finished(), "info": asdict(episodes.info(answers, real)),
            "counts": {**asdict(counts), "kinds": dict(counts.kinds)}}
