"""A sampler in a process of its own: it holds the policy in its engine on its own devices and answers batches of
prompts; the trainer keeps the engine's weights current over the weight plane (``dschat.generation.weight_plane``)
and talks to it over a control channel (``dschat.generation.channel``: authenticated, bounded, timed).

Who sends what, in the order both sides follow (the control channel is one ordered stream per sampler):

```
trainer (SamplerClient)                            sampler (SamplerServer)
  {"op": "hello", "run": the run's settings}   ->    builds what samples (vLLM: its engine, sized for the run;
                                               <-    the tools and environments), says which GPU each of its
                                                     receiving ranks holds
  {"op": "join", "group": where, who}          ->    both join the weight group (NCCL where every member has a
                                               <-    GPU of its own, else gloo); ok
  {"op": "weights", version, layout}           ->    each bucket into its engine as it arrives (weight group),
    weight group: the buckets, broadcast             then checks them: checksums, the probe
  {"op": "weights_end", checksums, probe}      ->
                                               <-    the verdict
  {"op": "sample", settings, seed, shape}      ->    samples through the one entry (``backends.generate``)
     + prompt ids, prompt mask (+ an RNG state)
                                               <-    {"version", "shape", ...} + sequences + the behaviour
                                                     log-probs of its samples (+ the RNG state it ended with)
  {"op": "ping"}                               ->    (nothing: sent while the trainer is idle, every 10 s at most,
                                                     so a long evaluation is not taken for a death)
  {"op": "stop"}                               ->    returns
```

The trainer's side is a courier: a thread of its own that runs these exchanges one after the other, in the order
they were submitted, while the trainer trains; each submission returns a future. So a weight update submitted
while the sampler samples travels once it has answered, and the sampler samples each request with the last update
submitted before it: which version samples what depends on the order of submissions alone, never on timing. The
answers carry that version and the sampler's own log-probs of its tokens (the behaviour policy's: under the
tempered, unfiltered distribution, as the trainer computes its own). A request either carries a seed (its own
random stream) or the trainer's RNG state (the sampler draws from it and sends back where it ended, so the
trainer's stream goes on as if it had sampled itself). A peer that dies or stops answering fails the other side's
next exchange within the timeout, in one line (``SamplerLost`` on the trainer's side).
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any

import torch

from dschat.devices import forked_rng
from dschat.errors import ExitCode, UserError, first_line
from dschat.generation.backends import generate
from dschat.generation.channel import BadMessage, Channel, ChannelClosed, Fields
from dschat.generation.decode import Backend, GenerationConfig, Prompts
from dschat.generation.weight_plane import Sender, Update, take_update

PING_S = 10.0  # the longest the courier stays silent while idle
PARENT_ENV = "DSCHAT_SAMPLER_PARENT"  # the pid of the trainer that started this sampler


class SamplerLost(UserError):
    """The sampler died or stopped answering. Stage 3 saves the state of its last completed step first; exit code
    4, as a run stopped with a state."""

    exit_code = ExitCode.STOPPED


def _lost(what: str, error: BaseException) -> SamplerLost:
    return SamplerLost(f"{what}: {first_line(error)}")


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


SETTINGS = {"max_new_tokens": (1, 1 << 20), "temperature": (1e-6, 1e6), "top_p": (1e-9, 1.0), "top_k": (0, 1 << 30),
            "repetition_penalty": (1e-6, 1e6)}


def read_settings(f: Fields) -> GenerationConfig:
    """A request's sampling settings, each checked (``BadMessage`` names the one that is wrong)."""
    return GenerationConfig(
        max_new_tokens=f.int("max_new_tokens", *SETTINGS["max_new_tokens"]), do_sample=f.bool("do_sample"),
        temperature=f.number("temperature", *SETTINGS["temperature"]), top_p=f.number("top_p", *SETTINGS["top_p"]),
        top_k=f.int("top_k", *SETTINGS["top_k"]), logprobs=True,
        repetition_penalty=f.number("repetition_penalty", *SETTINGS["repetition_penalty"]))


