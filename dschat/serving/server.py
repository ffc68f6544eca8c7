"""``dschat serve``'s HTTP side (FastAPI + uvicorn, the ``serve`` extra): the endpoints, the bearer token, the size
limits and deadlines, the queue bound and a graceful shutdown (docs/serving.md).

    POST /score        {"prompts": [...], "completions": [...]}  -> {"scores": [...]}
    POST /get_reward   OpenRLHF's shape: {"query": [...]}           -> {"rewards": [...], "scores": [...]}
    GET  /health       200 once the sources are loaded, 503 before
    GET  /info         the model, dtype, limits, the reward's stage-2 mean/std, the tokenizer's fingerprint

The sources load in a thread after the server starts, so ``/health`` answers 503 meanwhile; when loading fails,
the server stops and ``serve`` ends with the error. A request's body is read under ``--body-timeout`` and parsed,
checked and tokenised beside the event loop, in bounded steps taken in turn with the other requests'
(``parser.Parser``), so a large body never stalls the other connections nor the small requests. One worker thread
scores (``Batcher``). A request whose client disconnects is dropped from the stage it is in, with one line in the
log. uvicorn's shutdown waits for the requests in flight, then the worker
finishes every queued job before the process ends. The connections themselves are capped and timed by
``guard.ConnectionGuard``.
"""

# No ``from __future__ import annotations``: FastAPI reads the endpoints' annotations (``Request``, imported inside
# ``create_app`` so that this module imports without the extra) as objects.
import asyncio
import errno
import hmac
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import asynccontextmanager
from typing import Any

from dschat.config import ServeArgs
from dschat.errors import UserError, first_line
from dschat.rewards.remote import read_token_file
from dschat.serving.batcher import Batcher, ClientGone, QueueFull
from dschat.serving.guard import MAX_HEADER_BYTES, ConnectionGuard
from dschat.serving.parser import Parser
from dschat.serving.service import BadRequest, RewardService


