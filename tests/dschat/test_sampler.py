"""``dschat sampler``: a policy's copy in a process of its own (``dschat.generation.sampler``), fed weight updates
and batches of prompts over a link by a trainer (here the test process). Checked: its answers are the ones the
trainer's own copy samples with the same seed, their log-probs too, and they carry the version of the weights
that sampled them; a sampler killed mid-request fails the trainer's next read in one line within the timeout; a
trainer that is gone makes the sampler exit by itself, in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

from dschat import engine as E
from dschat.devices import forked_rng
from dschat.generation.backends import generate
from dschat.generation.decode import DschatBackend, GenerationConfig, Prompts
from dschat.generation.sampler import SamplerClient, SamplerLost
from dschat.generation.weight_link import take_snapshot
from dschat.utils import free_port
from tests.helpers import ROOT

TIMEOUT = 60


@pytest.fixture(scope="module")
def tiny() -> tuple[str, Any]:
    from dschat.models.loading import load_tokenizer, resolve_model

    path = resolve_model("tiny")
    return path, load_tokenizer(path)


def _start(path: str, port: int, timeout: float = TIMEOUT) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dschat.cli", "sampler", "--model", path, "--listen",
                             f"127.0.0.1:{port}", "--device", "cpu", "--generation-backend", "dschat", "--timeout",
                             str(timeout)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _prompts(tok: Any) -> Prompts:
    enc = tok(["\n\nHuman: where is my parcel?\n\nAssistant:", "\n\nHuman: hi\n\nAssistant:"], return_tensors="pt",
              padding=True, padding_side="left")
    return Prompts(enc.input_ids, enc.attention_mask, tok.eos_token_id, tok.pad_token_id)


def _local(model: Any, prompts: Prompts, settings: GenerationConfig, seed: int) -> Any:
    with forked_rng(seed), torch.no_grad():
        return generate(DschatBackend(), model, prompts, settings)


def test_the_sampler_answers_as_the_trainer_s_own_copy_would_and_its_death_fails_the_trainer_in_one_line(tiny):
    from dschat.models.loading import create_causal_lm

    path, tok = tiny
    port = free_port()
    proc = _start(path, port)
    try:
        link = E.Link("127.0.0.1", port, 0, 2, TIMEOUT, hosts=False)
        client = SamplerClient(link)
        model = create_causal_lm(path).eval()
        torch.manual_seed(3)
        with torch.no_grad():  # the trainer's policy moved away from the sampler's starting weights
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        settings = GenerationConfig(max_new_tokens=12, temperature=1.0, logprobs=True)
        prompts = _prompts(tok)
        pushed = client.push(take_snapshot(model), version=1)
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
        client.push(take_snapshot(model), version=2)
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
        assert time.monotonic() - t0 < TIMEOUT + 5
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
        SamplerClient(E.Link("127.0.0.1", port, 0, 2, TIMEOUT, hosts=False)).stop()
        assert proc.wait(TIMEOUT) == 0
    finally:
        proc.kill()


def test_a_sampler_whose_trainer_is_gone_exits_by_itself(tiny, tmp_path):
    path, _ = tiny
    port = free_port()
    proc = _start(path, port)  # a peer that vanishes is seen at once, not at the timeout
    trainer = subprocess.run([sys.executable, "-c", (
        "import os\nfrom dschat import engine as E\nfrom dschat.generation.sampler import SamplerClient\n"
        f"c = SamplerClient(E.Link('127.0.0.1', {port}, 0, 2, {TIMEOUT}, hosts=False))\nos._exit(9)\n")],
        cwd=ROOT, capture_output=True, text=True, timeout=3 * TIMEOUT)
    assert trainer.returncode == 9, trainer.stderr[-2000:]
    try:
        code = proc.wait(TIMEOUT)
    finally:
        proc.kill()
    err = proc.stderr.read() if proc.stderr else ""
    assert code == 2 and err.strip().splitlines()[-1].startswith("dschat: error: the trainer is gone: "), err[-2000:]
    assert "Traceback" not in err
