"""The weight plane (``dschat.generation.weight_plane``) between two processes: a trainer packs its policy into
reused staging buffers and broadcasts it on a weight group of its own (gloo here), a receiver loads each bucket into
its own module and checks the update (checksums, the probe) before answering its verdict over the control channel
(``dschat.generation.channel``, authenticated by a shared secret).

Checked: the copy equals the trainer's (tied weights too) and carries the version; the staging buffers are made
once and reused; a bucket damaged on the way, or weights that do not give the trainer's log-probs, stop both sides
with one line; a bf16 trainer's update into an fp32 copy is checked at half precision's tolerance; a LoRA model
sends its base once and then its adapters alone (under a tenth of the bytes), and the receiver's merged weights
give the merged model's answers; a receiver that dies in the middle of an update fails the sender within the
timeout, in one line. And by hand: the checksum's figures, the layout from metadata alone, a malformed layout."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from dschat.generation import weight_plane as W
from dschat.utils import free_port

SMALL = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
SECRET = "s" * 32
TIMEOUT = 60.0


def _model(seed: int, lora: bool = False) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**SMALL)).eval()
    if lora:
        from dschat.config import LoraArgs
        from dschat.models.lora import apply_lora

        apply_lora(model, LoraArgs(lora_dim=8, lora_alpha=16.0))
        torch.manual_seed(seed + 100)
        with torch.no_grad():  # adapters that change the model (PEFT starts B at zero)
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(0, 0.2)
    return model


CASES = ("ok", "again", "damaged", "off_probe", "bf16_trainer", "lora_full", "lora_adapter")


def _pair(rank: int, port: int, out: str) -> tuple[Any, Any]:
    """The control channel and the weight group of this side (rank 0 the trainer)."""
    from dschat import engine as E
    from dschat.generation import channel as C

    if rank == 0:
        ch = C.connect("127.0.0.1", port, SECRET, TIMEOUT)
        store = E.WeightStore("127.0.0.1", TIMEOUT)
        ch.send({"store": [store.host, store.port]})
        group = E.WeightGroup(store.store, "p", 0, 2, TIMEOUT)
        group.keep = store
        return ch, group
    listener = C.listen("127.0.0.1", port)
    ch = C.accept(listener, SECRET, TIMEOUT, print)
    host, store_port = ch.recv()[0]["store"]
    return ch, W.join_group({"store": [host, store_port], "prefix": "p", "rank": 1, "size": 2, "nccl": False,
                             "timeout": TIMEOUT}, 0)


def send(sender: W.Sender, ch: Any, group: Any, version: int, kind: str = "full") -> dict[str, float]:
    """One update through the plane, as stage 3 sends it: packed on this thread while a courier thread sends
    what is staged."""
    from concurrent.futures import ThreadPoolExecutor

    update = W.Update(version, sender.layout(kind), str(next(sender.module.parameters()).dtype))
    with ThreadPoolExecutor(1) as courier:
        sent = courier.submit(sender.send, update, [ch], group, TIMEOUT)
        try:
            sender.pack(update)
        except BaseException as e:  # noqa: BLE001 - the courier's failure says more
            if sent.exception(TIMEOUT) is None:
                raise e
        return sent.result(TIMEOUT)


def receive(receiver: W.ModuleReceiver, ch: Any) -> int:
    head, _ = ch.recv()
    return W.take_update(ch, receiver, head)


def _side(rank: int, port: int, out: str) -> None:
    """One process of the pair, every case in turn over one channel and group: rank 0 the trainer (seed 1), rank 1
    the receiver (seed 2, then what it receives). A refused update leaves both usable: every bucket was sent."""
    ch, group = _pair(rank, port, out)
    probe = W.probe_logprobs
    results: dict[str, Any] = {}
    sender = receiver = None
    for case in CASES:
        lora = case.startswith("lora")
        if case in ("ok", "bf16_trainer", "lora_full"):  # a fresh pair of models (the others reuse the last)
            model = _model(1 if rank == 0 else 2, lora=lora and rank == 0)
            if case == "bf16_trainer" and rank == 0:  # a GPU trainer's bf16 weights into a CPU sampler's fp32
                model = model.to(torch.bfloat16)
            sender = W.Sender(model, True, streaming=False, bucket_bytes=4096) if rank == 0 else None
            receiver = W.ModuleReceiver(model) if rank == 1 else None
            if receiver is not None:
                receiver.group = group
        result: dict[str, Any] = {}
        W.CORRUPT = None
        W.probe_logprobs = probe  # type: ignore[assignment]
        try:
            if rank == 0:
                assert sender is not None
                if case == "again":  # the trainer moved on: the same buffers carry the next update
                    with torch.no_grad():
                        for p in model.parameters():
                            p.mul_(1.1)
                if case == "damaged":
                    W.CORRUPT = lambda flat: flat.view(-1)[:1].add_(1)
                if case == "off_probe":  # the receiver will hold these weights; the probe sent is not theirs
                    W.probe_logprobs = lambda module: [0.0] * (W.PROBE_LENGTH - 1)  # type: ignore[assignment]
                kind = "adapter" if case == "lora_adapter" else "full"
                result["metrics"] = send(sender, ch, group, 7, kind)
                result["staging"] = {k: [st.slab.data_ptr(), st.total] for k, st in sender.stages.items()
                                     if st.slab is not None}
                result["staging_bytes"] = sender.staging_bytes
                if lora:
                    from dschat.models.lora import merged_state_dict

                    result["merged"] = {k: v.float().tolist() for k, v in
                                        merged_state_dict(model, model.state_dict()).items()}
            else:
                assert receiver is not None
                result["version"] = receive(receiver, ch)
        except W.WeightLinkError as e:
            result["error"] = str(e)
        result["state"] = {k: v.float().tolist() for k, v in model.state_dict().items()}
        result["tied"] = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        results[case] = result
    Path(out, f"{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Every case's (trainer, receiver) results, from one pair of processes."""
    out = tmp_path_factory.mktemp("plane")
    mp.spawn(_side, args=(free_port(), str(out)), nprocs=2, join=True)
    sides = [json.loads((out / f"{r}.json").read_text()) for r in (0, 1)]
    return {case: (sides[0][case], sides[1][case]) for case in CASES}


