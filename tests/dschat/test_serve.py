"""dschat serve: the one scoring path (a row's score does not depend on its batch), served scores equal to stage
3's in-process ones bit for bit, the endpoints, the limits (413, 422, 429), the bearer token (401, never logged),
OpenRLHF's request shape, a graceful shutdown and a short load test."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from dschat.config import ServeArgs  # noqa: E402
from dschat.serving.server import create_app  # noqa: E402
from dschat.serving.service import RewardService  # noqa: E402
from tests.dschat.serving_fixtures import call, rm_app, running, save_tiny_reward_model  # noqa: E402
from tests.helpers import run_cli  # noqa: E402

PROMPTS = ["Human: What is 2 + 2?\nAssistant:", "Human: Name a colour.\nAssistant:",
           "Human: Write a haiku about rain, please, in the old style.\nAssistant:", "Human: Hi\nAssistant:"]
ANSWERS = [" 4", " Blue, like the sky on a clear morning.", " Rain on the roof / a slow drum / sleep comes", ""]
ENDED = [True, True, False, True]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return save_tiny_reward_model(tmp_path_factory.mktemp("serve") / "rm")


@pytest.fixture(scope="module")
def rm(rm_dir):
    """The reward model and tokenizer as stage 3 loads them (``frozen_models``)."""
    from dschat.models.loading import frozen_reward_model, load_tokenizer

    tok = load_tokenizer(str(rm_dir))
    return frozen_reward_model(str(rm_dir), torch.float32, tok.pad_token_id), tok


@pytest.fixture(scope="module")
def server(rm_dir):
    with running(rm_app(rm_dir)) as (base, _):
        yield base


@pytest.fixture(scope="module")
def small_server(rm_dir):
    with running(rm_app(rm_dir, max_request_rows=8, max_body_bytes=4000)) as (base, _):
        yield base


def rollout_of(tok, prompts, answers, ended):
    """A stage-3 rollout's layout: prompts left-padded to one width, answers right-padded after them (EOS only
    after an answer that ended)."""
    p = [tok(x)["input_ids"] for x in prompts]
    a = [tok(x, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if e else [])
         for x, e in zip(answers, ended, strict=True)]
    P, A = max(map(len, p)), max(map(len, a)) + 3
    seq = torch.full((len(p), P + A), tok.pad_token_id)
    mask = torch.zeros((len(p), P + A), dtype=torch.long)
    for i, (x, y) in enumerate(zip(p, a, strict=True)):
        seq[i, P - len(x): P], mask[i, P - len(x): P] = torch.tensor(x), 1
        if y:
            seq[i, P: P + len(y)], mask[i, P: P + len(y)] = torch.tensor(y), 1
    return SimpleNamespace(sequences=seq, attention_mask=mask, prompt_len=P, reached_eos=torch.tensor(ended))


def test_a_rows_score_does_not_depend_on_its_batch(rm):
    """Widths depend on a row's own length, so scoring rows alone, all together, or in packs of a token budget
    gives the same bits (the property that lets the server pack concurrent requests)."""
    from dschat.rlhf.scoring import encode_for_reward, score_rows

    model, tok = rm
    rows, _ = encode_for_reward(PROMPTS * 3, ANSWERS * 3, ENDED * 3, tok, 512)
    rows = [r[: 5 + 7 * i] for i, r in enumerate(rows)]  # a spread of lengths
    together = score_rows(model, rows, tok.pad_token_id)
    alone = torch.cat([score_rows(model, [r], tok.pad_token_id) for r in rows])
    packed = score_rows(model, rows, tok.pad_token_id, max_tokens=64)
    shuffled_order = list(reversed(range(len(rows))))
    shuffled = score_rows(model, [rows[i] for i in shuffled_order], tok.pad_token_id)
    assert torch.equal(together, alone) and torch.equal(together, packed)
    assert torch.equal(together, shuffled.flip(0))


def test_served_scores_equal_stage3_in_process(server, rm):
    """Text is scored as stage 3 scores a reward model with its own tokenizer (Retokenizer), token ids as it scores
    the actor's own tokens (same tokenizer): bit for bit, alone or beside concurrent requests."""
    from dschat.rlhf.scoring import Retokenizer, real_rows, reward_scores

    model, tok = rm
    rollout = rollout_of(tok, PROMPTS, ANSWERS, ENDED)
    same_tok = reward_scores(model, rollout).tolist()
    retok = reward_scores(model, rollout, Retokenizer(tok, tok, 512)).tolist()
    status, info = call(server + "/info")
    assert status == 200 and info["tokenizer"] and info["reward_mean"] == 0.25 and info["reward_std"] == 1.5
    assert info["dtype"] == "float32" and info["max_seq_len"] == 512 and info["sources"] == ["rm"]
    texts = [tok.decode(r[: rollout.prompt_len][m[: rollout.prompt_len].bool()], skip_special_tokens=True)
             for r, m in zip(rollout.sequences, rollout.attention_mask, strict=True)]
    answers = [tok.decode(r[rollout.prompt_len:][m[rollout.prompt_len:].bool()], skip_special_tokens=True)
               for r, m in zip(rollout.sequences, rollout.attention_mask, strict=True)]
    by_text = {"prompts": texts, "completions": answers, "ended": ENDED}
    by_ids = {**by_text, "input_ids": real_rows(rollout.sequences, rollout.attention_mask)}
    assert call(server + "/score", by_text) == (200, {"scores": retok})
    assert call(server + "/score", by_ids) == (200, {"scores": same_tok})
    with ThreadPoolExecutor(8) as pool:  # packed with each other by the server's batcher
        replies = list(pool.map(lambda i: call(server + "/score", by_ids if i % 2 else by_text), range(16)))
    assert all(r == (200, {"scores": same_tok if i % 2 else retok}) for i, r in enumerate(replies))
    # chat messages: the reward model's chat template renders the prompt
    status, reply = call(server + "/score", {"messages": [[{"role": "user", "content": "Hi"},
                                                           {"role": "assistant", "content": "Hello"}]]})
    assert status == 200 and len(reply["scores"]) == 1


