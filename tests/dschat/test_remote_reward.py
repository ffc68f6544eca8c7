"""The remote reward source (--reward-funcs http://...): the client against small fault servers (slow, malformed
JSON, wrong counts, NaN, 4xx, 5xx, down), its token handling, and end to end: GRPO scored by a dschat server
equals GRPO with the reward model in-process, and a run whose server dies stops with a state that resumes to the
same result."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from dschat.errors import UserError
from dschat.rewards.functions import RewardMixer, get_reward_func
from dschat.rewards.remote import RemoteReward, RemoteSettings, RewardServerDown, read_token, remote_reward
from tests.dschat.serving_fixtures import free_port

Reply = tuple[int, bytes]


@contextmanager
def stub(reply: Callable[[dict[str, Any], dict[str, str]], Reply | None], port: int | None = None) -> Iterator[Any]:
    """An http.server on 127.0.0.1 whose POST answer is ``reply(body, headers)`` (None: the connection is closed
    without one); yields it, with ``.seen`` (the bodies and headers received) and ``.url``."""
    seen: list[tuple[dict[str, Any], dict[str, str]]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            headers = dict(self.headers.items())
            seen.append((body, headers))
            answer = reply(body, headers)
            if answer is None:
                self.close_connection = True
                return
            status, raw = answer
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:  # noqa: N802
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port or free_port()), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    server.seen = seen
    server.url = f"http://127.0.0.1:{server.server_address[1]}/score"
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def ok(body: dict[str, Any], headers: dict[str, str]) -> Reply:
    return 200, json.dumps({"scores": [float(len(c)) for c in body["completions"]]}).encode()


def client(url: str, **kw: Any) -> RemoteReward:
    sleeps: list[float] = []
    r = RemoteReward(url, RemoteSettings(**{"timeout": 5.0, "retries": 3, "backoff": 0.5, **kw}), sleep=sleeps.append)
    r.sleeps = sleeps  # type: ignore[attr-defined]
    return r


def test_batched_requests_and_chunks():
    with stub(ok) as s:
        fn = client(s.url, request_rows=3)
        assert fn(["p"] * 7, ["a", "bb", "ccc", "d", "ee", "f", "gg"], reached_eos=[True] * 7) == \
            [1.0, 2.0, 3.0, 1.0, 2.0, 1.0, 2.0]
        assert [len(b["completions"]) for b, _ in s.seen] == [3, 3, 1]
        assert s.seen[0][0]["ended"] == [True] * 3 and "input_ids" not in s.seen[0][0]
        one = client(s.url)
        one(["p"] * 7, ["x"] * 7)
        assert len(s.seen) == 4  # one request per scoring batch by default


@pytest.mark.parametrize("reply, message", [
    (lambda b, h: (200, b"{not json"), "not JSON"),
    (lambda b, h: (200, json.dumps({"scores": [1.0]}).encode()), "1 scores for 2 completions"),
    (lambda b, h: (200, b'{"scores": [1.0, NaN]}'), "not a finite number"),
    (lambda b, h: (200, json.dumps({"scores": [1.0, "x"]}).encode()), "not a finite number"),
    (lambda b, h: (200, json.dumps({"result": []}).encode()), "no list 'scores'"),
    (lambda b, h: (413, json.dumps({"error": "body too large"}).encode()), "HTTP 413: body too large"),
    (lambda b, h: (422, json.dumps({"error": "'ended' must be a list of 2 booleans"}).encode()), "HTTP 422"),
])
def test_bad_replies_are_one_line_and_not_retried(reply, message):
    with stub(reply) as s:
        fn = client(s.url)
        with pytest.raises(UserError, match=message) as e:
            fn(["p", "q"], ["a", "b"])
        assert "\n" not in str(e.value) and not isinstance(e.value, RewardServerDown)
        assert len(s.seen) == 1  # a 4xx or a bad body is not retried


def test_5xx_and_429_are_retried_with_backoff():
    answers = iter([(503, b"{}"), (429, b'{"error": "queue full"}'), (500, b"oops")])

    def flaky(body: dict[str, Any], headers: dict[str, str]) -> Reply:
        return next(answers, None) or ok(body, headers)

    with stub(flaky) as s:
        fn = client(s.url)
        assert fn(["p"], ["abc"]) == [3.0]
        assert len(s.seen) == 4 and fn.sleeps == [0.5, 1.0, 2.0]


def test_a_connection_dropped_mid_request_is_retried():
    dropped: list[int] = []

    def drop_first(body: dict[str, Any], headers: dict[str, str]) -> Reply | None:
        if not dropped:
            dropped.append(1)
            return None  # the handler closes the connection without an answer, as a killed server does
        return ok(body, headers)

    with stub(drop_first) as s:
        fn = client(s.url)
        assert fn(["p"], ["abcd"]) == [4.0] and len(s.seen) == 2 and fn.sleeps == [0.5]


def test_server_down_opens_the_circuit():
    url = f"http://127.0.0.1:{free_port()}/score"  # nothing listens there
    fn = client(url, retries=2)
    with pytest.raises(RewardServerDown, match="failed 3 time") as e:
        fn(["p"], ["a"])
    assert "\n" not in str(e.value) and fn.sleeps == [0.5, 1.0] and e.value.exit_code == 4
    with pytest.raises(RewardServerDown, match="is down"):  # open: fails at once, no more retries
        fn(["p"], ["a"])
    assert fn.sleeps == [0.5, 1.0]


def test_slow_server_times_out_then_is_down():
    def slow(body: dict[str, Any], headers: dict[str, str]) -> Reply:
        time.sleep(1.0)
        return ok(body, headers)

    with stub(slow) as s:
        fn = client(s.url, timeout=0.2, retries=1)
        t0 = time.time()
        with pytest.raises(RewardServerDown, match="timed out|Timeout"):
            fn(["p"], ["a"])
        assert time.time() - t0 < 1.5 and len(s.seen) == 2


def test_token_from_file_or_env_sent_and_never_shown(tmp_path, monkeypatch):
    secret = "tok-9f8e7d"
    (tmp_path / "t").write_text(f"{secret}\n")
    monkeypatch.delenv("DSCHAT_REWARD_TOKEN", raising=False)
    assert read_token("") is None
    monkeypatch.setenv("DSCHAT_REWARD_TOKEN", "from-env")
    assert read_token("") == "from-env" and read_token(str(tmp_path / "t")) == secret
    with pytest.raises(UserError, match="cannot read"):
        read_token(str(tmp_path / "missing"))

    def auth(body: dict[str, Any], headers: dict[str, str]) -> Reply:
        if headers.get("Authorization") != f"Bearer {secret}":
            return 401, json.dumps({"error": "missing or wrong bearer token"}).encode()
        return ok(body, headers)

    with stub(auth) as s:
        fn = remote_reward(s.url, token_file=str(tmp_path / "t"))
        assert fn(["p"], ["ab"]) == [2.0] and secret not in repr(fn)
        monkeypatch.setenv("DSCHAT_REWARD_TOKEN", "wrong")
        with pytest.raises(UserError, match="HTTP 401: missing or wrong bearer token") as e:
            remote_reward(s.url)(["p"], ["ab"])
        assert secret not in str(e.value) and "wrong" not in str(e.value).replace("wrong bearer", "")


def test_a_token_with_a_trailing_cr_works_and_a_bad_one_is_never_shown(tmp_path, monkeypatch):
    """$(cat file) of a CRLF file ends the token in '\\r': stripped, as the token file's is. A token with a line
    break inside: one line naming where it came from, never the token."""
    secret = "s3cr3t-tok-5150"
    seen: list[str] = []

    def auth(body: dict[str, Any], headers: dict[str, str]) -> Reply:
        seen.append(headers.get("Authorization", ""))
        return ok(body, headers)

    with stub(auth) as s:
        monkeypatch.setenv("DSCHAT_REWARD_TOKEN", secret + "\r")
        assert remote_reward(s.url)(["p"], ["ab"]) == [2.0] and seen == [f"Bearer {secret}"]
        for bad in (f"{secret}\nX-Injected: 1", f"s3cr3t\r\n{secret}", f"{secret}\x7f", f"{secret}\u2019"):
            monkeypatch.setenv("DSCHAT_REWARD_TOKEN", bad)
            with pytest.raises(UserError) as e:
                remote_reward(s.url)(["p"], ["ab"])
            message = str(e.value)
            assert "DSCHAT_REWARD_TOKEN" in message and "\n" not in message and "s3cr3t" not in message, message
            # set directly (not through the environment or a file): refused alike, and never sent
            with pytest.raises(UserError) as e:
                RemoteReward(s.url, RemoteSettings(token=bad))
            assert "s3cr3t" not in str(e.value)
        (tmp_path / "t").write_text(f"{secret}\tmore\n")  # a control character inside the file's first line
        with pytest.raises(UserError) as e:
            remote_reward(s.url, token_file=str(tmp_path / "t"))
        assert "--reward-token-file" in str(e.value) and "s3cr3t" not in str(e.value)
        assert len(seen) == 1


@pytest.mark.parametrize("url, why", [
    ("http://127.0.0.1:99999/score", "Port out of range"),
    ("http://127.0.0.1:abc/score", "abc"),
    ("http://[::1/score", "Invalid IPv6 URL"),
    ("http://[fe80::zz]:8000/score", "not a valid address"),
    ("http:///score", "names no host"),
    ("http://127.0.0.1:0/score", "port 0"),
    ("http://127.0.0.1:8000/sc ore", "space"),
])
def test_a_malformed_server_address_is_refused_with_the_other_flags(url, why):
    """Checked where stage 3, dschat generate and dschat eval check their reward sources, before any model
    loads: one line naming the address."""
    from dschat.rlhf.config import RewardArgs, check_reward_models

    with pytest.raises(UserError) as e:
        check_reward_models(["format", url], RewardArgs())
    assert why in str(e.value) and url in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError, match="not a valid address|names no host|port 0|space"):
        RemoteReward(url)


def test_a_malformed_server_address_stops_the_run_before_anything_loads():
    from tests.helpers import run_cli

    proc = run_cli("train", "--step", "3", "--algo", "grpo", "--actor-model", "tiny", "--reward-funcs",
                   "http://127.0.0.1:99999/score", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert [ln for ln in proc.stderr.splitlines() if "error" in ln] == [
        "dschat: error: reward server 'http://127.0.0.1:99999/score': not a valid address (Port out of range "
        "0-65535)"]
    assert "Traceback" not in proc.stderr


def test_a_url_is_a_reward_source_weighted_like_any_other():
    with stub(ok) as s:
        assert isinstance(get_reward_func(s.url), RemoteReward)
        mixer = RewardMixer(["format", s.url], [1.0, 0.5])
        mixed = mixer(["p", "q"], ["abcd", "ab"], answer=[None, None])
        assert mixed.total.tolist() == [2.0, 1.0] and mixed.per_func[s.url].tolist() == [4.0, 2.0]
    with pytest.raises(UserError, match="must start with http"):
        RemoteReward("ftp://x")


def test_remote_flags_are_refused_without_a_remote_source():
    from dschat.config import build_config, refuse_inert
    from dschat.rlhf.config import RLHFConfig

    cfg = build_config(RLHFConfig, {"algo": "grpo", "actor_model": "tiny", "reward_funcs": ["format"],
                                    "reward_timeout": 5.0})
    with pytest.raises(UserError, match="--reward-timeout has no effect without a remote reward source"):
        refuse_inert(cfg, {"reward_funcs", "reward_timeout"})


def test_eval_refuses_remote_flags_without_a_remote_source():
    from tests.helpers import run_cli

    proc = run_cli("eval", "--step", "3", "--model", "tiny", "--reward-funcs", "format", "--reward-retries", "2")
    assert proc.returncode == 2
    assert "--reward-retries has no effect without a remote reward source" in proc.stderr


# ------------------------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    from tests.dschat.serving_fixtures import save_tiny_reward_model

    return save_tiny_reward_model(tmp_path_factory.mktemp("remote") / "rm")


def grpo(out, reward_funcs, rm_dir=None, **kw):
    from dschat.config import build_config
    from dschat.demo import demo_files
    from dschat.rlhf.config import RLHFConfig

    base = {"algo": "grpo", "actor_model": "tiny", "data": [str(demo_files()["prompts"])], "output_dir": str(out),
            "max_steps": 3, "max_answer_seq_len": 12, "num_generations": 2, "per_device_generation_batch_size": 2,
            "per_device_training_batch_size": 2, "max_eval_rows": 4, "per_device_eval_batch_size": 4,
            "reward_funcs": reward_funcs, "progress": False, "force": True, "seed": 7}
    if rm_dir is not None:
        base["reward_model"] = str(rm_dir)
    base.update(kw)
    return build_config(RLHFConfig, base)


FIGURES = ("reward_before", "reward_after", "reward_before_se", "reward_after_se", "reward_gain", "reward_gain_se",
           "kl_before", "kl_after", "steps")


@pytest.mark.slow
def test_grpo_remote_equals_in_process_and_resumes_after_the_server_dies(rm_dir, tmp_path):
    from tests.dschat.serving_fixtures import needs_serve_extra, rm_app, running
    from tests.helpers import read_json, read_jsonl
    from tests.helpers import run_stage as run

    needs_serve_extra()
    run(grpo(tmp_path / "local", ["rm"], rm_dir))
    local = read_json(tmp_path / "local" / "eval.json")

    port = free_port()
    url = f"http://127.0.0.1:{port}/score"
    secret = "grpo-secret-token"
    (tmp_path / "token").write_text(secret)
    flags = {"reward_token_file": str(tmp_path / "token"), "reward_backoff": 0.05, "reward_retries": 2}
    served: list[int] = []
    lines: list[str] = []

    def app(stop_after: int | None = None) -> Any:
        a = rm_app(rm_dir, log=lines.append, token_file=str(tmp_path / "token"))
        if stop_after is not None:  # the server goes away after answering this many /score requests
            @a.middleware("http")
            async def count(request: Any, call_next: Any) -> Any:
                response = await call_next(request)
                if request.url.path == "/score":
                    served.append(1)
                    if len(served) >= stop_after:
                        a.state.server.should_exit = True
                return response
        return a

    # 1. uninterrupted, scored by the server: the same figures as in-process
    with running(app(), port):
        run(grpo(tmp_path / "remote", [url], **flags))
    remote = read_json(tmp_path / "remote" / "eval.json")
    assert {k: remote[k] for k in FIGURES} == {k: local[k] for k in FIGURES}
    rows = lambda out: [{k: v for k, v in r.items() if k.startswith("train/reward") and "/score" not in k  # noqa: E731
                         and k != "train/reward/rm"} for r in read_jsonl(out / "metrics.jsonl") if "train/reward" in r]
    assert rows(tmp_path / "remote") == rows(tmp_path / "local")

    # 2. the server dies during step 2 (eval before and step 1 answered): retries, then a state of step 1
    a = app(stop_after=2)
    with running(a, port) as (_, server):
        a.state.server = server
        with pytest.raises(RewardServerDown, match="the state of step 1 is .*continue with --resume") as e:
            run(grpo(tmp_path / "killed", [url], **flags))
    assert "\n" not in str(e.value)
    # 3. back up: the run resumes from that state and ends as the uninterrupted one
    with running(app(), port):
        run(grpo(tmp_path / "killed", [url], resume=True, force=False, **flags))
    resumed = read_json(tmp_path / "killed" / "eval.json")
    assert {k: resumed[k] for k in FIGURES} == {k: remote[k] for k in FIGURES}
    # the token is in no file the runs wrote, nor in the server's log
    for out in ("remote", "killed"):
        for path in (tmp_path / out).rglob("*"):
            if path.is_file() and path.stat().st_size < 5_000_000:
                assert secret.encode() not in path.read_bytes(), path
    assert secret not in "\n".join(lines)


# ------------------------------------------------------------------------------------------------ hardening
class _Raw(BaseHTTPRequestHandler):
    """A handler whose answer to any request is ``self.server.answer(handler)`` (writes to ``wfile`` itself)."""

    def _any(self) -> None:
        self.server.seen.append((self.command, self.path, dict(self.headers.items())))  # type: ignore[attr-defined]
        if self.command == "POST":
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            self.server.answer(self)  # type: ignore[attr-defined]
        except OSError:  # the client gave up
            pass

    do_GET = do_POST = _any  # noqa: N815 - http.server's names

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def raw_server(answer: Callable[[BaseHTTPRequestHandler], None]) -> Iterator[Any]:
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), _Raw)
    server.daemon_threads = True
    server.answer, server.seen = answer, []
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def redirect_to(target: str) -> Callable[[BaseHTTPRequestHandler], None]:
    def answer(h: BaseHTTPRequestHandler) -> None:
        h.send_response(302)
        h.send_header("Location", target + h.path)
        h.send_header("Content-Length", "0")
        h.end_headers()
    return answer


def test_a_redirect_is_refused_and_the_token_never_reaches_the_other_host():
    """A server answering 302 (POST /score, and GET /info that the client asks for the tokenizer): the client
    stops with one line, at once (no retry), and the host redirected to receives nothing, least of all the
    token."""
    from types import SimpleNamespace

    secret = "tok-stays-home"
    with raw_server(lambda h: ok_answer(h)) as elsewhere, raw_server(redirect_to(elsewhere.url)) as s:
        fn = client(s.url + "/score", token=secret)
        with pytest.raises(UserError, match="answered HTTP 302 .*redirects are not followed") as e:
            fn(["p"], ["a"])
        assert "\n" not in str(e.value) and secret not in str(e.value) and not isinstance(e.value, RewardServerDown)
        # token ids are sent only when /info's tokenizer matches: that GET is redirected too
        ids = client(s.url + "/score", token=secret)
        ids.bind_tokenizer(SimpleNamespace(get_vocab=lambda: {"a": 0}, eos_token_id=0))
        with pytest.raises(UserError, match="answered HTTP 302"):
            ids(["p"], ["a"], token_ids=[[0]])
        assert [(m, p) for m, p, _ in s.seen] == [("POST", "/score"), ("GET", "/info")]
        assert all(h.get("Authorization") == f"Bearer {secret}" for _, _, h in s.seen)
        assert elsewhere.seen == [] and fn.sleeps == [] and ids.sleeps == []


def ok_answer(h: BaseHTTPRequestHandler) -> None:
    raw = b'{"scores": [1.0]}'
    h.send_response(200)
    h.send_header("Content-Length", str(len(raw)))
    h.end_headers()
    h.wfile.write(raw)


def test_the_timeout_bounds_the_whole_request_not_each_read():
    """A reply dripped one byte every 0.2 s (headers included) never ends within a 1 s timeout: the request fails
    at 1 s (each read alone would have been well inside it), then once more on its retry."""
    reply = b'HTTP/1.0 200 OK\r\nContent-Length: 17\r\n\r\n{"scores": [1.0]}'

    def drip(h: BaseHTTPRequestHandler) -> None:
        for byte in reply:
            h.wfile.write(bytes([byte]))
            h.wfile.flush()
            time.sleep(0.2)

    with raw_server(drip) as s:
        fn = client(s.url + "/score", timeout=1.0, retries=1)
        t0 = time.monotonic()
        with pytest.raises(RewardServerDown, match=r"timed out: no whole reply within 1 s \(--reward-timeout\)"):
            fn(["p"], ["a"])
        took = time.monotonic() - t0
    assert 2.0 <= took < 3.5 and len(s.seen) == 2, took


def test_a_score_past_floats_range_is_not_finite_and_not_asked_again_row_by_row():
    """10**400 as a JSON integer: "not a finite number", one request (the mixer must not re-ask the server row by
    row, as it does to locate a row that makes a user function raise)."""
    huge = b"1" + b"0" * 400

    with stub(lambda b, h: (200, b'{"scores": [' + huge + b", " + huge + b"]}")) as s:
        mixer = RewardMixer([s.url], [1.0])
        with pytest.raises(UserError, match="a score is not a finite number") as e:
            mixer(["p", "q"], ["a", "b"])
        assert "raised" not in str(e.value) and len(s.seen) == 1
    with stub(lambda b, h: (200, b'{"scores": [' + b"7" * 5000 + b"]}")) as s:  # past int()'s digit limit
        with pytest.raises(UserError, match="not JSON"):
            RewardMixer([s.url], [1.0])(["p"], ["a"])
        assert len(s.seen) == 1
