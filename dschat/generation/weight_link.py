"""A policy's weights sent to a sampler in another job over a link (``dschat.engine.Link``: gloo on the CPU, NCCL
on GPUs), never through a file, and checked before the sampler uses them.

The trainer walks its weights under their Hugging Face names (``vllm_engine.policy_weights``: ZeRO-3 parameters
gathered one at a time, which every trainer rank must walk, LoRA merged); its first rank copies them into a
snapshot on the CPU (``take_snapshot``: the trainer trains on while it travels) and sends that in buckets
(``send_snapshot``): tensors of one dtype laid end to end up to ``BUCKET_BYTES``, each preceded by a JSON header
(names, shapes, dtype, element count, a checksum: count, sum and sum of squares of the elements read as integers,
exact on any device). The sampler receives each bucket, checks its checksum, and copies its tensors into its own
module. The last header carries the update's version and the probe: the trainer's log-probs of a fixed token
sequence, which the sampler computes again with what it received. Either check failing stops both sides with one
line (``WeightLinkError``): the sampler tells the trainer its verdict, so a bad update never samples. What an update
measured is returned as ``sync/seconds`` and ``sync/bytes``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from dschat.errors import UserError
from dschat.generation.vllm_engine import policy_weights

BUCKET_BYTES = 32 << 20
PROBE_LENGTH = 24
PROBE_SEED = 1234
PROBE_TOLERANCE = 1e-4  # nats, float32 on both sides; with half precision on either side HALF_TOLERANCE

# Tests: called with each bucket's flat buffer on the sender after its checksum is taken, to damage it on the way.
CORRUPT: Callable[[torch.Tensor], None] | None = None

_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
                               torch.int16, torch.int8, torch.uint8, torch.bool)}


class WeightLinkError(UserError):
    """A weight update failed its checks: the sampler would not sample from the policy being trained."""


def _buckets(items: Iterator[tuple[str, torch.Tensor]], limit: int,
             device: torch.device) -> Iterator[tuple[list[tuple[str, list[int]]], torch.Tensor]]:
    """Consecutive tensors of one dtype laid end to end in one flat buffer on ``device``, up to ``limit`` bytes
    (a larger tensor is a bucket alone): each copied in once as it comes (a ZeRO-3 parameter is whole only while
    its gather lasts). Yields the bucket's names and shapes, and its flat buffer."""
    names: list[tuple[str, list[int]]] = []
    flat: torch.Tensor | None = None
    at = 0
    for name, t in items:
        t = t.detach()
        n = t.numel()
        if flat is not None and (t.dtype != flat.dtype or (at + n) * flat.element_size() > limit):
            yield names, flat[:at]
            names, flat, at = [], None, 0
        if flat is None:
            flat = torch.empty(max(n, limit // t.element_size()), dtype=t.dtype, device=device)
        flat[at:at + n].copy_(t.reshape(-1))
        names.append((name, list(t.shape)))
        at += n
    if flat is not None:
        yield names, flat[:at]


_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bucket_checksum(flat: torch.Tensor) -> list[int]:
    """Count, sum and sum of squares of the bucket's elements read as integers of their width, in int64 (wrapping):
    integer sums do not depend on the order they are added in, so the trainer's figure (on its GPU) and the
    sampler's (on its GPU or CPU) are equal exactly when every bit arrived. Chunked, so the int64 copies stay small."""
    ints = flat.detach().reshape(-1).view(_INTS[flat.element_size()])
    out = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for chunk in ints.split(1 << 18):
        c = chunk.long()
        out[0] += c.sum()
        out[1] += (c * c).sum()
    return [ints.numel(), *out.tolist()]


def probe_ids(vocab: int) -> torch.Tensor:
    """The fixed probe sequence ``(1, PROBE_LENGTH)`` both sides score."""
    g = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randint(3, max(vocab, 4), (1, PROBE_LENGTH), generator=g)


@torch.no_grad()
def probe_logprobs(module: torch.nn.Module) -> list[float]:
    """``module``'s log-prob of each next token of the probe sequence (eval mode, float32 arithmetic)."""
    device = next(module.parameters()).device
    ids = probe_ids(int(module.config.vocab_size)).to(device)
    was_training = module.training
    module.eval()
    try:
        logits = module(input_ids=ids).logits[0, :-1].float()
    finally:
        if was_training:
            module.train()
    return logits.log_softmax(-1).gather(-1, ids[0, 1:, None]).squeeze(-1).cpu().tolist()


@dataclass
class Snapshot:
    """One weight update as the trainer's first rank holds it until it is sent: the buckets (each a JSON header and
    its flat tensor, on the CPU) and the probe. Taken at a step boundary, it lets the update travel while the
    trainer goes on training (``dschat.generation.sampler``)."""

    buckets: list[tuple[dict[str, Any], torch.Tensor]]
    probe: list[float]
    bytes: int
    seconds: float  # the trainer's time to take it
    dtype: str = "torch.float32"  # the trainer's floating-point weights' (what the probe was computed in)


def take_snapshot(module: torch.nn.Module, keeping: bool = True, bucket_bytes: int = BUCKET_BYTES) -> Snapshot | None:
    """``module``'s weights, bucketed, and its probe. Every trainer rank calls this, since a ZeRO-3 gather (and the
    probe's forward) is collective; only the one ``keeping`` (the trainer's first rank, the link's member) keeps
    the copy: the others get None."""
    t0 = time.perf_counter()
    weights = policy_weights(module)
    buckets: list[tuple[dict[str, Any], torch.Tensor]] = []
    if not keeping:  # the walk alone: its gathers are collective
        for _ in weights:
            pass
    else:  # each bucket laid out and summed where the weights are (a GPU's speed), then copied to the CPU
        device = next(module.parameters()).device
        for names, flat in _buckets(weights, bucket_bytes, device):
            buckets.append(({"names": [n for n, _ in names], "shapes": [s for _, s in names],
                             "dtype": str(flat.dtype), "numel": flat.numel(),
                             "checksum": bucket_checksum(flat)}, flat.to("cpu", copy=True)))
    probe = probe_logprobs(module)
    if not keeping:
        return None
    return Snapshot(buckets, probe, sum(f.numel() * f.element_size() for _, f in buckets),
                    time.perf_counter() - t0, str(next(module.parameters()).dtype))


def send_snapshot(link: Any, snap: Snapshot, version: int) -> dict[str, float]:
    """Send ``snap`` as update ``version`` (``link`` rank 0) and wait for the sampler's verdict: ``sync/seconds``
    (taking the snapshot, sending it, the sampler's checks) and ``sync/bytes``. Raises ``WeightLinkError`` when the
    sampler refused the update."""
    t0 = time.perf_counter()
    for header, flat in snap.buckets:
        flat = flat.to(link.bulk_device, copy=True)
        if CORRUPT is not None:
            CORRUPT(flat)
        link.broadcast_json({"bucket": header})
        link.broadcast(flat, bulk=True)
    link.broadcast_json({"done": {"version": version, "probe": snap.probe, "dtype": snap.dtype}})
    verdict = link.broadcast_json(None, src=1)
    if not verdict["ok"]:
        raise WeightLinkError(f"weight update {version}: the sampler refused it: {verdict['message']}")
    return {"sync/seconds": snap.seconds + time.perf_counter() - t0, "sync/bytes": float(snap.bytes)}


def send_weights(link: Any, module: torch.nn.Module, version: int, *, sending: bool = True,
                 bucket_bytes: int = BUCKET_BYTES) -> dict[str, float]:
    """Snapshot and send at once (``take_snapshot``, ``send_snapshot``): every trainer rank calls it, the one
    ``sending`` sends. Raises ``WeightLinkError`` when the sampler refused the update."""
    snap = take_snapshot(module, sending, bucket_bytes)
    return send_snapshot(link, snap, version) if snap is not None else {}


def receive_weights(link: Any, module: torch.nn.Module, tolerance: float | None = None) -> int:
    """Receive one update into ``module`` (a sampler's copy, plain HF names) on the link's rank 1; check each
    bucket's checksum and the probe, tell the trainer, and return the update's version. Raises
    ``WeightLinkError`` (after telling the trainer) when a check fails; ``module`` then holds a partial update and
    must not sample."""
    state = dict(module.state_dict(keep_vars=True))
    problem = ""
    while True:
        msg = link.broadcast_json(None)
        if "done" in msg:
            break
        head = msg["bucket"]
        flat = torch.empty(int(head["numel"]), dtype=_DTYPES[head["dtype"]], device=link.bulk_device)
        link.broadcast(flat, bulk=True)
        if problem:
            continue  # already failed: drain the rest so the trainer is not left waiting
        got = bucket_checksum(flat)
        if got != head["checksum"]:
            problem = (f"the bucket holding {head['names'][0]} arrived damaged (checksum {got} where the trainer "
                       f"sent {head['checksum']})")
            continue
        at = 0
        for name, shape in zip(head["names"], head["shapes"], strict=True):
            n = math.prod(shape)
            target = state.get(name)
            if target is None or list(target.shape) != shape:
                problem = f"{name}: the sampler's model has no weight of shape {shape} under that name"
                break
            with torch.no_grad():
                target.copy_(flat[at:at + n].view(shape))
            at += n
    done = msg["done"]
    if not problem:
        if tolerance is None:  # float32 on both sides, else half precision's (its kernels differ more)
            from dschat.config import HALF_TOLERANCE

            full = done.get("dtype", "torch.float32") == "torch.float32" and \
                next(module.parameters()).dtype == torch.float32
            tolerance = PROBE_TOLERANCE if full else HALF_TOLERANCE
        ours = probe_logprobs(module)
        diff = max((abs(a - b) for a, b in zip(ours, done["probe"], strict=True)), default=0.0)
        if diff > tolerance:
            problem = (f"its log-probs differ from the trainer's by {diff:.4g} nats on the probe (tolerance "
                       f"{tolerance:g})")
    verdict = link.broadcast_json({"ok": not problem, "message": problem}, src=1)  # the sampler's first rank's
    if problem or not verdict["ok"]:
        raise WeightLinkError(f"weight update {done['version']}: {problem or verdict['message']}; the sampler stops")
    return int(done["version"])