def test_openrlhf_get_reward_shape(server, rm):
    from dschat.rlhf.scoring import score_texts

    model, tok = rm
    queries = [p + a for p, a in zip(PROMPTS, ANSWERS, strict=True)]
    status, reply = call(server + "/get_reward", {"query": queries})
    assert status == 200 and reply["rewards"] == reply["scores"]
    expected, _ = score_texts(model, tok, queries, [""] * 4, [True] * 4, 512)
    assert reply["rewards"] == expected.tolist()
    status, split = call(server + "/get_reward", {"query": queries, "prompts": PROMPTS})
    assert status == 200 and split["rewards"] == score_texts(model, tok, PROMPTS, ANSWERS, [True] * 4, 512)[0].tolist()


@pytest.mark.parametrize("body, status, reason", [
    (b"{not json", 422, "not JSON"),
    ({"prompts": ["a"]}, 422, "send 'prompts' and 'completions'"),
    ({"prompts": ["a", "b"], "completions": ["x"]}, 422, "1 entries for 2 completions"),
    ({"prompts": ["a"], "completions": [3]}, 422, "list of strings"),
    ({"prompts": ["a"], "completions": ["x"], "ended": [1]}, 422, "booleans"),
    ({"prompts": ["a"], "completions": ["x"], "input_ids": [[1] * 600]}, 422, "at most 512"),
    ({"prompts": ["a"], "completions": ["x"], "input_ids": [[10 ** 9]]}, 422, "outside the vocabulary"),
    ({"prompts": ["a"] * 9, "completions": ["x"] * 9}, 413, "at most 8"),
    ({"prompts": ["a" * 5000], "completions": ["x"]}, 413, "at most 4000"),
])
def test_bad_requests_get_one_line(small_server, body, status, reason):
    raw = body if isinstance(body, bytes) else None
    got, reply = call(small_server + "/score", None if raw else body, raw=raw)
    assert got == status and reason in reply["error"] and "\n" not in reply["error"]