def test_a_receiver_takes_the_trainer_s_weights_in_buckets_with_the_version(pair):
    trainer, receiver = pair["ok"]
    assert "error" not in trainer and "error" not in receiver, (trainer, receiver)
    assert receiver["version"] == 7 and receiver["state"] == trainer["state"] and receiver["tied"]
    assert trainer["state"] != {k: v.tolist() for k, v in _model(2).state_dict().items()}  # it did change
    n_params = sum(p.numel() for p in _model(1).parameters())  # the tied head counted once, as sent
    metrics = trainer["metrics"]
    assert metrics["sync/bytes"] == n_params * 4 and metrics["sync/seconds"] > 0  # (every tensor a whole word)
    layout = W.plan_layout(_model(1), "full", 4096)  # buckets of 4 KiB, but for the embedding's alone
    # K > 0 (not streaming): the staging holds one whole update, each bucket in a buffer of its own size
    assert len(layout.buckets) > 3 and metrics["sync/staging_bytes"] == trainer["staging_bytes"] == layout.nbytes


def test_the_staging_buffers_are_made_once_and_reused(pair):
    first, second = pair["ok"][0], pair["again"][0]
    assert second["staging"] == first["staging"]  # the same slab, at the same address
    assert first["staging"]["full"][1] == W.plan_layout(_model(1), "full", 4096).nbytes
    trainer, receiver = pair["again"]
    assert "error" not in receiver and receiver["state"] == trainer["state"] != pair["ok"][0]["state"]


@pytest.mark.parametrize("case, says", [
    ("damaged", "arrived damaged (checksum"),
    ("off_probe", "differ from the trainer's by"),
])
def test_a_bad_update_stops_both_sides_with_one_line(pair, case, says):
    trainer, receiver = pair[case]
    assert says in receiver["error"] and "the sampler stops" in receiver["error"], receiver
    assert trainer["error"].startswith("weight update 7: the sampler refused it: ") and says in trainer["error"]
    assert "\n" not in trainer["error"] and "\n" not in receiver["error"]