def require_serve_extra() -> None:
    """One line, exit 2, when FastAPI or uvicorn is missing."""
    missing = []
    for name in ("fastapi", "uvicorn"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise UserError(f"dschat serve needs {' and '.join(missing)}: pip install -r requirements-serve.txt "
                        "(or pip install 'dschat[serve]')")


class State:
    """What the app holds: the limits, the service once loaded (or the loading error), the batcher, and ``stop``
    (set by ``uvicorn_server``: ends the server, as when loading fails)."""

    def __init__(self, limits: ServeArgs) -> None:
        self.limits = limits
        self.service: RewardService | None = None
        self.batcher: Batcher | None = None
        self.parser: Parser | None = None
        self.error: str | None = None
        self.stop: Callable[[], None] | None = None
        self.guard: ConnectionGuard | None = None


def bearer_matches(header: str, token: str) -> bool:
    """``Authorization: Bearer <token>``, the scheme in any case (RFC 9110 11.1); constant-time in the token."""
    scheme, _, given = header.strip().partition(" ")
    ok = hmac.compare_digest(given.strip().encode("utf-8", "replace"), token.encode("utf-8"))
    return ok and scheme.lower() == "bearer"


def is_json(content_type: str | None) -> bool:
    """``application/json``, with or without parameters (``; charset=utf-8``)."""
    return (content_type or "").split(";", 1)[0].strip().lower() == "application/json"


def create_app(limits: ServeArgs, load: Callable[[], RewardService], token: str | None = None,
               log: Callable[[str], None] = print) -> Any:
    """The FastAPI app. ``load`` builds the ``RewardService`` (in a thread, after start-up); ``token``: the bearer
    token every endpoint but ``/health`` requires. No /docs, /redoc or /openapi.json: docs/serving.md is the
    reference, and nothing but the endpoints answers."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    state = State(limits)

    def load_now() -> None:
        try:
            service = load()
        except Exception as e:  # noqa: BLE001 - one line; serve() ends the process with it
            state.error = f"{type(e).__name__}: {first_line(e)}" if not isinstance(e, UserError) else first_line(e)
            log("loading failed; stopping")
            if state.stop is not None:
                state.stop()
            return
        state.batcher = Batcher(service.score_rows, service.finish, limits.max_batch_tokens, limits.max_queue)
        state.parser = Parser(service.tokenizer, limits.max_queue)
        state.service = service
        log("ready")

    @asynccontextmanager
    async def lifespan(app: Any) -> Any:
        threading.Thread(target=load_now, name="dschat-serve-load", daemon=True).start()
        yield
        if state.parser is not None:
            state.parser.close(10)
        if state.batcher is not None:  # uvicorn has waited for the requests in flight; finish what is queued
            await asyncio.to_thread(state.batcher.close, True)
            b = state.batcher
            log(f"stopped: {b.jobs_done} request(s) scored in {b.batches} forward(s)"
                + (f", {b.dropped} dropped (client gone)" if b.dropped else ""))

    app = FastAPI(title="dschat reward server", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.dschat = state

    def error(status: int, reason: str, close: bool = False) -> Any:
        return JSONResponse({"error": reason}, status_code=status, headers={"Connection": "close"} if close else None)

    def unauthorized(request: Request) -> Any | None:
        if token is None or bearer_matches(request.headers.get("authorization", ""), token):
            return None
        return JSONResponse({"error": "missing or wrong bearer token"}, status_code=401,
                            headers={"WWW-Authenticate": "Bearer"})

    async def read_body(request: Request) -> bytes:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limits.max_body_bytes:
            raise BadRequest(413, f"body of {length} bytes; at most {limits.max_body_bytes} (--max-body-bytes)")
        raw = bytearray()

        async def receive_all() -> None:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone("the client disconnected")
                raw.extend(message.get("body", b""))
                if len(raw) > limits.max_body_bytes:
                    raise BadRequest(413, f"body over {limits.max_body_bytes} bytes (--max-body-bytes)")
                if not message.get("more_body", False):
                    return

        try:
            await asyncio.wait_for(receive_all(), limits.body_timeout)
        except asyncio.TimeoutError:
            raise BadRequest(408, f"the body took over {limits.body_timeout:g} s (--body-timeout)") from None
        return bytes(raw)

    async def until_disconnected(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def outcome(future: Future, gone: asyncio.Future) -> tuple[bool, Any]:
        """``(True, result)`` of a stage's future (its exception raised), or ``(False, None)`` when the client
        went away first. The stage's own future is never cancelled from here: the stage drops the work."""
        waiting = asyncio.wrap_future(future)
        waiting.add_done_callback(lambda f: f.cancelled() or f.exception())  # read, so never "never retrieved"
        await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
        if waiting.done():
            return True, waiting.result()
        return False, None

    def client_gone(stage: str, rows: int | None = None) -> Any:
        log(f"client disconnected {stage}; its request{f' of {rows} row(s)' if rows is not None else ''} was "
            "dropped (499)")
        return error(499, "the client disconnected")

    async def score(request: Request, openrlhf: bool) -> Any:
        if (denied := unauthorized(request)) is not None:
            return denied
        if not is_json(request.headers.get("content-type")):
            return error(415, "the body must be JSON (Content-Type: application/json)")
        service, batcher, parser = state.service, state.batcher, state.parser
        if service is None or batcher is None or parser is None:
            return error(503, "loading failed" if state.error else "loading")
        gone: asyncio.Future | None = None
        try:
            try:
                raw = await read_body(request)
            except ClientGone:
                return client_gone("while sending its body")
            task = parser.submit(lambda tok: service.prepare(raw, openrlhf, tok), len(raw))
            gone = asyncio.ensure_future(until_disconnected(request))
            ready, job = await outcome(task.future, gone)
            if not ready:
                task.cancel()
                return client_gone("while its body was parsed")
            batcher.submit(job)
            ready, answer = await outcome(job.future, gone)
            if not ready:
                job.cancel()
                return client_gone("while it waited or was scored", len(job.payload["request"].completions))
            return answer
        except BadRequest as e:
            return error(e.status, e.reason, close=e.status in (408, 413))
        except QueueFull as e:
            return error(429, str(e))
        except ClientGone:
            return error(499, "the client disconnected")
        except (UserError, ValueError) as e:
            return error(422, first_line(e))
        except Exception as e:  # noqa: BLE001 - one line to the client and the log, the server lives on
            log(f"scoring failed: {type(e).__name__}: {first_line(e)}")
            return error(500, f"{type(e).__name__}: {first_line(e)}")
        finally:
            if gone is not None:
                gone.cancel()

    @app.post("/score")
    async def score_endpoint(request: Request) -> Any:
        return await score(request, openrlhf=False)

    @app.post("/get_reward")
    async def get_reward_endpoint(request: Request) -> Any:
        return await score(request, openrlhf=True)

    @app.get("/health")
    async def health() -> Any:
        if state.service is None:  # never the reason: it may name files; the log and the exit have it
            return error(503, "loading failed" if state.error else "loading")
        return {"status": "ok"}

    @app.get("/info")
    async def info(request: Request) -> Any:
        if (denied := unauthorized(request)) is not None:
            return denied
        if state.service is None:
            return error(503, "loading failed" if state.error else "loading")
        batcher = state.batcher
        return {**state.service.info, "max_connections": limits.max_connections,
                "header_timeout": limits.header_timeout, "body_timeout": limits.body_timeout,
                "queued": batcher.queued() if batcher else 0, "batches": batcher.batches if batcher else 0,
                "dropped": (batcher.dropped if batcher else 0) + (state.parser.dropped if state.parser else 0)}

    return app


def uvicorn_server(app: Any, host: str, port: int, log_level: str = "warning") -> Any:
    """The uvicorn server of an app of ``create_app``, under its limits: the connection guard (a cap on open
    connections, a deadline for a request's line and headers), headers of at most ``MAX_HEADER_BYTES``, the
    h11 protocol (the one the guard extends), no websockets, no proxy headers (nothing here trusts a client's
    address). Loading failures stop it (``State.stop``)."""
    import uvicorn

    state: State = app.state.dschat
    limits = state.limits
    state.guard = ConnectionGuard(limits.max_connections, limits.header_timeout)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            http=state.guard.protocol(), ws="none", proxy_headers=False, server_header=False,
                            h11_max_incomplete_event_size=MAX_HEADER_BYTES)
    server = uvicorn.Server(config)

    def stop() -> None:
        server.should_exit = True

    state.stop = stop
    return server


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port``, or one line naming the port (a ``UserError``, exit 2): in use, not
    allowed, or an address this machine does not have. Bound before anything loads, so ``serve`` says it listens
    only once it does."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, backlog=2048)
    except socket.gaierror as e:
        raise UserError(f"dschat serve: cannot listen on {host} (--host): {e.strerror}") from None
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise UserError(f"dschat serve: port {port} on {host} is in use (--port); stop what holds it or pick "
                            "another port") from None
        if e.errno == errno.EACCES:
            raise UserError(f"dschat serve: no permission to listen on port {port} (--port); ports below 1024 need "
                            "privileges") from None
        raise UserError(f"dschat serve: cannot listen on {host}:{port} (--host, --port): "
                        f"{e.strerror or first_line(e)}") from None
    sock.set_inheritable(True)
    return sock