def test_token_required_and_never_logged(rm_dir, tmp_path, capsys):
    secret = "s3cr3t-token-value"
    (tmp_path / "token").write_text(secret + "\n")
    lines: list[str] = []
    with running(rm_app(rm_dir, log=lines.append, token_file=str(tmp_path / "token"))) as (base, _):
        assert call(base + "/health")[0] == 200  # probes need no token
        body = {"prompts": PROMPTS, "completions": ANSWERS}
        for token in (None, "wrong", secret[:-1]):
            status, reply = call(base + "/score", body, token=token)
            assert status == 401 and secret not in json.dumps(reply)
        assert call(base + "/info", token="wrong")[0] == 401
        assert call(base + "/score", body, token=secret)[0] == 200
    out = capsys.readouterr()
    assert secret not in out.out + out.err + "\n".join(lines)


def rule_service(fn, max_queue: int = 64, **limits):
    """A server of one user function, no model: cheap, for the queue and shutdown tests."""
    args = ServeArgs(max_queue=max_queue, **limits)
    return create_app(args, lambda: RewardService(["slow"], [], {"slow": fn}, None, None, args, {}))


def test_health_is_503_until_loaded_and_queue_bound_gives_429():
    loaded = threading.Event()

    def slow(prompts, completions, **_):
        time.sleep(0.2)
        return [float(len(c)) for c in completions]

    args = ServeArgs(max_queue=1)

    def load():
        loaded.wait(30)
        return RewardService(["slow"], [], {"slow": slow}, None, None, args, {})

    with running(create_app(args, load), wait_ready=False) as (base, _):
        assert call(base + "/health")[0] == 503 and call(base + "/score", {"prompts": [], "completions": []})[0] == 503
        loaded.set()
        deadline = time.time() + 30
        while call(base + "/health")[0] != 200 and time.time() < deadline:
            time.sleep(0.02)
        with ThreadPoolExecutor(12) as pool:
            replies = list(pool.map(lambda i: call(base + "/score", {"prompts": ["p"], "completions": ["x" * i]}),
                                    range(12)))
        codes = [s for s, _ in replies]
        assert codes.count(429) >= 1 and codes.count(200) >= 2 and set(codes) <= {200, 429}
        assert all(r == {"scores": [float(i)]} for i, (s, r) in enumerate(replies) if s == 200)
        assert call(base + "/health")[0] == 200  # still up


def test_graceful_shutdown_finishes_requests_in_flight():
    def slow(prompts, completions, **_):
        time.sleep(0.5)
        return [1.0] * len(completions)

    replies = []
    with running(rule_service(slow)) as (base, server):
        threads = [threading.Thread(target=lambda: replies.append(call(base + "/score", {"prompts": ["p"],
                                                                                        "completions": ["c"]})))
                   for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.2)
        server.should_exit = True  # as on SIGTERM
        for t in threads:
            t.join(30)
    assert replies == [(200, {"scores": [1.0]})] * 3