def test_a_half_precision_trainer_s_update_is_checked_at_half_precision_s_tolerance(pair):
    # its probe, computed in bf16, is off the receiver's fp32 one by about 1e-3 nats: over float32's 1e-4, well
    # within half precision's
    trainer, receiver = pair["bf16_trainer"]
    assert "error" not in trainer and "error" not in receiver, (trainer, receiver)
    assert receiver["version"] == 7 and receiver["state"] == trainer["state"]


def test_lora_sends_its_base_once_then_the_adapters_alone_and_the_receiver_merges_them(pair):
    (full, got_full), (adapter, got_adapter) = pair["lora_full"], pair["lora_adapter"]
    for trainer, receiver in ((full, got_full), (adapter, got_adapter)):
        assert "error" not in trainer and "error" not in receiver, (trainer, receiver)
        assert receiver["state"] == trainer["merged"]  # the merged model, to the bit (the one merge)
    lora = _model(1, lora=True)
    adapters = sum(p.numel() for n, p in lora.named_parameters() if "lora_" in n) * 4
    assert full["metrics"]["sync/bytes"] == sum(p.numel() for p in lora.parameters()) * 4  # the base and them
    assert adapter["metrics"]["sync/bytes"] == adapters  # nothing frozen (stage 3's test: r = 8 on the tiny
    # preset sends under a tenth of the full update)
    assert list(adapter["staging"]) == ["adapter"] and adapter["staging_bytes"] == adapters  # the full one let go


# ------------------------------------------------------------------------------------------------ by hand
def test_the_checksum_by_hand():
    words = torch.tensor([3, -5], dtype=torch.int64)
    got = W.bucket_checksum(words.view(torch.uint8))
    assert got.tolist() == [3 - 5, 9 + 25]
    big = torch.tensor([2**62, 2**62], dtype=torch.int64)  # wraps: 2**63 is -2**63 in int64, squares wrap to 0
    assert W.bucket_checksum(big.view(torch.uint8)).tolist() == [-(2**63), 0]
    x = torch.randn(1024).view(torch.uint8)
    y = x.clone()
    y[17] ^= 1  # one bit flipped
    assert W.bucket_checksum(x).tolist() != W.bucket_checksum(y).tolist()
    shuffled = x.view(torch.int64)[torch.randperm(512)].contiguous().view(torch.uint8)
    assert W.bucket_checksum(x).tolist() == W.bucket_checksum(shuffled).tolist()  # the order does not matter


def test_the_layout_comes_from_metadata_and_round_trips():
    model = _model(1)
    layout = W.plan_layout(model, "full", 4096)
    names = [e.name for b in layout.buckets for e in b.entries]
    assert names == [n for n, _ in model.named_parameters()]  # tied head once, no buffers here
    assert all(b.numel * 4 <= 4096 or len(b.entries) == 1 for b in layout.buckets)
    assert W.Layout.from_json(json.loads(json.dumps(layout.to_json()))) == layout
    lora = W.plan_layout(_model(1, lora=True), "adapter", 4096)
    assert {e.role for b in lora.buckets for e in b.entries} == {"lora_A", "lora_B"} and lora.lora["r"] == 8


@pytest.mark.parametrize("bad, says", [
    ({"kind": "everything", "buckets": []}, "weights.layout.kind"),
    ({"kind": "full", "buckets": [{"dtype": "torch.float32", "numel": 4,
                                   "entries": [["w", [8], 0, "weight", 0, False]]}]}, "not a tensor inside its bucket"),
    ({"kind": "full", "buckets": [{"dtype": "float", "numel": 4, "entries": []}]}, "dtype"),
    ({"kind": "full", "buckets": [{"dtype": "torch.float32", "numel": -1, "entries": []}]}, "numel"),
])
def test_a_malformed_layout_is_refused_in_one_line(bad, says):
    from dschat.generation.channel import BadMessage

    with pytest.raises(BadMessage) as caught:
        W.Layout.from_json(bad)
    assert says in str(caught.value) and "\n" not in str(caught.value)


