"""``dschat sampler``: a policy in a process of its own (``dschat.generation.sampler``), fed weight updates over the
weight plane and batches of prompts over its control channel by a trainer (here the test process). Checked: its
answers are the ones the trainer's own copy samples with the same seed, their log-probs too, and they carry the
version of the weights that sampled them; a sampler killed mid-request fails the trainer's next read in one line
within the timeout; a trainer that is gone makes the sampler exit by itself, in one line. Its channel: a peer
without the run's secret is refused on both sides and nothing it sent is used; the sampler listens at exactly the
address asked; every malformed message stops it in one line with exit code 2; a silent peer is given up within its
timeout."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

from dschat.devices import forked_rng
from dschat.errors import UserError
from dschat.generation.backends import generate
from dschat.generation.channel import MAGIC, connect
from dschat.generation.decode import DschatBackend, GenerationConfig, Prompts
from dschat.generation.sampler import SamplerLost, open_sampler
from dschat.generation.weight_plane import Sender, Update
from dschat.utils import free_port
from tests.helpers import ROOT

TIMEOUT = 60
SECRET = "t" * 40
RUN = {"dtype": "torch.float32", "max_staleness": 1, "max_model_len": 256, "lora": None,
       "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0}, "agent": None}


@pytest.fixture(scope="module")
def tiny() -> tuple[str, Any]:
    from dschat.models.loading import load_tokenizer, resolve_model

    path = resolve_model("tiny")
    return path, load_tokenizer(path)


def _start(path: str, port: int, timeout: float = TIMEOUT, secret: str = SECRET, host: str = "127.0.0.1",
           backend: str = "dschat") -> subprocess.Popen:
    env = {**os.environ, "DSCHAT_SAMPLER_TOKEN": secret}
    return subprocess.Popen([sys.executable, "-m", "dschat.cli", "sampler", "--model", path, "--listen",
                             f"{host}:{port}", "--device", "cpu", "--generation-backend", backend, "--timeout",
                             str(timeout)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


def _prompts(tok: Any) -> Prompts:
    enc = tok(["\n\nHuman: where is my parcel?\n\nAssistant:", "\n\nHuman: hi\n\nAssistant:"], return_tensors="pt",
              padding=True, padding_side="left")
    return Prompts(enc.input_ids, enc.attention_mask, tok.eos_token_id, tok.pad_token_id)


def _local(model: Any, prompts: Prompts, settings: GenerationConfig, seed: int) -> Any:
    with forked_rng(seed), torch.no_grad():
        return generate(DschatBackend(), model, prompts, settings)


def push(client: Any, model: Any, version: int) -> Any:
    """A weight update as stage 3 makes one: queued on the courier, then packed here."""
    if client.sender is None:
        client.sender = Sender(model, keeping=True, streaming=True)
        client.sender.group_device = client.group.device
    update = Update(version, client.sender.layout("full"), "torch.float32")
    future = client.push(update)
    client.sender.pack(update)
    return future


def _wait_listening(port: int, proc: subprocess.Popen) -> None:
    for _ in range(600):
        if proc.poll() is not None:
            raise AssertionError(proc.stderr.read() if proc.stderr else "exited")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)


def test_the_sampler_answers_as_the_trainer_s_own_copy_would_and_its_death_fails_the_trainer_in_one_line(tiny):
    from dschat.models.loading import create_causal_lm

    path, tok = tiny
    port = free_port()
    proc = _start(path, port)
    try:
        client = open_sampler("127.0.0.1", port, SECRET, RUN, TIMEOUT, proc)
        model = create_causal_lm(path).eval()
        torch.manual_seed(3)
        with torch.no_grad():  # the trainer's policy moved away from the sampler's starting weights
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        settings = GenerationConfig(max_new_tokens=12, temperature=1.0, logprobs=True)
        prompts = _prompts(tok)
        pushed = push(client, model, version=1)
        first = client.sample(prompts, settings, seed=5)  # in flight together: the courier sends them in order
        second = client.sample(prompts, settings, seed=6)
        assert pushed.result(TIMEOUT)["sync/bytes"] > 0
        first, second = first.result(TIMEOUT), second.result(TIMEOUT)
        want = _local(model, prompts, settings, 5)
        assert first.version == 1 and torch.equal(first.sequences, want.sequences) and not first.engine
        torch.testing.assert_close(first.logprobs, want.logprobs)  # the behaviour policy's, from the sampler
        assert torch.equal(second.sequences, _local(model, prompts, settings, 6).sequences)
        torch.manual_seed(11)  # the trainer's own RNG stream: the sampler draws from it and hands back where it ended
        state = torch.get_rng_state()
        with torch.no_grad():
            want = generate(DschatBackend(), model, prompts, settings)
        after = torch.get_rng_state()
        got = client.sample(prompts, settings, rng_state=state).result(TIMEOUT)
        assert torch.equal(got.sequences, want.sequences) and torch.equal(got.rng_state, after)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5)
        push(client, model, version=2)
        third = client.sample(prompts, settings, seed=5).result(TIMEOUT)
        assert third.version == 2 and torch.equal(third.sequences, _local(model, prompts, settings, 5).sequences)
        assert not torch.equal(third.sequences, first.sequences)
        p = _prompts(tok)  # then a request of seconds, and the sampler killed while it samples
        big = Prompts(p.ids.repeat(8, 1), p.mask.repeat(8, 1), p.eos_token_id, p.pad_token_id)
        pending = client.sample(big, GenerationConfig(max_new_tokens=300), seed=1)
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(SamplerLost) as caught:
            pending.result(TIMEOUT + 5)
        assert time.monotonic() - t0 < 10  # a peer gone is seen at once
        message = str(caught.value)  # killed before or after the courier sent the request
        assert message.startswith(("the sampler died or stopped answering: ",
                                   "the sampler is gone (sending a request)"))
        assert "\n" not in message
        with pytest.raises(SamplerLost):  # and every exchange after it
            client.sample(prompts, settings, seed=1).result(TIMEOUT)
    finally:
        proc.kill()


def test_a_sampler_told_to_stop_exits_0(tiny):
    path, _ = tiny
    port = free_port()
    proc = _start(path, port)
    try:
        open_sampler("127.0.0.1", port, SECRET, RUN, TIMEOUT, proc).stop()
        assert proc.wait(TIMEOUT) == 0
    finally:
        proc.kill()


def _last_line(proc: subprocess.Popen, wait: float = TIMEOUT) -> tuple[int, str]:
    code = proc.wait(wait)
    err = proc.stderr.read() if proc.stderr else ""
    assert "Traceback" not in err, err[-3000:]
    return code, err.strip().splitlines()[-1]


def test_a_sampler_whose_trainer_is_gone_exits_by_itself(tiny):
    path, _ = tiny
    port = free_port()
    proc = _start(path, port)  # a peer that vanishes is seen at once, not at the timeout
    trainer = subprocess.run([sys.executable, "-c", (
        "import os\nfrom dschat.generation.sampler import open_sampler\n"
        f"c = open_sampler('127.0.0.1', {port}, {SECRET!r}, {RUN!r}, {TIMEOUT})\nos._exit(9)\n")],
        cwd=ROOT, capture_output=True, text=True, timeout=3 * TIMEOUT)
    assert trainer.returncode == 9, trainer.stderr[-2000:]
    try:
        code, last = _last_line(proc)
    finally:
        proc.kill()
    assert code == 2 and last.startswith("dschat: error: the trainer is gone: "), last


# ------------------------------------------------------------------------------------------- the channel
def test_a_peer_without_the_secret_is_refused_on_both_sides_and_the_real_trainer_then_served(tiny):
    path, _ = tiny
    port = free_port()
    proc = _start(path, port)
    try:
        with pytest.raises(UserError) as caught:  # an impostor trainer: refused, the sampler waits on
            open_sampler("127.0.0.1", port, "x" * 40, RUN, TIMEOUT, proc)
        assert "refused this side's secret" in str(caught.value) and "\n" not in str(caught.value)
        client = open_sampler("127.0.0.1", port, SECRET, RUN, TIMEOUT, proc)  # the run's own trainer
        client.stop()
        code, _ = _last_line(proc)
        assert code == 0
    finally:
        proc.kill()
    # a listener without the secret where the trainer expects its sampler: the trainer refuses it, in one line
    from dschat.generation.channel import accept, listen

    impostor = listen("127.0.0.1", 0)
    import threading

    seen: list[str] = []
    threading.Thread(target=lambda: _accept_quietly(accept, impostor, seen), daemon=True).start()
    with pytest.raises(UserError) as caught:
        open_sampler("127.0.0.1", impostor.getsockname()[1], SECRET, RUN, TIMEOUT)
    assert "it is not this run's sampler" in str(caught.value) and "\n" not in str(caught.value)
    impostor.close()


def _accept_quietly(accept: Any, listener: Any, seen: list[str]) -> None:
    try:
        accept(listener, "i" * 40, 10, seen.append)
    except Exception:  # noqa: BLE001 - the impostor's own fate is not under test
        pass


def test_the_sampler_listens_at_exactly_the_address_asked(tiny):
    path, _ = tiny
    port = free_port()
    proc = _start(path, port)
    try:
        _wait_listening(port, proc)
        listening = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True).stdout
        local = [line.split()[3] for line in listening.splitlines() if line.strip()]  # the local address column
        assert local == [f"127.0.0.1:{port}"], listening
    finally:
        proc.kill()


def _send_raw(port: int, frame: bytes) -> None:
    """Prove the secret, then send ``frame`` as is."""
    ch = connect("127.0.0.1", port, SECRET, TIMEOUT)
    ch.sock.sendall(frame)
    time.sleep(0.5)
    ch.close()


def _frame(obj: Any, raw: bytes | None = None) -> bytes:
    head = raw if raw is not None else json.dumps(obj).encode()
    return MAGIC + struct.pack(">I", len(head)) + head


BAD_FRAMES = {
    "a claimed length of 2^32 - 1": MAGIC + struct.pack(">I", 2**32 - 1),
    "not a dschat frame": b"GET / HTTP/1.1\r\n\r\n",
    "not JSON": _frame(None, b"{not json"),
    "not UTF-8": _frame(None, b'{"m": "\xff\xfe"}'),
    "nested 200k deep": _frame(None, b"[" * 200_000 + b"]" * 200_000),
    "a NaN temperature": _frame(None, b'{"m": {"op": "hello", "run": {}}, "t": [["float32", [1]]], "x": NaN}'),
    "a negative tensor size": _frame({"m": {"op": "ping"}, "t": [["float32", [-4]]]}),
    "an unknown op": _frame({"m": {"op": "format_disk"}, "t": []}),
    "sampling before hello": _frame({"m": {"op": "sample"}, "t": []}),
    "a hello without its run": _frame({"m": {"op": "hello"}, "t": []}),
    "a list for a dtype": _frame({"m": {"op": "ping"}, "t": [[["float32"], [1]]]}),
    "weights before the group": _frame({"m": {"op": "weights", "version": 1, "layout": {}}, "t": []}),
}


@pytest.mark.parametrize("case", sorted(BAD_FRAMES))
def test_a_malformed_message_stops_the_sampler_in_one_line_with_exit_code_2(tiny, case):
    path, _ = tiny
    port = free_port()
    proc = _start(path, port, timeout=20)
    try:
        _wait_listening(port, proc)
        _send_raw(port, BAD_FRAMES[case])
        code, last = _last_line(proc, 30)
    finally:
        proc.kill()
    assert code == 2 and last.startswith("dschat: error: "), (case, last)


def test_a_silent_listener_is_given_up_within_the_timeout(tiny):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)  # takes the connection, never says a word
    t0 = time.monotonic()
    with pytest.raises(UserError) as caught:
        open_sampler("127.0.0.1", silent.getsockname()[1], SECRET, RUN, 5)
    assert time.monotonic() - t0 < 5 + 5 and "\n" not in str(caught.value)
    silent.close()


def test_the_sampler_s_own_failures_are_one_line_each(tiny):
    path, _ = tiny
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    proc = _start(path, port)  # a port in use
    try:
        code, last = _last_line(proc)
    finally:
        proc.kill()
        taken.close()
    assert code == 2 and last.startswith(f"dschat: error: cannot listen at 127.0.0.1:{port}"), last
    t0 = time.monotonic()
    proc = _start(path, free_port(), timeout=3)  # no trainer comes
    try:
        code, last = _last_line(proc)
    finally:
        proc.kill()
    assert code == 2 and last.startswith("dschat: error: no trainer connected to 127.0.0.1:") and \
        "within --timeout 3 s" in last, last
    assert time.monotonic() - t0 < 60
    env = {k: v for k, v in os.environ.items() if k != "DSCHAT_SAMPLER_TOKEN"}
    proc = subprocess.run([sys.executable, "-m", "dschat.cli", "sampler", "--model", path, "--listen",
                           f"127.0.0.1:{free_port()}"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and "DSCHAT_SAMPLER_TOKEN" in proc.stderr.strip().splitlines()[-1]


def test_a_sampler_whose_trainer_died_before_connecting_goes_within_seconds(tmp_path):
    # the trainer starts its sampler and is killed before it connects: the kernel tells the sampler (Linux), which
    # does not wait out its --timeout (600 s by default)
    if not sys.platform.startswith("linux"):
        pytest.skip("the parent-death signal is Linux's")
    script = ("import sys\nfrom dschat.config import build_config\nfrom dschat.rlhf.config import RLHFConfig\n"
              "from dschat.rlhf.async_rollouts import sampler_launch, start_sampler\n"
              "cfg = build_config(RLHFConfig, {'algo': 'grpo', 'actor_model': 'tiny', 'async_rollouts': True})\n"
              f"cmd, env = sampler_launch(cfg, {free_port()}, 'cpu', [], 'fp32', 'x' * 40)\n"
              "p = start_sampler(cmd, env, [])\nprint('sampler', p.pid, flush=True)\nimport os\nos._exit(9)\n")
    trainer = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    pid = int(trainer.stdout.split("sampler ")[-1].split()[0])
    t0 = time.monotonic()
    while time.monotonic() - t0 < 30:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split(")")[-1].split()[0] == "Z":
                break
        time.sleep(0.2)
    else:
        os.kill(pid, signal.SIGKILL)
        raise AssertionError("the orphaned sampler lived on")


def test_a_sampler_gone_while_the_weight_group_forms_ends_the_trainer_s_wait_at_once():
    import threading

    from dschat.generation.channel import accept, listen

    sock = listen("127.0.0.1", 0)

    def sampler_that_dies_on_join() -> None:
        ch = accept(sock, SECRET, 30, print)
        ch.recv()  # hello
        ch.send({"ok": True, "message": "", "identities": [""], "backend": "dschat"})
        ch.recv()  # join: and gone before it joins
        ch.close()

    threading.Thread(target=sampler_that_dies_on_join, daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(UserError) as caught:
        open_sampler("127.0.0.1", sock.getsockname()[1], SECRET, RUN, 60)
    assert time.monotonic() - t0 < 10  # not the 60 s of the weight group's rendezvous
    assert "closed the connection while joining the weight group" in str(caught.value)
