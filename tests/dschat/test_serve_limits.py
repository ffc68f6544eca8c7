"""dschat serve under abuse, on 127.0.0.1 with a bounded number of connections and a deadline on every wait: a
body over --max-request-tokens is refused after the chunk of rows that crosses it, small requests are not starved
behind large bodies, a sender that leaves stops its parsing, a burst past --max-connections gets a status for
every connection, fields that collide with an argument get a 422, a client that leaves is logged, and a port in
use is one line."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from dschat.config import ServeArgs  # noqa: E402
from dschat.serving.server import create_app  # noqa: E402
from dschat.serving.service import RewardService  # noqa: E402
from tests.dschat.serving_fixtures import call, fake_rm_app, free_port, running  # noqa: E402

SMALL = {"prompts": ["p"], "completions": ["c"]}  # 'p' (114) + 'c' (101) + EOS (1) with FakeTokenizer


def text_body(rows: int, chars: int) -> dict:
    return {"prompts": ["x" * chars] * rows, "completions": ["y"] * rows}


def timed(url: str, body: dict, timeout: float = 10) -> tuple[int, float]:
    t0 = time.monotonic()
    status, _ = call(url, body, timeout=timeout)
    return status, time.monotonic() - t0


def post_then_leave(port: int, body: dict, after: float) -> None:
    """Send a whole request, wait ``after`` seconds, and close the connection without reading the answer."""
    raw = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(raw) + raw)
        time.sleep(after)


def test_a_body_over_the_token_bound_is_refused_after_the_chunk_that_crosses_it():
    """400 rows of 2000 characters, each 64 padded tokens once cut to --max-seq-len, against a bound of 1024
    tokens: 413 once the first chunk of rows crosses it, with a tenth of the text encoded at most (encoding all of
    it would take 4 s here)."""
    app = fake_rm_app(seconds_per_char=5e-6, max_request_tokens=1024, max_seq_len=64)
    with running(app) as (base, _):
        t0 = time.monotonic()
        status, reply = call(base + "/score", text_body(400, 2000), timeout=20)
        elapsed = time.monotonic() - t0
    assert status == 413 and "--max-request-tokens" in reply["error"] and "\n" not in reply["error"]
    assert app.state.fake.tokenizer.encoded <= 80_000 < 400 * 2000 and elapsed < 2.0, elapsed


def test_small_requests_are_not_starved_behind_large_bodies():
    """Four large bodies, two too large for the small lane (2.4 s of encoding each) and two within it (0.6 s each):
    one-row requests posted meanwhile are answered within a second each (in one queue they would wait 6 s)."""
    app = fake_rm_app(seconds_per_char=2e-6, max_request_tokens=1_000_000, max_seq_len=64, max_body_bytes=4_000_000)
    big = text_body(600, 2000)  # 1.2 MB: the bulk lane
    medium = text_body(150, 2000)  # 300 KB: beside the small requests, a chunk of rows at a time
    with running(app) as (base, _):
        with ThreadPoolExecutor(4) as pool:
            large = [pool.submit(call, base + "/score", body, timeout=30) for body in (big, big, medium, medium)]
            time.sleep(0.3)
            waits = [timed(base + "/score", SMALL) for _ in range(4)]
            assert all(f.result(30)[0] == 200 for f in large)
    assert all(status == 200 for status, _ in waits) and max(w for _, w in waits) < 1.0, waits


def test_a_sender_that_leaves_stops_its_parsing_and_is_logged():
    """A body that takes 4 s to encode: its sender closes the connection after 0.5 s; the encoding stops, one line
    says so, and the next request is answered at once."""
    lines: list[str] = []
    app = fake_rm_app(seconds_per_char=5e-6, max_request_tokens=1_000_000, max_seq_len=64, log=lines.append)
    with running(app) as (base, _):
        post_then_leave(int(base.rsplit(":", 1)[1]), text_body(400, 2000), after=0.5)
        deadline = time.monotonic() + 3
        while not any("disconnected" in ln for ln in lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        encoded = app.state.fake.tokenizer.encoded
        status, wait = timed(base + "/score", SMALL)
        time.sleep(0.3)
        assert app.state.fake.tokenizer.encoded - encoded <= 2 * 40_000  # the small one, and a chunk in hand
    gone = [ln for ln in lines if "disconnected" in ln]
    assert gone == ["client disconnected while its body was parsed; its request was dropped (499)"], lines
    assert encoded < 400 * 2000 // 2 and status == 200 and wait < 1.0


def test_a_client_that_leaves_during_scoring_is_logged():
    lines: list[str] = []
    app = fake_rm_app(seconds_per_token=0.5 / 1024, max_batch_tokens=256, log=lines.append)
    big = {"prompts": ["p"] * 128, "completions": ["c"] * 128, "input_ids": [[9] * 20] * 128}
    with running(app) as (base, _):
        with pytest.raises(OSError):
            call(base + "/score", big, timeout=0.4)
        deadline = time.monotonic() + 5
        while not any("disconnected" in ln for ln in lines) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert [ln for ln in lines if "disconnected" in ln] == [
        "client disconnected while it waited or was scored; its request of 128 row(s) was dropped (499)"]


def rule_app(fn, **limits):
    args = ServeArgs(**limits)
    return create_app(args, lambda: RewardService(["slow"], [], {"slow": fn}, None, None, args, {}))


def test_a_burst_past_max_connections_gets_a_status_for_every_connection():
    """40 connections at once against --max-connections 8: each gets an HTTP status (200 or 503 with Retry-After),
    none a bare close; the server answers afterwards."""
    def slow(prompts, completions, **_):
        time.sleep(0.05)
        return [1.0] * len(completions)

    app = rule_app(slow, max_connections=8)
    body = json.dumps(SMALL).encode()
    request = (b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
               b"Content-Length: %d\r\n\r\n" % len(body)) + body
    with running(app) as (base, _):
        port = int(base.rsplit(":", 1)[1])
        socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(40)]
        answers = []
        try:
            for sock in socks:
                try:
                    sock.sendall(request)
                except OSError:
                    pass  # judged by what comes back
            for sock in socks:
                data = b""
                try:
                    while chunk := sock.recv(65536):
                        data += chunk
                except OSError:
                    pass
                answers.append(data)
        finally:
            for sock in socks:
                sock.close()
        statuses = [a[9:12] for a in answers]
        assert all(a.startswith(b"HTTP/1.1 ") for a in answers), [a[:40] for a in answers]
        assert set(statuses) <= {b"200", b"503"} and statuses.count(b"200") >= 1, statuses
        assert all(b"retry-after: 1" in a.lower() for a in answers if a[9:12] == b"503")
        assert call(base + "/score", SMALL, timeout=10) == (200, {"scores": [1.0]})
        assert app.state.dschat.guard.peak <= 8


def test_fields_named_like_an_argument_get_a_one_line_422():
    """'self' (the mixer's own), and the names of a served function's first two parameters: 422, not a 500."""
    def fn(p, c, **fields):
        return [float(len(fields.get("winner", [""])[i])) for i in range(len(c))]

    with running(rule_app(fn)) as (base, _):
        for name in ("self", "p", "c", "external"):
            status, reply = call(base + "/score", {**SMALL, "fields": {name: [1]}}, timeout=10)
            assert status == 422 and f"may not set '{name}'" in reply["error"] and "\n" not in reply["error"], reply
        assert call(base + "/score", {**SMALL, "fields": {"winner": ["abc"]}}, timeout=10) == (200, {"scores": [3.0]})


def test_dschat_serve_on_a_port_in_use_is_one_line_and_exit_2():
    from tests.helpers import run_cli

    port = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        proc = run_cli("serve", "--reward-model", "no/such/model", "--port", str(port), timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert errors == [f"dschat: error: dschat serve: port {port} on 127.0.0.1 is in use (--port); stop what holds "
                      "it or pick another port"], proc.stderr[-2000:]
    assert "listening" not in proc.stdout and "Traceback" not in proc.stdout + proc.stderr


def test_the_parser_takes_steps_in_turn_and_drops_a_cancelled_task():
    """Unit: one step of every task before the next of any; a cancelled task is dropped before its next step; past
    the backlog bound, QueueFull."""
    from dschat.serving.batcher import ClientGone, QueueFull
    from dschat.serving.parser import Parser

    order: list[str] = []
    gate = threading.Event()

    def steps(name: str, n: int):
        def make(tokenizer):
            for i in range(n):
                gate.wait(10)
                order.append(f"{name}{i}")
                yield
            return name
        return make

    parser = Parser(None, max_pending=3)
    try:
        a, b, c = (parser.submit(steps(name, 3), 10) for name in "abc")
        with pytest.raises(QueueFull):
            parser.submit(steps("d", 1), 10)
        c.cancel()
        gate.set()
        assert a.future.result(10) == "a" and b.future.result(10) == "b"
        with pytest.raises(ClientGone):
            c.future.result(10)
        assert [s for s in order if not s.startswith("c")] == ["a0", "b0", "a1", "b1", "a2", "b2"]
        assert len([s for s in order if s.startswith("c")]) <= 1 and parser.dropped == 1
    finally:
        gate.set()
        parser.close(10)


def test_a_body_parsed_in_the_bulk_lane_scores_as_in_process(tmp_path):
    """A body over 1 MiB is encoded by the bulk lane's copy of the tokenizer: the scores equal stage 3's
    in-process ones for the same text, bit for bit."""
    import torch

    from dschat.models.loading import frozen_reward_model, load_tokenizer
    from dschat.rlhf.scoring import score_texts
    from tests.dschat.serving_fixtures import rm_app, save_tiny_reward_model

    rm_dir = save_tiny_reward_model(tmp_path / "rm")
    words = "the quick brown fox jumps over a lazy dog while rain falls on quiet hills".split()
    prompts = [f"Human: {i} " + " ".join(words[(i + j) % len(words)] for j in range(1600)) + "\nAssistant:"
               for i in range(140)]
    answers = [f" answer {i}" for i in range(140)]
    body = {"prompts": prompts, "completions": answers, "ended": [i % 3 != 0 for i in range(140)]}
    assert len(json.dumps(body)) > (1 << 20)
    app = rm_app(rm_dir)
    with running(app) as (base, _):
        status, reply = call(base + "/score", body, timeout=120)
        assert app.state.dschat.parser.bulk is not None
    tok = load_tokenizer(str(rm_dir))
    model = frozen_reward_model(str(rm_dir), torch.float32, tok.pad_token_id)
    expected, cut = score_texts(model, tok, prompts, answers, body["ended"], 512)
    assert status == 200 and reply["scores"] == expected.tolist() and cut == 140