# ----------------------------------------------------------------------------------------- a receiver dies
def _dies(rank: int, port: int, out: str) -> None:
    import time

    ch, group = _pair(rank, port, out)
    model = _model(1 if rank == 0 else 2)
    if rank == 1:
        receiver = W.ModuleReceiver(model)
        receiver.group = group
        W.ON_BUCKET = lambda i: os._exit(9) if i == 3 else None  # gone in the middle of the update
        receive(receiver, ch)
        return
    sender = W.Sender(model, True, streaming=True, bucket_bytes=4096)  # K = 0: streamed, two buffers
    t0 = time.monotonic()
    try:
        send(sender, ch, group, 1)
        said = "sent"
    except Exception as e:  # noqa: BLE001 - what the sender sees is the test's subject
        said = f"{type(e).__name__}: {e}"
    Path(out, "sender.json").write_text(json.dumps({"said": said, "seconds": time.monotonic() - t0}))


def test_a_receiver_gone_mid_update_fails_the_sender_within_the_timeout(tmp_path):
    ctx = mp.start_processes(_dies, args=(free_port(), str(tmp_path)), nprocs=2, join=False, start_method="spawn")
    for p in ctx.processes:
        p.join(3 * TIMEOUT)
    got = json.loads((tmp_path / "sender.json").read_text())
    assert got["said"].startswith("WeightGroupError: a weight transfer failed: "), got
    assert "\n" not in got["said"] and got["seconds"] < TIMEOUT


# ------------------------------------------------------------------------------------------------ staging
def test_the_staging_is_one_slab_of_exactly_its_bytes_and_waits_within_its_timeout():
    layout = W.plan_layout(_model(1), "full", 4096)
    whole = W.Staging(layout, torch.device("cpu"), streaming=False, timeout_s=0.5)
    key, slot = whole.take(1)
    assert whole.bytes == whole.total == layout.nbytes and slot.numel() == layout.buckets[1].nbytes
    assert whole.take(2)[1].data_ptr() == slot.data_ptr() + layout.buckets[1].nbytes  # slots of one slab
    stream = W.Staging(layout, torch.device("cpu"), streaming=True, timeout_s=0.5)
    a, first = stream.take(0)
    b, _ = stream.take(1)
    assert stream.bytes == 2 * layout.capacity and (a, b) == (0, 1)
    with pytest.raises(W.WeightLinkError) as caught:  # bucket 2 needs slot 0 back: the courier never gives it
        stream.take(2)
    assert "within 0.5 s" in str(caught.value)
    stream.give(0)
    key, again = stream.take(2)
    assert key == 0 and again.data_ptr() == first.data_ptr()


def test_auto_staging_waits_for_a_training_step_and_room_twice_over(monkeypatch):
    sender = W.Sender(_model(1), True, streaming=False)
    layout = sender.layout("full")
    sender.device = sender.group_device = torch.device("cuda", 0)  # as on a GPU trainer with an NCCL group
    free = {"bytes": 10 * layout.nbytes}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 10**12))
    assert sender._where(layout, trained=False) == "host"  # before the first step: its peak is still to come
    assert sender._where(layout, trained=True) == "device"
    free["bytes"] = 2 * layout.nbytes - 1
    assert sender._where(layout, trained=True) == "host"  # not room for it twice over
    streaming = W.Sender(_model(1), True, streaming=True)
    streaming.device = streaming.group_device = torch.device("cuda", 0)
    free["bytes"] = 5 * layout.capacity
    assert streaming._where(layout, trained=False) == "device"  # K = 0: two buckets, any time
    sender.group_device = torch.device("cpu")  # gloo: the host stages whatever the choice
    sender.staging_choice = "device"
    assert sender._where(layout, trained=True) == "host"


class _FakeGroup:
    """A weight group that 'receives' each bucket by filling it with its index (no peer needed)."""

    device = torch.device("cpu")

    def __init__(self):
        self.calls = 0

    def broadcast(self, t):
        t.fill_(self.calls)
        self.calls += 1
        return t


def test_a_bucket_that_fails_to_load_is_refused_after_every_bucket_was_taken():
    layout = W.plan_layout(_model(1), "full", 4096)
    group = _FakeGroup()

    def load(bucket, flat):
        if bucket is layout.buckets[1]:
            raise KeyError("model.layers.9.mlp.up_proj.weight")

    sums, problem = W.receive_buckets(group, layout, load, {})
    assert group.calls == len(layout.buckets) == len(sums)  # the rest still taken: the trainer is not left waiting
    assert problem.startswith(f"loading the bucket holding {layout.buckets[1].entries[0].name} failed: ")