class SamplerClient:
    """The trainer's side (its first rank): a courier thread that runs exchanges with the sampler in submission
    order; ``push``, ``sample`` and ``stop`` return at once (a future, or nothing)."""

    def __init__(self, channel: Channel, sender: Sender | None = None, group: Any = None):
        self.channel, self.sender, self.group = channel, sender, group
        self.timeout_s = channel.timeout_s
        self.progress = time.monotonic()  # when the courier last finished an exchange (or idled)
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._failed: BaseException | None = None
        self._courier = threading.Thread(target=self._run, name="dschat-sampler-courier", daemon=True)
        self._courier.start()

    def push(self, update: Update) -> Future:
        """Send ``update`` (its buckets as the training thread stages them); the future's result is the update's
        ``sync/*`` metrics once the sampler has checked it, or ``WeightLinkError`` if it refused it."""
        return self._submit(lambda: self._push(update))

    def sample(self, prompts: Prompts, settings: GenerationConfig, seed: int | None = None,
               rng_state: torch.Tensor | None = None, rows: list[dict[str, Any]] | None = None) -> Future:
        """Ask for answers to ``prompts`` (left-padded), sampled with ``settings`` from a stream seeded with
        ``seed``, or from the CPU RNG state ``rng_state``; with ``rows`` (each prompt's data row) as episodes of
        the run's tools and environments. The future's result is an ``Answer``."""
        ids = prompts.ids.detach().to("cpu", torch.long, copy=True)
        mask = prompts.mask.detach().to("cpu", torch.long, copy=True)
        state = None if rng_state is None else rng_state.detach().clone()
        return self._submit(lambda: self._sample(ids, mask, prompts.eos_token_id, prompts.pad_token_id, settings,
                                                 seed, state, rows))

    def stop(self, wait: float = 30.0) -> None:
        """Tell the sampler to exit once it has answered what it was asked, and end the courier."""
        self._jobs.put(None)
        self._courier.join(wait)
        self.channel.close()

    def _submit(self, job: Any) -> Future:
        future: Future = Future()
        self._jobs.put((job, future))
        return future

    def _run(self) -> None:
        stream: Any = contextlib.nullcontext()
        if self.group is not None and self.group.device.type == "cuda":  # transfers on a stream of their own
            torch.cuda.set_device(self.group.device)
            stream = torch.cuda.stream(torch.cuda.Stream())
        with stream:
            self._serve_jobs()

    def _fail(self, error: BaseException) -> None:
        self._failed = error
        if self.sender is not None:
            self.sender.fail(error)  # a packer waiting for a buffer wakes up

    def _serve_jobs(self) -> None:
        while True:
            try:  # idle (the trainer evaluates, saves, ...): the sampler hears from it at least every PING_S
                item = self._jobs.get(timeout=min(self.timeout_s / 3, PING_S))
            except queue.Empty:
                self.progress = time.monotonic()
                if self._failed is None:
                    try:
                        self.channel.send({"op": "ping"})
                    except ChannelClosed as e:
                        self._fail(_lost("the sampler died or stopped answering", e))
                continue
            if item is None:
                if self._failed is None:
                    with contextlib.suppress(ChannelClosed):
                        self.channel.send({"op": "stop"})
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
                self._fail(e)
                future.set_exception(e)
            self.progress = time.monotonic()
            item = job = future = None  # a sent update is not kept alive while the courier idles

    def _push(self, update: Update) -> dict[str, float]:
        assert self.sender is not None
        try:
            return self.sender.send(update, [self.channel], self.group, self.timeout_s)
        except (ChannelClosed, RuntimeError) as e:
            raise _lost(f"the sampler is gone (sending weight update {update.version})", e) from None
        except BadMessage as e:
            raise _lost(f"the sampler answered weight update {update.version} with {e}", e) from None

    def _sample(self, ids: torch.Tensor, mask: torch.Tensor, eos: Any, pad: int, settings: GenerationConfig,
                seed: int | None, state: torch.Tensor | None, rows: list[dict[str, Any]] | None) -> Answer:
        msg = {"op": "sample", "settings": {k: v for k, v in asdict(settings).items() if k != "logprobs"},
               "seed": seed, "rng": state is not None, "shape": list(ids.shape), "eos": eos, "pad": pad,
               "rows": rows}
        try:
            self.channel.send(msg, [ids, mask] + ([state] if state is not None else []))
        except ChannelClosed as e:
            raise _lost("the sampler is gone (sending a request)", e) from None
        try:
            head, tensors = self.channel.recv()
        except ChannelClosed as e:
            raise _lost("the sampler died or stopped answering", e) from None
        try:
            return read_answer(head, tensors, ids, state is not None)
        except BadMessage as e:
            raise _lost("the sampler's answer", e) from None


