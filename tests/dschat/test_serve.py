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
