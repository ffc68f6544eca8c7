"""``dschat serve``'s HTTP side (FastAPI + uvicorn, the ``serve`` extra): the endpoints, the bearer token, the size
limits, the queue bound and a graceful shutdown (docs/serving.md).

    POST /score        {"prompts": [...], "completions": [...]}  -> {"scores": [...]}
    POST /get_reward   OpenRLHF's shape: {"query": [...]}           -> {"rewards": [...], "scores": [...]}
    GET  /health       200 once the sources are loaded, 503 before
    GET  /info         the model, dtype, limits, the reward's stage-2 mean/std, the tokenizer's fingerprint

The sources load in a thread after the server starts, so ``/health`` answers 503 meanwhile. One worker thread
scores (``Batcher``); uvicorn's shutdown waits for the requests in flight, then the worker finishes every queued
job before the process ends.
"""

# No ``from __future__ import annotations``: FastAPI reads the endpoints' annotations (``Request``, imported inside
# ``create_app`` so that this module imports without the extra) as objects.
import asyncio
import hmac
import json
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from dschat.config import ServeArgs
from dschat.errors import UserError
from dschat.rewards.remote import read_token_file
from dschat.serving.batcher import Batcher, QueueFull
from dschat.serving.service import BadRequest, RewardService, parse_openrlhf_request, parse_score_request


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
    """What the app holds: the service once loaded (or the loading error), and the batcher."""

    def __init__(self) -> None:
        self.service: RewardService | None = None
        self.batcher: Batcher | None = None
        self.error: str | None = None


def create_app(limits: ServeArgs, load: Callable[[], RewardService], token: str | None = None,
               log: Callable[[str], None] = print) -> Any:
    """The FastAPI app. ``load`` builds the ``RewardService`` (in a thread, after start-up); ``token``: the bearer
    token every endpoint but ``/health`` requires."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    state = State()

    def load_now() -> None:
        try:
            service = load()
        except Exception as e:  # noqa: BLE001 - reported by /health and the log, in one line
            state.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            log(f"loading failed: {state.error}")
            return
        state.batcher = Batcher(service.score_rows, service.finish, limits.max_batch_tokens, limits.max_queue)
        state.service = service
        log("ready")

    @asynccontextmanager
    async def lifespan(app: Any) -> Any:
        threading.Thread(target=load_now, name="dschat-serve-load", daemon=True).start()
        yield
        if state.batcher is not None:  # uvicorn has waited for the requests in flight; finish what is queued
            await asyncio.to_thread(state.batcher.close, True)
            log(f"stopped: {state.batcher.jobs_done} request(s) scored in {state.batcher.batches} forward(s)")

    app = FastAPI(title="dschat reward server", lifespan=lifespan)
    app.state.dschat = state

    def error(status: int, reason: str) -> Any:
        return JSONResponse({"error": reason}, status_code=status)

    def unauthorized(request: Request) -> Any | None:
        if token is None:
            return None
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode("utf-8"), f"Bearer {token}".encode()):
            return JSONResponse({"error": "missing or wrong bearer token"}, status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        return None

    async def body_of(request: Request) -> Any:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limits.max_body_bytes:
            raise BadRequest(413, f"body of {length} bytes; at most {limits.max_body_bytes} (--max-body-bytes)")
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > limits.max_body_bytes:
                raise BadRequest(413, f"body over {limits.max_body_bytes} bytes (--max-body-bytes)")
        try:
            return json.loads(bytes(raw))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise BadRequest(422, f"the body is not JSON ({e.__class__.__name__})") from None

    async def score(request: Request, openrlhf: bool) -> Any:
        if (denied := unauthorized(request)) is not None:
            return denied
        service, batcher = state.service, state.batcher
        if service is None or batcher is None:
            return error(503, state.error or "loading")
        try:
            body = await body_of(request)
            tok = service.tokenizer
            req = parse_openrlhf_request(body, limits.max_request_rows) if openrlhf else \
                parse_score_request(body, tok, limits.max_request_rows)
            job = service.job(req, openrlhf)
            future = batcher.submit(job)
        except BadRequest as e:
            return error(e.status, e.reason)
        except QueueFull as e:
            return error(429, str(e))
        try:
            return await asyncio.wrap_future(future)
        except (UserError, ValueError) as e:
            return error(422, str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
        except Exception as e:  # noqa: BLE001 - one line to the client, the server lives on
            return error(500, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")

    @app.post("/score")
    async def score_endpoint(request: Request) -> Any:
        return await score(request, openrlhf=False)

    @app.post("/get_reward")
    async def get_reward_endpoint(request: Request) -> Any:
        return await score(request, openrlhf=True)

    @app.get("/health")
    async def health() -> Any:
        if state.service is None:
            return error(503, state.error or "loading")
        return {"status": "ok"}

    @app.get("/info")
    async def info(request: Request) -> Any:
        if (denied := unauthorized(request)) is not None:
            return denied
        if state.service is None:
            return error(503, state.error or "loading")
        batcher = state.batcher
        return {**state.service.info, "queued": batcher.queue.qsize() if batcher else 0,
                "batches": batcher.batches if batcher else 0}

    return app


def serve(cfg: Any) -> None:
    """Run the server of a ``ServeConfig`` until Ctrl-C or SIGTERM: then it finishes what is in flight, and uvicorn
    raises the signal again once it has stopped (a Ctrl-C exits 130, a SIGTERM as terminated by it)."""
    require_serve_extra()
    import uvicorn

    from dschat.serving.service import load_service, source_names

    s, r = cfg.serve, cfg.rewards
    source_names(r.reward_model, r.judge_model, list(r.reward_funcs))  # before anything loads
    token = read_token_file(s.token_file, "--token-file") if s.token_file else None

    def log(msg: str) -> None:
        print(f"[dschat serve] {msg}", flush=True)

    app = create_app(s, lambda: load_service(cfg, log), token, log)
    log(f"listening on http://{s.host}:{s.port} (POST /score, POST /get_reward, GET /health, GET /info)"
        + ("; bearer token required" if token else ""))
    uvicorn.Server(uvicorn.Config(app, host=s.host, port=s.port, log_level="warning", access_log=False)).run()