def read_answer(head: dict[str, Any], tensors: list[torch.Tensor], ids: torch.Tensor, rng: bool) -> Answer:
    """A sampler's answer to a request for ``ids``, checked against it: its rows, its width, its tensors."""
    f = Fields(head, "answer")
    if f.has("error"):
        raise BadMessage(f"the sampler could not sample: {f.str('error')[:500]}")
    B, P = ids.shape
    B2, W = f.ints("shape", 1, 2)
    if B2 != B or W < P or f.int("prompt") != P:
        raise BadMessage(f"answer: {B2} x {W} sequences for a request of {B} prompts {P} wide")
    episodes = head.get("episodes")
    if episodes is not None:
        check_episodes(episodes, B)
    want: list[tuple[torch.dtype, list[int]]] = [(torch.int64, [B, W]), (torch.float32, [B, W - P])]
    if rng:
        want.append((torch.uint8, [f.int("rng", 1, 1 << 20)]))
    if episodes is not None:
        want.append((torch.uint8, [2, B, W - P]))
    f.tensors(tensors, want)
    masks = tensors[-1].bool() if episodes is not None else None
    return Answer(tensors[0], tensors[1], f.bool("engine"), f.int("version", 0), f.number("seconds", 0),
                  tensors[2] if rng else None, None if masks is None else masks[0],
                  None if masks is None else masks[1], episodes)


def open_sampler(host: str, port: int, secret: str, run: dict[str, Any], timeout_s: float,
                 process: Any = None) -> SamplerClient:
    """A trainer's side of a sampler, ready for updates: the control channel (each side proves the secret), the
    run's settings (``run``: the sampler builds its engine, tools and environments for them), then the weight
    group, hosted here at the address this side reached the sampler from: NCCL where the trainer's rank and every
    sampler rank hold GPUs of their own, else gloo. ``process``: the sampler this run started (its exit ends the
    wait at once). One line (``UserError``) when any of it fails."""
    import secrets

    from dschat import engine as E
    from dschat.generation.channel import Refused, connect

    at = f"the sampler at {host}:{port}"
    try:
        channel = connect(host, port, secret, timeout_s, alive=None if process is None else
                          (lambda: process.poll() is None))
    except Refused as e:
        raise UserError(f"{at}: {e}; it is not this run's sampler (check --sampler-token-file or "
                        "$DSCHAT_SAMPLER_TOKEN on both sides)") from None
    except ChannelClosed as e:
        code = "" if process is None or process.poll() is None else \
            f" (exit code {process.returncode}: its error is above)"
        raise UserError(f"{at} {e}{code}; start one with dschat sampler --listen HOST:PORT") from None
    try:
        channel.send({"op": "hello", "run": run})
        reply = Fields(channel.recv()[0], "hello reply")
        if not reply.bool("ok"):
            raise UserError(f"{at} cannot sample for this run: {reply.str('message')[:500]}")
        identities = reply.list("identities")
        if not identities or not all(isinstance(i, str) for i in identities):
            raise BadMessage("hello reply.identities: not a list of its ranks' GPUs")
        ours = E.gpu_identity() if E.device().type == "cuda" else ""
        members = [ours, *identities]
        nccl = all(members) and len(set(members)) == len(members)  # two processes on one GPU: gloo, not NCCL
        here, there = channel.sock.getsockname()[0], channel.sock.getpeername()[0]
        store = E.WeightStore(here, timeout_s)
        prefix = secrets.token_hex(16)
        spec = {"store": [store.host, store.port], "prefix": prefix, "rank": 1, "size": len(members),
                "nccl": nccl, "timeout": timeout_s, "host": there}
        channel.send({"op": "join", "group": spec})
        group = _form(lambda: E.WeightGroup(store.store, prefix, 0, len(members), timeout_s, nccl, here), channel,
                      process)
        group.store = store  # kept alive with the group
        reply = Fields(channel.recv()[0], "join reply")
        if not reply.bool("ok"):
            raise UserError(f"{at} could not join the weight group: {reply.str('message')[:500]}")
    except (ChannelClosed, RuntimeError) as e:
        channel.close()
        raise UserError(f"{at} did not complete its start: {first_line(e)}") from None
    except UserError:
        channel.close()
        raise
    return SamplerClient(channel, None, group)