def test_serve_without_the_extra_is_one_line(tmp_path):
    """With fastapi hidden from the import system, `dschat serve` says what to install: exit 2, one line."""
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text("import sys\nsys.modules['fastapi'] = None\n")
    import os

    proc = run_cli("serve", "--reward-model", "x", env={"PYTHONPATH": f"{tmp_path}{os.pathsep}"
                                                                      f"{os.environ.get('PYTHONPATH', '')}"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert err == ["dschat: error: dschat serve needs fastapi: pip install -r requirements-serve.txt (or pip "
                   "install 'dschat[serve]')"]


def test_short_load(server):
    """A few seconds of the load test (benchmarks/serve_load.py): every request answered once, the right scores."""
    from benchmarks.serve_load import run_load

    report = run_load(server + "/score", clients=8, seconds=3.0, rows=4)
    assert report["errors"] == 0 and report["requests"] > 8 and report["mismatched"] == 0


def test_served_judge_equals_in_process():
    """--judge-model: the server calls the judge reward stage 3 loads (greedy), so the scores are its scores."""
    from dschat.rewards.judge import load_judge_reward
    from dschat.serving.server import create_app
    from dschat.serving.service import load_service
    from tests.dschat.serving_fixtures import serve_config

    cfg = serve_config(judge_model="tiny", judge_max_new_tokens=6)
    body = {"prompts": PROMPTS[:2], "completions": ANSWERS[:2], "answers": ["4", "Red."]}
    with running(create_app(cfg.serve, lambda: load_service(cfg, lambda _: None))) as (base, _):
        status, reply = call(base + "/score", body)
        assert status == 200 and call(base + "/info")[1]["sources"] == ["judge"]
    expected = load_judge_reward("tiny", 6)(PROMPTS[:2], ANSWERS[:2], answer=["4", "Red."])
    assert reply == {"scores": [float(x) for x in expected]}


@pytest.mark.slow
def test_dschat_serve_command_answers_and_stops_on_sigterm(rm_dir, tmp_path):
    """The command as a user runs it: ready on /health, scores, token checked and never printed, SIGTERM stops it
    after the requests it took."""
    import os
    import signal
    import subprocess
    import sys

    from tests.dschat.serving_fixtures import free_port
    from tests.helpers import ROOT

    secret = "cli-secret-0042"
    (tmp_path / "token").write_text(secret)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", "from dschat.cli.main import cli; cli()", "serve",
                             "--reward-model", str(rm_dir), "--port", str(port), "--token-file",
                             str(tmp_path / "token")], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            try:
                if call(base + "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.time() < deadline, "the server did not come up"
            time.sleep(0.3)
        assert call(base + "/score", {"prompts": PROMPTS, "completions": ANSWERS}, token="nope")[0] == 401
        status, reply = call(base + "/score", {"prompts": PROMPTS, "completions": ANSWERS}, token=secret)
        assert status == 200 and len(reply["scores"]) == 4
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    # uvicorn raises the signal again after its graceful shutdown: terminated by SIGTERM, after stopping cleanly
    assert proc.returncode in (0, -signal.SIGTERM), out[-2000:]
    assert "ready" in out and "stopped: 1 request(s) scored" in out and secret not in out


# ------------------------------------------------------------------------------------------------ hardening
# Every test below runs on 127.0.0.1 with a bounded number of connections and a deadline on every wait.

def test_no_docs_or_schema_even_with_a_token(rm_dir, tmp_path):
    (tmp_path / "token").write_text("tok-docs")
    with running(rm_app(rm_dir, token_file=str(tmp_path / "token"))) as (base, _):
        for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
            assert call(base + path)[0] == 404, path
            assert call(base + path, token="tok-docs")[0] == 404, path


def test_bearer_scheme_in_any_case(rm_dir, tmp_path):
    """RFC 9110: the auth scheme is case-insensitive; the token itself is compared exactly."""
    (tmp_path / "token").write_text("tok-CASE")
    body = {"prompts": PROMPTS[:1], "completions": ANSWERS[:1]}
    with running(rm_app(rm_dir, token_file=str(tmp_path / "token"))) as (base, _):
        for header in ("Bearer tok-CASE", "bearer tok-CASE", "BEARER tok-CASE", "bEaReR  tok-CASE"):
            assert call(base + "/score", body, authorization=header)[0] == 200, header
        for header in ("Bearer tok-case", "Basic tok-CASE", "tok-CASE", "Bearer", "Bearertok-CASE"):
            assert call(base + "/score", body, authorization=header)[0] == 401, header


@pytest.mark.parametrize("raw, reason", [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deep"),
    (b'{"prompts": ["a"], "completions": ["x"], "answers": [' + b"7" * 5000 + b"]}", "number"),
    (b'{"prompts": ["\\ud800 hi"], "completions": ["x"]}', "prompts[0]: a text holds a lone surrogate"),
    (b'{"messages": [[{"role": "user", "content": "a"}, {"role": "assistant", "content": "\\udfff"}]]}',
     "messages[0][1].content: a text holds a lone surrogate"),
    (b'{"prompts": ["a"], "completions": ["x"], "fields": {"w": [NaN]}}', "NaN"),
    (b'{"prompts": ["a"], "completions": ["x"], "answers": [-Infinity]}', "-Infinity"),
    (b'{"prompts": ["a"], "completions": ["x"], "fields": {"external": [1]}}', "may not set 'external'"),
    (b'{"prompts": ["a"], "completions": ["x"], "fields": {"prompts": [1]}}', "may not set 'prompts'"),
    (b'{"prompts": ["a"], "completions": ["x"], "fields": {"reached_eos": [false]}}', "may not set 'reached_eos'"),
    (b'\xff{}', "not UTF-8"),
])
def test_every_bad_body_is_a_one_line_422(server, capfd, raw, reason):
    """Bodies that parse (or nearly) but cannot be scored: a 422 in one line, never a 500 or a traceback (a 500
    would also make a client retry and call the server down)."""
    got, reply = call(server + "/score", raw=raw)
    assert got == 422 and reason in reply["error"] and "\n" not in reply["error"], reply
    assert call(server + "/get_reward", raw=b'{"query": ["\\ud800"]}')[0] == 422
    assert "Traceback" not in capfd.readouterr().err


def test_only_json_gets_in(server):
    """A web page can POST text/plain or a form without a preflight; only application/json is scored."""
    import http.client

    body = {"prompts": PROMPTS[:1], "completions": ANSWERS[:1]}
    for content_type in ("text/plain", None, "application/jsonx", "multipart/form-data; boundary=x"):
        got, reply = call(server + "/score", body, content_type=content_type)  # None: urllib's form type
        assert got == 415 and "application/json" in reply["error"], content_type
    assert call(server + "/score", body, content_type="Application/JSON; charset=utf-8")[0] == 200
    host, port = server.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.putrequest("POST", "/score")  # no Content-Type header at all
    conn.putheader("Content-Length", "2")
    conn.endheaders(b"{}")
    assert conn.getresponse().status == 415
    conn.close()


def test_a_model_that_fails_to_load_stops_the_server_and_health_names_no_path(tmp_path):
    from dschat.serving.server import uvicorn_server
    from tests.dschat.serving_fixtures import free_port

    missing = tmp_path / "secret-place" / "model"

    def load():
        raise FileNotFoundError(f"no model at {missing}")

    lines: list[str] = []
    app = create_app(ServeArgs(), load, log=lines.append)
    server = uvicorn_server(app, "127.0.0.1", free_port(), log_level="error")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()  # it stopped by itself
    assert app.state.dschat.error == f"FileNotFoundError: no model at {missing}"
    assert "secret-place" not in "\n".join(lines)
    # until it stops, /health says only that loading failed
    from starlette.testclient import TestClient

    with TestClient(create_app(ServeArgs(), load)) as client:  # no uvicorn: nothing stops it here
        deadline = time.time() + 10
        while (reply := client.get("/health")).json() == {"error": "loading"} and time.time() < deadline:
            time.sleep(0.02)
        assert (reply.status_code, reply.json()) == (503, {"error": "loading failed"})


def test_dschat_serve_with_a_model_that_fails_to_load_exits_with_one_line(tmp_path):
    from tests.dschat.serving_fixtures import free_port

    (tmp_path / "rm").mkdir()  # a folder without a model in it
    proc = run_cli("serve", "--reward-model", str(tmp_path / "rm"), "--port", str(free_port()), timeout=180)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and errors[0].startswith("dschat: error: dschat serve: loading the reward sources "
                                                     "failed: "), proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr


def test_slow_connections_are_closed_and_a_normal_client_is_answered():
    """24 connections that send half a request line and stop, against a server of at most 8 connections that
    gives a request 1 s for its line and headers: a normal client is answered at once, every slow connection is
    closed by the server within the deadline (evicted for a newer one, or timed out), and at most 8 are ever
    open."""
    import socket

    app = rule_service(lambda p, c, **_: [1.0] * len(c), max_connections=8, header_timeout=1.0)
    with running(app) as (base, _):
        port = int(base.rsplit(":", 1)[1])
        t0 = time.monotonic()
        slow = []
        for _ in range(24):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(b"POST /score HTT")
            slow.append(sock)
        assert call(base + "/score", {"prompts": ["p"], "completions": ["c"]}, timeout=5) == (200, {"scores": [1.0]})
        assert time.monotonic() - t0 < 3.0
        deadline = t0 + 4.0  # the header timeout, and slack for a loaded machine
        for sock in slow:
            data = b""
            try:
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                while chunk := sock.recv(4096):
                    data += chunk
            except ConnectionResetError:
                pass
            except TimeoutError:
                raise AssertionError("a half-sent request still holds its connection") from None
            finally:
                sock.close()
            assert data == b"" or data.startswith(b"HTTP/1.1 503"), data[:80]
        guard = app.state.dschat.guard
        assert guard.peak <= 8 and guard.evicted + guard.timed_out + guard.refused >= 24
        assert call(base + "/health", timeout=5)[0] == 200


def test_a_body_that_never_arrives_gets_408():
    import socket

    app = rule_service(lambda p, c, **_: [1.0] * len(c), body_timeout=1.0)
    with running(app) as (base, _):
        port = int(base.rsplit(":", 1)[1])
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"prompts\"")
            try:
                head = sock.recv(4096)
            except TimeoutError:
                raise AssertionError("no answer to a body that never arrives") from None
        assert head.startswith(b"HTTP/1.1 408") and b"--body-timeout" in head and time.monotonic() - t0 < 4.0


def test_rows_are_counted_before_they_are_rendered():
    """100,000 conversations: 413 before a single one is rendered by the tokenizer's template."""
    from tests.dschat.serving_fixtures import fake_rm_app

    app = fake_rm_app()
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with running(app) as (base, _):
        got, reply = call(base + "/score", {"messages": [conv] * 100_000}, timeout=30)
        assert got == 413 and "100000 conversations" in reply["error"] and "--max-request-rows" in reply["error"]
        assert app.state.fake.tokenizer.rendered == 0


def test_tokenising_runs_off_the_event_loop():
    """While a request's rows take 1.5 s to prepare, /health still answers at once."""
    from tests.dschat.serving_fixtures import fake_rm_app

    with running(fake_rm_app(rows_delay=1.5)) as (base, _):
        with ThreadPoolExecutor(1) as pool:
            slow = pool.submit(call, base + "/score", {"prompts": ["p"], "completions": ["c"], "input_ids": [[5, 6]]})
            time.sleep(0.3)  # the slow request is being prepared
            t0 = time.monotonic()
            assert call(base + "/health", timeout=10)[0] == 200
            waited = time.monotonic() - t0
            assert slow.result(30) == (200, {"scores": [11.0]})
        assert waited < 0.5, waited


def test_a_request_past_the_token_bound_is_refused_at_once():
    """1024 rows of 512 ids: within the row limit, but 524288 padded tokens, past --max-request-tokens."""
    from tests.dschat.serving_fixtures import fake_rm_app

    app = fake_rm_app(seconds_per_token=1e-4)  # it would hold the worker for 52 s
    body = {"prompts": ["p"] * 1024, "completions": ["c"] * 1024, "input_ids": [[7] * 512] * 1024}
    with running(app) as (base, _):
        t0 = time.monotonic()
        got, reply = call(base + "/score", body, timeout=20)
        assert got == 413 and "524288 padded tokens" in reply["error"] and "--max-request-tokens" in reply["error"]
        assert time.monotonic() - t0 < 10 and app.state.fake.forwards == []


def test_small_requests_are_interleaved_with_a_large_one():
    """A 64-row request takes 8 forwards of the 256-token budget (about 1 s here); a 1-row request posted during
    it is answered within a forward or two, long before the large one ends, and both get their exact scores."""
    from tests.dschat.serving_fixtures import fake_rm_app

    app = fake_rm_app(seconds_per_token=0.5 / 1024, max_batch_tokens=256)  # 0.125 s per full forward
    big = {"prompts": ["p"] * 64, "completions": ["c"] * 64, "input_ids": [[i + 2] * 20 for i in range(64)]}
    small = {"prompts": ["p"], "completions": ["c"], "input_ids": [[3, 4]]}
    done: dict[str, float] = {}

    def post(name, body):
        reply = call(base + "/score", body, timeout=30)
        done[name] = time.monotonic()
        return reply

    with running(app) as (base, _):
        with ThreadPoolExecutor(2) as pool:
            t0 = time.monotonic()
            large = pool.submit(post, "large", big)
            time.sleep(0.3)
            one = pool.submit(post, "small", small)
            assert one.result(30) == (200, {"scores": [7.0]})
            assert large.result(30) == (200, {"scores": [20.0 * (i + 2) for i in range(64)]})
    assert done["small"] < done["large"] and done["small"] - t0 < 0.3 + 0.6
    assert max(app.state.fake.forwards) == 256 // 32  # 20 ids pad to 32: 8 rows a forward, never more


def test_work_of_a_client_that_left_is_dropped():
    """A client gives up on a 128-row request (16 forwards, about 2 s) after 0.4 s: the server drops the rest of
    it, and the next request does not wait for it."""
    from tests.dschat.serving_fixtures import fake_rm_app

    app = fake_rm_app(seconds_per_token=0.5 / 1024, max_batch_tokens=256)
    big = {"prompts": ["p"] * 128, "completions": ["c"] * 128, "input_ids": [[9] * 20] * 128}
    with running(app) as (base, _):
        with pytest.raises(OSError):
            call(base + "/score", big, timeout=0.4)
        deadline = time.monotonic() + 5
        while call(base + "/info")[1]["dropped"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        t0 = time.monotonic()
        assert call(base + "/score", {"prompts": ["p"], "completions": ["c"], "input_ids": [[3]]}) == \
            (200, {"scores": [3.0]})
        assert time.monotonic() - t0 < 1.0
        info = call(base + "/info")[1]
    assert info["dropped"] == 1 and len(app.state.fake.forwards) < 16


def test_batcher_packs_small_jobs_beside_a_large_one_and_drops_cancelled_work():
    """Budget 100 tokens, rows of 10: a 30-row job goes 10 rows a forward alone; two 1-row jobs that arrive
    during its first forward share the second (20 tokens, at most half the budget) with 8 of its rows; then
    10, then the last 2. A cancelled waiting job is never scored; a cancelled large job loses its later chunks."""
    from dschat.serving.batcher import Batcher, ClientGone, Job

    gate, packs = threading.Event(), []

    def score(rows):
        gate.wait(10)
        packs.append([r[0] for r in rows])
        return torch.tensor([float(r[0]) for r in rows])

    batcher = Batcher(score, lambda job, s: s.tolist(), max_batch_tokens=100, max_queue=8)
    try:
        large = Job([[i] for i in range(30)], {}, [10] * 30)
        batcher.submit(large)
        deadline = time.time() + 10
        while batcher.queued() and time.time() < deadline:  # the worker has taken it (and waits at the gate)
            time.sleep(0.01)
        a, b, gone = Job([[100]], {}, [10]), Job([[101]], {}, [10]), Job([[102]], {}, [10])
        for job in (a, b, gone):
            batcher.submit(job)
        gone.cancel()
        gate.set()
        assert a.future.result(10) == [100.0] and b.future.result(10) == [101.0]
        assert large.future.result(10) == [float(i) for i in range(30)]
        with pytest.raises(ClientGone):
            gone.future.result(10)
        assert packs == [list(range(10)), [100, 101, *range(10, 18)], list(range(18, 28)), [28, 29]]
        assert batcher.dropped == 1 and batcher.jobs_done == 3

        # a large job cancelled after its first forward: no more of its rows are scored
        gate.clear()
        packs.clear()
        big = Job([[i] for i in range(50)], {}, [10] * 50)
        batcher.submit(big)
        while not big.done and time.time() < deadline + 10:
            if batcher.queued() == 0:
                big.cancel()
                gate.set()
            time.sleep(0.01)
        with pytest.raises(ClientGone):
            big.future.result(10)
        assert packs == [list(range(10))] and batcher.dropped == 2
    finally:
        gate.set()
        batcher.close()
