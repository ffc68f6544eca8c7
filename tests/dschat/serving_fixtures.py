"""Shared by the server and remote-reward tests: a tiny saved reward model, a dschat server (uvicorn in a thread
of the test process) and plain HTTP calls."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def needs_serve_extra() -> None:
    """Skip (fail under CI, which installs it) a test that runs ``dschat serve`` without FastAPI and uvicorn."""
    import importlib.util
    import os

    import pytest

    if all(importlib.util.find_spec(m) is not None for m in ("fastapi", "uvicorn")):
        return
    if os.environ.get("CI"):
        pytest.fail("fastapi and uvicorn are not installed (CI installs requirements-serve.txt)")
    pytest.skip("dschat serve's extra is not installed: pip install -r requirements-serve.txt")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_tiny_reward_model(out: Path, seed: int = 0) -> Path:
    """The tiny preset with a seeded one-label head, saved as a stage-2 output would be (mean/std in its config)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from dschat.models.loading import resolve_model

    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(resolve_model("tiny"), num_labels=1)
    model.config.reward_mean, model.config.reward_std = 0.25, 1.5
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(resolve_model("tiny")).save_pretrained(out)
    return out


def serve_config(**values: Any) -> Any:
    from dschat.config import build_config
    from dschat.serving.config import ServeConfig

    return build_config(ServeConfig, values)


@contextlib.contextmanager
def running(app: Any, port: int | None = None, wait_ready: bool = True) -> Iterator[tuple[str, Any]]:
    """Serve ``app`` on 127.0.0.1 in a thread; yields the base URL and the uvicorn server (``should_exit``
    stops it gracefully)."""
    from dschat.serving.server import uvicorn_server

    port = port or free_port()
    server = uvicorn_server(app, "127.0.0.1", port, log_level="error")  # as `dschat serve` runs it: its guard
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise AssertionError("the server did not start")
        time.sleep(0.02)
    while wait_ready and call(base + "/health")[0] != 200:
        if time.time() > deadline:
            raise AssertionError("the server never became ready")
        time.sleep(0.05)
    try:
        yield base, server
    finally:
        server.should_exit = True
        thread.join(60)


def call(url: str, body: Any = None, token: str | None = None, raw: bytes | None = None,
         timeout: float = 60, content_type: str | None = "application/json",
         authorization: str | None = None) -> tuple[int, Any]:
    """``(status, JSON reply)`` of a GET (no body) or POST (``content_type`` None: no Content-Type header;
    ``authorization``: the header as given, instead of ``Bearer <token>``)."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": content_type} if data is not None and content_type is not None else {}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    if authorization is not None:
        headers["Authorization"] = authorization
    req = urllib.request.Request(url, data=data, headers=headers, method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def rm_app(rm_dir: Path, log: Callable[[str], None] = lambda _: None, **serve: Any) -> Any:
    """The dschat server of ``rm_dir`` (the real app and loader, as ``dschat serve --reward-model``)."""
    from dschat.rewards.remote import read_token_file
    from dschat.serving.server import create_app
    from dschat.serving.service import load_service

    cfg = serve_config(reward_model=str(rm_dir), **serve)
    token = read_token_file(cfg.serve.token_file, "--token-file") if cfg.serve.token_file else None
    return create_app(cfg.serve, lambda: load_service(cfg, log), token, log)


class FakeTokenizer:
    """A stand-in for the reward model's tokenizer: a vocabulary of 1000 ids, a chat template that counts its
    calls (so a test sees whether a request's rows were rendered), and an encoder of one id per character that
    takes ``seconds_per_char`` a character (a slow tokenizer) and counts the characters it encoded."""

    pad_token_id, eos_token_id, bos_token_id, chat_template = 0, 1, None, "fake"

    def __init__(self, seconds_per_char: float = 0.0) -> None:
        self.rendered = 0
        self.encoded = 0  # characters encoded so far
        self.seconds_per_char = seconds_per_char

    def __len__(self) -> int:
        return 1000

    def get_vocab(self) -> dict[str, int]:
        return {"<pad>": 0, "</s>": 1}

    def apply_chat_template(self, messages: list[dict[str, str]], **_: Any) -> str:
        self.rendered += 1
        return "".join(m["content"] for m in messages)

    def __call__(self, text: str, **_: Any) -> dict[str, list[int]]:
        time.sleep(self.seconds_per_char * len(text))
        self.encoded += len(text)
        return {"input_ids": [2 + ord(c) % 998 for c in text]}

    def __deepcopy__(self, memo: dict) -> FakeTokenizer:
        return self  # one counter for both of the server's parsing lanes


def fake_rm_app(seconds_per_token: float = 0.0, rows_delay: float = 0.0, seconds_per_char: float = 0.0,
                log: Callable[[str], None] = lambda _: None, **limits: Any) -> Any:
    """A server of a stand-in reward model whose score of a row is the sum of its ids and whose forward sleeps
    ``seconds_per_token`` per padded token (so a test controls how long a request holds the worker); preparing a
    request first sleeps ``rows_delay``, and encoding text sleeps ``seconds_per_char`` a character (a slow
    tokenizer: ``FakeTokenizer``). The service is ``app.state.fake`` (its ``forwards``: the rows of each forward;
    ``tokenizer.encoded``: the characters encoded)."""
    import torch

    from dschat.config import ServeArgs
    from dschat.rlhf.scoring import score_width
    from dschat.serving.server import create_app
    from dschat.serving.service import RewardService

    class FakeService(RewardService):
        forwards: list[int] = []

        def prepare(self, raw: bytes, openrlhf: bool = False, tokenizer: Any = None) -> Any:
            time.sleep(rows_delay)
            return (yield from super().prepare(raw, openrlhf, tokenizer))

        def score_rows(self, rows: list[list[int]]) -> torch.Tensor:
            time.sleep(seconds_per_token * sum(score_width(len(r)) for r in rows))
            self.forwards.append(len(rows))
            return torch.tensor([float(sum(r)) for r in rows])

    args = ServeArgs(**limits)
    service = FakeService(["rm"], [], {}, object(), FakeTokenizer(seconds_per_char), args, {})
    service.forwards = []
    app = create_app(args, lambda: service, log=log)
    app.state.fake = service
    return app