def _form(make: Callable[[], Any], channel: Channel, process: Any) -> Any:
    """``make()`` (a collective that waits for the sampler to join) run aside, while this thread watches the sampler:
    one that exits, or closes its channel, ends the wait at once instead of at the timeout."""
    import select

    done: dict[str, Any] = {}

    def run() -> None:
        try:
            done["group"] = make()
        except BaseException as e:  # noqa: BLE001 - raised below, on the caller's thread
            done["error"] = e

    worker = threading.Thread(target=run, name="dschat-weight-group", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.2)
        if not worker.is_alive():
            break
        if process is not None and process.poll() is not None:
            raise ChannelClosed(f"exited while joining the weight group (exit code {process.returncode})")
        readable, _, _ = select.select([channel.sock], [], [], 0)
        if readable and not channel.sock.recv(1, socket.MSG_PEEK):
            raise ChannelClosed("closed the connection while joining the weight group")
    if "error" in done:
        raise done["error"]
    return done["group"]


INFO = {"texts": str, "lengths": int, "env_rewards": (float, int, type(None)), "turns": int, "calls": int,
        "errors": int}
COUNTS = ("episodes", "turns", "calls", "errors", "policy_tokens", "context_tokens")


def check_episodes(record: Any, rows: int) -> None:
    """What a sampler says its episodes did (``episode_record``), in the shape the trainer reads: ``finished`` and
    each ``info`` list one entry per row, of its type; the counts integers; else ``BadMessage``."""
    f = Fields(record, "answer.episodes")
    finished = f.list("finished")
    info, counts = f.fields("info"), f.fields("counts")
    ok = len(finished) == rows and all(type(x) is bool for x in finished)
    for key, kind in INFO.items():
        values = info.list(key)
        ok = ok and len(values) == rows and all(isinstance(v, kind) and type(v) is not bool for v in values)
    ok = ok and set(info.msg) == set(INFO) and all(type(counts.msg.get(k)) is int for k in COUNTS)
    kinds = counts.msg.get("kinds")
    ok = ok and isinstance(kinds, dict) and all(isinstance(k, str) and type(v) is int for k, v in kinds.items())
    if not ok or set(counts.msg) != {*COUNTS, "kinds"}:
        raise BadMessage(f"answer.episodes: not what {rows} episodes did")