def serve(cfg: Any) -> None:
    """Run the server of a ``ServeConfig`` until Ctrl-C or SIGTERM: then it finishes what is in flight, and uvicorn
    raises the signal again once it has stopped (a Ctrl-C exits 130, a SIGTERM as terminated by it). Sources
    that fail to load end it with their one-line error (exit 2), as does a port it cannot listen on."""
    require_serve_extra()

    from dschat.serving.service import load_service, source_names

    s, r = cfg.serve, cfg.rewards
    source_names(r.reward_model, r.judge_model, list(r.reward_funcs))  # before anything loads
    token = read_token_file(s.token_file, "--token-file") if s.token_file else None

    def log(msg: str) -> None:
        print(f"[dschat serve] {msg}", flush=True)

    sock = listen_socket(s.host, s.port)  # before anything loads, and before saying it listens
    app = create_app(s, lambda: load_service(cfg, log), token, log)
    server = uvicorn_server(app, s.host, s.port)
    log(f"listening on http://{s.host}:{s.port} (POST /score, POST /get_reward, GET /health, GET /info)"
        + ("; bearer token required" if token else ""))
    server.run(sockets=[sock])
    if app.state.dschat.error is not None:
        raise UserError(f"dschat serve: loading the reward sources failed: {app.state.dschat.error}")