# ------------------------------------------------------------------------------------------------ the sampler
class SamplerServer:
    """The sampler's side: ``serve`` answers the trainer until it says stop or is gone. ``engine`` is what
    receives the weights (``ModuleReceiver`` over ``module``, or a vLLM backend fed by the plane, which ``make``
    builds once the trainer's hello says how: ``make(run) -> (engine, backend, module)``)."""

    def __init__(self, channel: Channel, make: Callable[[dict[str, Any]], tuple[Any, Backend, torch.nn.Module]],
                 tokenizer: Any = None, log: Callable[[str], None] = print):
        self.channel, self.make, self.tokenizer, self.log = channel, make, tokenizer, log
        self.engine: Any = None
        self.backend: Any = None
        self.module: Any = None
        self.agent: Any = None
        self.version = -1
        self.joined = False

    def serve(self) -> None:
        """Answer the trainer's messages in the order they come. Returns on ``stop``; raises ``UserError`` (one
        line) when the trainer is gone, sends a malformed message, or sends an update that fails its checks."""
        while True:
            try:
                msg, tensors = self.channel.recv()
            except ChannelClosed as e:
                raise UserError(f"the trainer is gone: {first_line(e)}") from None
            if self.dispatch(msg, tensors):
                return

    def dispatch(self, msg: dict[str, Any], tensors: list[torch.Tensor]) -> bool:
        """Act on one message; True when it says stop."""
        op = Fields(msg, "message").str("op", ("hello", "join", "weights", "sample", "ping", "stop"))
        if op == "stop":
            return True
        if op == "ping":
            return False
        if op != "hello" and self.engine is None:
            raise BadMessage(f"{op}: the trainer has not said hello")
        if op in ("weights", "sample") and not self.joined:
            raise BadMessage(f"{op}: the trainer has not formed the weight group")
        try:
            {"hello": self._hello, "join": self._join, "weights": self._weights, "sample": self._sample}[op](
                msg, tensors)
        except ChannelClosed as e:
            raise UserError(f"the trainer is gone: {first_line(e)}") from None
        return False

    def _sample(self, msg: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        """Answer a request; a request this sampler cannot answer (a malformed one, or a backend that gave no
        log-probs) is answered with the reason, so the trainer stops with it, and then this sampler stops."""
        try:
            self._answer(msg, tensors)
        except UserError as e:
            with contextlib.suppress(ChannelClosed):
                self.channel.send({"error": first_line(e, 500)})
            raise

    def close(self) -> None:
        """Stop the tools' and environments' workers and the engine."""
        if self.agent is not None:
            self.agent.close()
        if self.backend is not None:
            self.backend.close()

    def _reply(self, problem: str, **more: Any) -> None:
        self.channel.send({"ok": not problem, "message": problem, **more})

    def _hello(self, msg: dict[str, Any], _: list[torch.Tensor]) -> None:
        run = Fields(msg, "hello").fields("run")
        problem = ""
        try:
            self.engine, self.backend, self.module = self.make(run.msg)
            agent = run.msg.get("agent")
            if agent is not None:
                self._build_agent(agent)
        except BadMessage:
            raise
        except Exception as e:  # noqa: BLE001 - an engine that cannot be built: told to the trainer, one line here
            problem = first_line(e, 500)
        self._reply(problem, identities=self.engine.identities() if self.engine is not None else [],
                    backend=getattr(self.backend, "name", ""))
        if problem:
            raise UserError(f"the trainer's run: {problem}")

    def _build_agent(self, args: Any) -> None:
        from dschat.agents.agent import build_agent
        from dschat.config import AgentArgs

        if self.tokenizer is None:
            raise UserError("this sampler has no tokenizer to run episodes with")
        if not isinstance(args, dict):
            raise BadMessage("hello.run.agent: not a JSON object")
        try:
            spec = AgentArgs(**args)
        except TypeError as e:
            raise BadMessage(f"hello.run.agent: {first_line(e)}") from None
        self.agent = build_agent(spec)
        if self.agent is not None:
            self.agent.warm()

    def _join(self, msg: dict[str, Any], _: list[torch.Tensor]) -> None:
        f = Fields(msg, "join").fields("group")
        host_port = f.list("store")
        ok = len(host_port) == 2 and isinstance(host_port[0], str) and type(host_port[1]) is int
        if not ok:
            raise BadMessage("join.group.store: not [host, port]")
        spec = {"store": host_port, "prefix": f.str("prefix"), "rank": f.int("rank", 1), "size": f.int("size", 2),
                "nccl": f.bool("nccl"), "timeout": f.number("timeout", 1), "host": f.str("host")}
        problem = ""
        try:
            self.engine.join(spec)
            self.joined = True
        except Exception as e:  # noqa: BLE001 - told to the trainer, then one line here
            problem = first_line(e)
        self._reply(problem)
        if problem:
            raise UserError(f"the weight group: {problem}")

    def _weights(self, msg: dict[str, Any], _: list[torch.Tensor]) -> None:
        self.version = take_update(self.channel, self.engine, msg)

    @torch.no_grad()
    def _answer(self, msg: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        t0 = time.perf_counter()
        f = Fields(msg, "sample")
        B, P = f.ints("shape", 1, 2)
        rng = f.bool("rng")
        rng_state = [(torch.uint8, [torch.get_rng_state().numel()])] if rng else []
        f.tensors(tensors, [(torch.int64, [B, P]), (torch.int64, [B, P]), *rng_state])
        ids, mask = tensors[0], tensors[1]
        state = tensors[2] if rng else None
        seed = f.int("seed", 0, default=None)
        eos = msg.get("eos")
        if not (type(eos) is int or (isinstance(eos, list) and eos and all(type(e) is int for e in eos))):
            raise BadMessage("sample.eos: not a token id or a list of them")
        pad = f.int("pad", 0)
        settings = read_settings(f.fields("settings"))  # the behaviour log-probs always: what the correction weighs
        rows = f.list("rows", None)
        if rows is not None and (len(rows) != B or not all(isinstance(r, dict) for r in rows)):
            raise BadMessage(f"sample.rows: not {B} data rows")
        if self.version < 0:
            raise BadMessage("sample: no weight update has reached this sampler yet")
        device = self.engine.device
        episodes = None
        if rows is not None:
            if self.agent is None:
                raise BadMessage("sample.rows: episodes asked of a sampler told of no tools or environments")
            from dschat.agents.episode import Episodes

            episodes = Episodes(self.agent, self.tokenizer, rows, eos if isinstance(eos, list) else [eos], pad)
        with forked_rng(seed):  # a backend with its own copy resyncs when the version moves
            if state is not None:  # the trainer's own stream: drawn from here, and where it ends goes back
                torch.set_rng_state(state)
                if device.type == "cuda":
                    torch.cuda.manual_seed(int(torch.randint(2**62, (1,)).item()))
            out = generate(self.backend, self.module, Prompts(ids.to(device), mask.to(device), eos, pad), settings,
                           episodes=episodes, engine=SimpleNamespace(global_steps=self.version))
            end = torch.get_rng_state() if state is not None else None
        engine = out.logprobs is None and out.engine_logprobs is not None
        logps = out.engine_logprobs if engine else out.logprobs
        if logps is None:  # never an answer whose behaviour log-probs nobody computed
            raise UserError(f"the sampler's backend ({self.backend.name}) returned no log-probs of its samples; "
                            "use --generation-backend dschat, hf or vllm")
        seqs = out.sequences.to("cpu", torch.long)
        answer = torch.zeros(B, seqs.shape[1] - P, dtype=torch.float32)
        answer.copy_(logps.float().cpu())
        record = None
        extra = [] if end is None else [end]
        if episodes is not None:
            assert out.policy_mask is not None and out.real_mask is not None
            record = episode_record(episodes, seqs[:, P:], out.policy_mask.cpu(), out.real_mask.cpu())
            extra.append(torch.stack([out.policy_mask.bool(), out.real_mask.bool()]).cpu().to(torch.uint8))
        self.channel.send({"version": self.version, "shape": list(seqs.shape), "prompt": P, "engine": engine,
                           "rng": 0 if end is None else end.numel(), "episodes": record,
                           "seconds": time.perf_counter() - t0}, [seqs, answer, *extra])


def episode_record(episodes: Any, answers: torch.Tensor, policy: torch.Tensor, real: torch.Tensor) -> dict[str, Any]:
    """What a batch of episodes did, as JSON: which ended, their ``EpisodeInfo`` and their ``EpisodeCounts``
    (``Episodes.adopt`` takes it on the trainer's side)."""
    counts = episodes.counts(real, policy)
    return {"finished": episodes.finished(), "info": asdict(episodes.info(answers, real)),
            "counts": {**asdict(counts), "kinds": dict(counts.kinds)}}




# ------------------------------------------------------------------------------------------------ the process
def engine_maker(path: str, backend_name: str, device: torch.device, dtype: torch.dtype, vllm: Any,
                 trust_remote_code: bool, log: Callable[[str], None] = print
                 ) -> Callable[[dict[str, Any]], tuple[Any, Backend, torch.nn.Module]]:
    """What builds a sampler's engine when its trainer's hello arrives (``SamplerServer.make``). dschat's decoder
    (and ``hf``, ``compiled``, ``graph``) samples from a module loaded here at once, which the plane writes into
    (``ModuleReceiver``); vLLM is built at the hello, sized for the run (its longest sequence, its LoRA rank and
    ``K + 1`` adapters, the log-probs its sampling settings call for), and holds the only copy."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dschat.generation.backends import make_backend, resolve_backend
    from dschat.generation.weight_plane import ModuleReceiver
    from dschat.models.loading import create_causal_lm

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):  # the model's shape without its weights: what ``auto`` and vLLM's entry read
        stand_in = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code).eval()
    name = resolve_backend(backend_name, stand_in)
    module: Any = None
    if name != "vllm":
        module = create_causal_lm(path, dtype=dtype, trust_remote_code=trust_remote_code).to(device).eval()

    def make(run: dict[str, Any]) -> tuple[Any, Backend, torch.nn.Module]:
        f = Fields(run, "hello.run")
        if name != "vllm":
            backend = make_backend(name, module)
            return ModuleReceiver(module), backend, module
        from dschat.generation.vllm_worker import FedVLLM

        sampling = f.fields("sampling")
        settings = SimpleNamespace(temperature=sampling.number("temperature", 1e-6),
                                   top_p=sampling.number("top_p", 0, 1), top_k=sampling.int("top_k", 0))
        lora = run.get("lora")
        if lora is not None and not (isinstance(lora, dict) and type(lora.get("r")) is int and lora["r"] > 0):
            raise BadMessage("hello.run.lora: not {r, alpha, targets}")
        engine = FedVLLM(vllm, config, dtype, f.int("max_model_len", 2), lora, f.int("max_staleness", 0) + 1,
                         settings, dedicated=True)
        log(engine.describe())
        return engine, engine, stand_in  # no weights outside vLLM: the entry reads the stand-in's config

    return make


def follow_parent() -> None:
    """A sampler that a trainer started (``$DSCHAT_SAMPLER_PARENT``, its pid) ends with it: on Linux the kernel
    sends it SIGTERM when the trainer dies, even by ``kill -9`` (asked for here, in the sampler itself: nothing runs
    between fork and exec in the trainer); a trainer already gone by now is seen at once."""
    import os
    import signal

    parent = os.environ.get(PARENT_ENV, "")
    if not parent.isdigit():
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the first read finds the trainer gone instead
        return
    if os.getppid() != int(parent):
        raise UserError(f"the trainer that started this sampler (pid {parent}) is gone")


def serve_sampler(path: str, listen_at: tuple[str, int], secret: str, timeout_s: float, backend: str,
                  device: torch.device, dtype: torch.dtype, vllm: Any, trust_remote_code: bool,
                  log: Callable[[str], None]) -> None:
    """A sampler's whole life: listen at exactly ``listen_at``, take the first peer that proves ``secret`` (one that
    proves it and leaves before its hello, as ``dschat doctor`` does, is not a trainer: the wait goes on), serve it
    until it says stop. One line and exit code 2 for every way this can fail (``UserError``)."""
    from dschat.generation.channel import accept, listen
    from dschat.models.loading import load_tokenizer

    follow_parent()
    make = engine_maker(path, backend, device, dtype, vllm, trust_remote_code, log)
    tokenizer = load_tokenizer(path, trust_remote_code)
    listener = listen(*listen_at)
    log(f"{path} on {device}, sampling on {backend}; listening at {listen_at[0]}:{listen_at[1]}")
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                channel = accept(listener, secret, max(deadline - time.monotonic(), 0.0), log, timeout_s)
            except ChannelClosed:
                raise UserError(f"no trainer connected to {listen_at[0]}:{listen_at[1]} within --timeout "
                                f"{timeout_s:g} s") from None
            server = SamplerServer(channel, make, tokenizer, log)
            try:
                try:
                    first, tensors = channel.recv()
                except ChannelClosed:
                    log(f"{channel.peer} proved the secret and left (a check, not a trainer); waiting on")
                    channel.close()
                    continue
                if not server.dispatch(first, tensors):
                    server.serve()
                return
            finally:
                server.close()
    finally:
        listener.close()
