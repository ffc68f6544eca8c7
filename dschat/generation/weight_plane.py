"""The weight plane: a policy's weights from the trainer to its samplers, packed where they are, broadcast once on
a group of their own, loaded straight into the engine that samples, and checked before it samples.

**The layout.** An update is a list of buckets: tensors of one dtype laid end to end in one flat buffer of at most
``capacity`` bytes (``BUCKET_BYTES``, or the largest tensor's size). The layout (``plan_layout``: names, shapes,
dtypes and offsets) comes from the parameters' metadata alone (ZeRO-3's full shapes included), so it is known
before anything is gathered and is sent ahead of the bytes.

**Kinds.** A ``full`` update carries every weight under the plain Hugging Face names. A model with LoRA adapters
sends, instead of merged weights, each adapted layer's base weight (``base``) and its two adapter matrices
(``lora_A``, ``lora_B``, with the layer's scaling): the receiver merges them (dschat's decoder) or loads the
adapter as an adapter (vLLM). Once a receiver holds the base, later updates are ``adapter`` updates: the
adapters and whatever else trains (a base that trains too, a head), nothing frozen.

**The sender** (the trainer's first rank; every trainer rank walks the weights, since a ZeRO-3 gather is
collective) packs each bucket on the device the weights are on, takes its checksum there (``bucket_checksum``:
one reduction of its 8-byte words, and one of their squares, in wrapping int64: exact on any device and
independent of the order the sum runs in), and leaves it in a reused staging buffer (``Staging``): on the device
where the plan has room, else in pinned host memory, never a fresh allocation per update. A courier thread
(``dschat.generation.sampler``) sends the layout over each sampler's control channel, broadcasts the buckets on
the weight group (``dschat.engine.WeightGroup``) as they are packed, then the checksums and the probe (the
trainer's log-probs of a fixed token sequence), and collects each sampler's verdict. While a sampler samples, a
staged update waits its turn (asynchronous rollouts with ``K > 0``); with ``K = 0`` two buffers stream the update
as it is packed.

**The receiver** (each sampler rank) takes each bucket into one reused buffer on its device, checksums it and
loads its tensors into its engine (``ModuleReceiver``: the decoder's own parameters, LoRA merged into a kept
base; vLLM: its model through a worker extension, ``dschat.generation.vllm_worker``). Then it compares the
checksums, computes the probe with the engine that will sample and answers its verdict: a bucket that arrived
damaged, or log-probs off the trainer's, refuse the update (``WeightLinkError``), and that engine never samples.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from dschat.errors import UserError
from dschat.generation.channel import BadMessage

BUCKET_BYTES = 32 << 20
PROBE_LENGTH = 24
PROBE_SEED = 1234
PROBE_TOLERANCE = 1e-4  # nats, float32 on both sides; with half precision on either side HALF_TOLERANCE
KINDS = ("full", "adapter")
ROLES = ("weight", "base", "lora_A", "lora_B")

# Tests: called with each packed bucket (uint8, on the sender) after its checksum is taken, to damage it on the way;
# and with each bucket's index as a receiver takes it (to stop a sampler mid-update).
CORRUPT: Callable[[torch.Tensor], None] | None = None
ON_BUCKET: Callable[[int], None] | None = None

DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
                              torch.int16, torch.int8, torch.uint8, torch.bool)}


class WeightLinkError(UserError):
    """A weight update failed its checks: the sampler would not sample from the policy being trained."""


# ------------------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class Entry:
    """One tensor of a bucket: its name in the plain model (a LoRA matrix: ``<layer>.lora_A.weight``), shape,
    offset in the bucket (elements), and what it is (``ROLES``); a LoRA matrix carries its layer's scaling and
    whether the layer stores (in, out)."""

    name: str
    shape: tuple[int, ...]
    offset: int
    role: str = "weight"
    scale: float = 0.0
    fan_in_fan_out: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def layer(self) -> str:
        """The adapted layer a ``base``/``lora_*`` entry belongs to."""
        return self.name.rsplit(".", 2 if self.role.startswith("lora_") else 1)[0]


@dataclass(frozen=True)
class Bucket:
    dtype: str
    numel: int
    entries: tuple[Entry, ...]

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: the elements, padded to whole 8-byte words (the padding zero)."""
        return -(-self.numel * DTYPES[self.dtype].itemsize // 8) * 8


@dataclass(frozen=True)
class Layout:
    kind: str
    buckets: tuple[Bucket, ...]
    lora: dict[str, Any] | None = None  # {"r", "alpha", "targets"}: the adapters' shape, where the model has them

    @property
    def capacity(self) -> int:
        return max((b.nbytes for b in self.buckets), default=8)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "lora": self.lora,
                "buckets": [{"dtype": b.dtype, "numel": b.numel,
                             "entries": [[e.name, list(e.shape), e.offset, e.role, e.scale, e.fan_in_fan_out]
                                         for e in b.entries]} for b in self.buckets]}

    @staticmethod
    def from_json(data: Any, limit: int = 1 << 40) -> Layout:
        """A layout as the trainer sent it, checked: ``BadMessage`` for one that does not hold together."""
        from dschat.generation.channel import BadMessage, Fields

        f = Fields(data, "weights.layout")
        kind = f.str("kind", KINDS)
        buckets = []
        for i, raw in enumerate(f.list("buckets")):
            b = Fields(raw, f"weights.layout.buckets[{i}]")
            dtype, numel = b.str("dtype", list(DTYPES)), b.int("numel", 0, limit)
            entries = []
            for j, e in enumerate(b.list("entries")):
                ok = isinstance(e, list) and len(e) == 6 and isinstance(e[0], str) and isinstance(e[1], list) and \
                    all(type(d) is int and d >= 0 for d in e[1]) and type(e[2]) is int and e[3] in ROLES and \
                    type(e[4]) in (int, float) and math.isfinite(e[4]) and type(e[5]) is bool
                entry = Entry(e[0], tuple(e[1]), e[2], e[3], float(e[4]), e[5]) if ok else None
                if entry is None or entry.offset < 0 or entry.offset + entry.numel > numel:
                    raise BadMessage(f"weights.layout.buckets[{i}].entries[{j}]: not a tensor inside its bucket")
                entries.append(entry)
            buckets.append(Bucket(dtype, numel, tuple(entries)))
        lora = f.fields("lora", None)
        spec = None
        if lora is not None:
            spec = {"r": lora.int("r", 1), "alpha": lora.number("alpha"), "targets": lora.list("targets")}
            if not all(isinstance(t, str) for t in spec["targets"]):
                raise BadMessage("weights.layout.lora.targets: not a list of layer names")
        return Layout(kind, tuple(buckets), spec)


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(t, "ds_shape", None) or t.shape)  # a ZeRO-3 parameter's full shape


def sources(module: torch.nn.Module, kind: str) -> list[tuple[str, str, torch.Tensor, float, bool]]:
    """What an update of ``kind`` carries, in the order both sides walk it: (name, role, the parameter or buffer,
    LoRA scaling, fan_in_fan_out). Tied weights appear once (``named_parameters`` skips the duplicate)."""
    from dschat.models import lora as LR

    out: list[tuple[str, str, torch.Tensor, float, bool]] = []
    adapted = dict(LR._lora_layers(module))
    inside: set[str] = set()
    for name, layer in adapted.items():
        LR._check_plain_lora(name, layer)
        p = f"{name}." if name else ""
        inside.update(f"{p}{k}" for k, _ in layer.named_parameters())
        base = layer.base_layer
        scale, fan = float(layer.scaling[LR.ADAPTER]), bool(getattr(layer, "fan_in_fan_out", False))
        if kind == "full" or base.weight.requires_grad:
            out.append((f"{p}weight", "base", base.weight, scale, fan))
        if getattr(base, "bias", None) is not None and (kind == "full" or base.bias.requires_grad):
            out.append((f"{p}bias", "weight", base.bias, 0.0, False))
        out.append((f"{p}lora_A.weight", "lora_A", layer.lora_A[LR.ADAPTER].weight, scale, fan))
        out.append((f"{p}lora_B.weight", "lora_B", layer.lora_B[LR.ADAPTER].weight, scale, fan))
    for name, param in module.named_parameters():
        if name not in inside and (kind == "full" or param.requires_grad):
            out.append((name, "weight", param, 0.0, False))
    if kind == "full":
        persistent = set(module.state_dict().keys())
        out += [(n, "weight", b, 0.0, False) for n, b in module.named_buffers() if n in persistent and n not in inside]
    return out


def lora_spec(module: torch.nn.Module) -> dict[str, Any] | None:
    """The adapters' rank, alpha and adapted layers (None without LoRA)."""
    from dschat.models import lora as LR

    layers = dict(LR._lora_layers(module))
    if not layers:
        return None
    first = next(iter(layers.values()))
    return {"r": int(first.r[LR.ADAPTER]), "alpha": float(first.lora_alpha[LR.ADAPTER]), "targets": sorted(layers)}


def plan_layout(module: torch.nn.Module, kind: str, bucket_bytes: int = BUCKET_BYTES) -> Layout:
    """The buckets of an update of ``kind`` from the parameters' metadata (nothing gathered): consecutive tensors of
    one dtype up to ``bucket_bytes`` (a larger tensor alone in its bucket)."""
    buckets: list[Bucket] = []
    entries: list[Entry] = []
    dtype, at = "", 0
    for name, role, t, scale, fan in sources(module, kind):
        shape, dt = _shape(t), str(t.dtype)
        n = math.prod(shape)
        if entries and (dt != dtype or (at + n) * t.element_size() > bucket_bytes):
            buckets.append(Bucket(dtype, at, tuple(entries)))
            entries, at = [], 0
        dtype = dt
        entries.append(Entry(name, shape, at, role, scale, fan))
        at += n
    if entries:
        buckets.append(Bucket(dtype, at, tuple(entries)))
    return Layout(kind, tuple(buckets), lora_spec(module))


def bucket_checksum(buf: torch.Tensor) -> torch.Tensor:
    """``(2,)`` int64 on ``buf``'s device: the sum of the bucket's 8-byte words and of their squares, wrapping
    (``buf``: uint8, a whole number of words). Integer sums do not depend on the order they run in, so the sender's
    (on its GPU) and a receiver's (on its GPU or CPU) agree to the bit whatever device and kernel sum them; damage
    that changes bytes (a flipped bit, a range zeroed, cut short or written twice) changes them. Whole words that
    change places would not, which a transfer of one buffer does not do; the probe catches what is left."""
    words = buf.view(torch.int64)
    return torch.stack([words.sum(), (words * words).sum()])


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


def tolerance(trainer_dtype: str, ours: torch.dtype) -> float:
    """How far the probe may be off: float32 on both sides, else half precision's (its kernels differ more)."""
    from dschat.config import HALF_TOLERANCE

    return PROBE_TOLERANCE if trainer_dtype == "torch.float32" and ours == torch.float32 else HALF_TOLERANCE


# ------------------------------------------------------------------------------------------------ staging
class Staging:
    """Reused staging for one layout, on ``device`` (pinned where the host stages for a GPU): one slab made the
    first time it is needed and reused by every later update, so the trainer never allocates an update's memory
    twice, and of exactly the bytes it needs. ``streaming`` (K = 0): two slots of the layout's bucket capacity,
    taken in turn, so an update streams while it is packed; else one slot per bucket, of that bucket's size, so one
    whole update waits in exactly its bytes. ``take`` waits until the courier gave the slot back (after its
    broadcast), at most ``timeout_s``; a courier that failed wakes the waiter with its error."""

    def __init__(self, layout: Layout, device: torch.device, streaming: bool, pinned: bool = False,
                 timeout_s: float = 600.0):
        self.device, self.streaming, self.pinned, self.timeout_s = device, streaming, pinned, timeout_s
        self.capacity = layout.capacity
        sizes = [self.capacity] * 2 if streaming else [b.nbytes for b in layout.buckets]
        self.offsets = [sum(sizes[:k]) for k in range(len(sizes))]
        self.sizes, self.total = sizes, sum(sizes)
        self.slab: torch.Tensor | None = None
        self.trained = True  # made after a training step (an ``auto`` staging made before one is decided again)
        self.busy: set[int] = set()
        self.failed: BaseException | None = None
        self.waited = 0.0
        self._cv = threading.Condition()

    @property
    def bytes(self) -> int:
        return self.total if self.slab is not None else 0

    def _make(self) -> torch.Tensor:
        """The slab: on the device, or in host memory pinned page by page with ``cudaHostRegister`` (exact, where
        a pinned allocation through torch's caching host allocator would round it up to a power of two and keep it
        after it is let go); unregistered when the slab goes."""
        slab = torch.empty(self.total, dtype=torch.uint8, device=self.device)
        if self.pinned:
            import weakref

            cudart = torch.cuda.cudart()
            if int(cudart.cudaHostRegister(slab.data_ptr(), slab.numel(), 0)) == 0:
                weakref.finalize(slab, cudart.cudaHostUnregister, slab.data_ptr())
            else:  # not pinned after all (a host that refuses it): copies out of the GPU then wait for each other
                self.pinned = False
        return slab

    def take(self, index: int) -> tuple[int, torch.Tensor]:
        """The slot of bucket ``index`` and its key, once the courier has given it back."""
        key = index % 2 if self.streaming else index
        t0 = time.perf_counter()
        with self._cv:
            while key in self.busy and self.failed is None:
                if time.perf_counter() - t0 > self.timeout_s:
                    raise WeightLinkError(f"no staging buffer came free within {self.timeout_s:g} s: the sampler "
                                          "has not taken the previous update")
                self._cv.wait(1.0)
            self.waited += time.perf_counter() - t0
            if self.failed is not None:
                raise self.failed
            self.busy.add(key)
        if self.slab is None:
            self.slab = self._make()
        return key, self.slab[self.offsets[key]:self.offsets[key] + self.sizes[key]]

    def give(self, key: int) -> None:
        with self._cv:
            self.busy.discard(key)
            self._cv.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cv:
            self.failed = error
            self._cv.notify_all()


@dataclass
class Packed:
    """One bucket as the sender staged it: the staging buffer holding its ``nbytes`` bytes, their checksum (on the
    packing device) and, on a GPU, the event after which they are all there (packed, or copied to the host)."""

    buffer: torch.Tensor
    nbytes: int
    checksum: torch.Tensor
    ready: Any = None
    key: int = 0  # the staging buffer's, to give it back
    stage: Any = None  # the staging it came from

    @property
    def bytes(self) -> torch.Tensor:
        return self.buffer[:self.nbytes]


@dataclass
class Update:
    """One weight update in flight from the training thread (which packs it) to the courier (which sends it): the
    buckets arrive in ``packed`` as they are staged, then None; ``probe`` is set before the None."""

    version: int
    layout: Layout
    dtype: str  # the trainer's floating-point weights' (what the probe was computed in)
    packed: queue.Queue[Packed | BaseException | None] = field(default_factory=queue.Queue)
    probe: list[float] = field(default_factory=list)
    pack_started: float = 0.0  # perf_counter
    pack_s: float = 0.0
    staging_bytes: int = 0  # what the staging held once it was packed
    staging_wait_s: float = 0.0  # the packer's wait for free staging buffers


class Sender:
    """The trainer's side of the plane: packs updates into its staging buffers on the training thread (``pack``)
    and, on the courier's thread, sends them (``send``). Every trainer rank makes one (their walks are
    collective); only the first rank's ``keeping`` one stages anything."""

    def __init__(self, module: torch.nn.Module, keeping: bool, streaming: bool, staging: str = "auto",
                 bucket_bytes: int = BUCKET_BYTES, timeout_s: float = 600.0):
        self.module, self.keeping, self.bucket_bytes, self.timeout_s = module, keeping, bucket_bytes, timeout_s
        self.streaming = streaming  # K = 0: nothing trains while an update travels, two buffers stream it
        self.staging_choice = staging
        self.layouts: dict[str, Layout] = {}
        self.stages: dict[str, Staging] = {}  # per kind of update: a LoRA run's full one goes once its first has
        self.failed: BaseException | None = None
        self.pack_buffers: list[torch.Tensor] = []  # on the weights' GPU when the host stages: packed, summed there
        self.wire: list[torch.Tensor] = []  # on the group's GPU when the host stages for NCCL
        self.group_device = torch.device("cpu")
        self.device = next(module.parameters()).device

    def layout(self, kind: str) -> Layout:
        if kind not in self.layouts:
            self.layouts[kind] = plan_layout(self.module, kind, self.bucket_bytes)
        return self.layouts[kind]

    def _where(self, layout: Layout, trained: bool) -> str:
        """``device`` or ``host``: the device only where the weights and the weight group are both on GPUs; ``auto``
        only once a training step has run (before it the device's free memory says nothing of training's peak) and
        the device then has room for the staging twice over."""
        if not (self.device.type == "cuda" and self.group_device.type == "cuda"):
            return "host"
        if self.staging_choice != "auto":
            return self.staging_choice
        if not trained and not self.streaming:
            return "host"
        need = 2 * layout.capacity if self.streaming else layout.nbytes
        free, _ = torch.cuda.mem_get_info(self.device)
        return "device" if free > 2 * need else "host"

    def _staging(self, layout: Layout, trained: bool) -> Staging:
        """The staging of ``layout``'s kind (``Staging``), made the first time; an ``auto`` staging made before a
        training step ran is decided again at the first update after one. A LoRA run's first update is full and
        every later one adapters alone: the full update's staging is let go once an adapter update is packed (it
        goes when the courier is done with it)."""
        stage = self.stages.get(layout.kind)
        if stage is not None and (stage.trained or not trained):
            return stage
        on_device = self._where(layout, trained) == "device"
        if stage is not None and on_device == (stage.device.type == "cuda"):
            stage.trained = True
            return stage
        stage = Staging(layout, self.device if on_device else torch.device("cpu"), self.streaming,
                        pinned=not on_device and self.device.type == "cuda", timeout_s=self.timeout_s)
        stage.trained = trained
        if self.failed is not None:
            stage.fail(self.failed)
        if layout.kind == "adapter":
            self.stages.pop("full", None)
        self.stages[layout.kind] = stage
        return stage

    @property
    def staging_bytes(self) -> int:
        return sum(s.bytes for s in list(self.stages.values()))

    def fail(self, error: BaseException) -> None:
        """The courier lost its samplers: a packer waiting for a buffer wakes, and no later packing waits."""
        self.failed = error
        for stage in list(self.stages.values()):
            stage.fail(error)

    @torch.no_grad()
    def pack(self, update: Update, trained: bool = True) -> None:
        """Walk the weights (every rank: ZeRO-3 gathers one parameter at a time) and, on the keeping rank, stage
        ``update``'s buckets as they fill, each checksummed where the weights are; then the probe (a collective
        forward under ZeRO-3). ``trained``: a training step has run (``auto`` staging waits for one to choose the
        device). Whatever fails on the keeping rank alone (no staging buffer, the courier lost its sampler, an
        allocation) stops its staging, not the walk, so every rank still finishes the collective walk; the failure
        goes to the courier, and surfaces when answers are next read."""
        from dschat import engine as E

        t0 = update.pack_started = time.perf_counter()
        layout = update.layout
        src = {name: t for name, _, t, _, _ in sources(self.module, layout.kind)}
        stage: Staging | None = None
        failed = not self.keeping
        waited = 0.0

        def fail(error: BaseException) -> None:
            nonlocal failed
            if not failed:
                failed = True
                update.packed.put(error)

        if not failed:
            try:
                stage = self._staging(layout, trained)
                waited = stage.waited
            except BaseException as e:  # noqa: BLE001 - told to the courier's reader; the walk goes on
                fail(e)
        for index, bucket in enumerate(layout.buckets):
            key, buf, flat, typed = 0, None, None, None
            if not failed:
                try:
                    assert stage is not None
                    key, buf = stage.take(index)
                    # packed and summed where the weights are: in the staging slot itself, or in a buffer on the
                    # weights' GPU before it goes to the host (stream order keeps the next bucket off it till then)
                    target = buf if buf.device == self.device else self._pack_buffer(stage)
                    flat = target[:bucket.nbytes]
                    flat[-8:].zero_()  # the padding of the last word
                    dtype = DTYPES[bucket.dtype]
                    typed = flat[:bucket.numel * dtype.itemsize].view(dtype)
                except BaseException as e:  # noqa: BLE001
                    fail(e)
            for entry in bucket.entries:
                t = src[entry.name]
                with E.gathered_params([t] if isinstance(t, torch.nn.Parameter) else []):
                    if not failed and typed is not None:
                        try:
                            typed[entry.offset:entry.offset + entry.numel].copy_(t.detach().reshape(-1))
                        except BaseException as e:  # noqa: BLE001
                            fail(e)
            if failed or flat is None or buf is None or stage is None:
                continue
            try:
                checksum = bucket_checksum(flat)
                if CORRUPT is not None:
                    CORRUPT(flat)
                if flat.data_ptr() != buf.data_ptr():
                    buf[:bucket.nbytes].copy_(flat, non_blocking=stage.pinned)
                ready = None
                if flat.is_cuda:  # the courier's thread (its own stream) waits for this before it reads the bytes
                    ready = torch.cuda.Event()
                    ready.record()
                update.packed.put(Packed(buf, bucket.nbytes, checksum, ready, key, stage))
            except BaseException as e:  # noqa: BLE001
                fail(e)
        update.probe = probe_logprobs(self.module)
        update.pack_s = time.perf_counter() - t0
        if stage is not None:
            update.staging_bytes, update.staging_wait_s = self.staging_bytes, stage.waited - waited
        if not failed:
            update.packed.put(None)

    def _pack_buffer(self, stage: Staging) -> torch.Tensor:
        """A bucket-sized buffer on the weights' GPU to pack and sum in before the copy to the host staging."""
        if not self.pack_buffers or self.pack_buffers[0].numel() < stage.capacity:
            self.pack_buffers = [torch.empty(stage.capacity, dtype=torch.uint8, device=self.device)]
        return self.pack_buffers[0]

    def send(self, update: Update, channels: list[Any], group: Any, timeout_s: float) -> dict[str, float]:
        """The courier's part: the layout to every sampler, each bucket broadcast as it is staged, then the checksums
        and the probe; every sampler's verdict. ``sync/*`` metrics; ``WeightLinkError`` when one refused it. A
        failure also fails the staging, so a packer waiting for a buffer is not left waiting."""
        try:
            return self._send(update, channels, group, timeout_s)
        except WeightLinkError:  # refused, every bucket sent: the plane itself still works
            raise
        except BaseException as e:
            self.fail(e)
            raise

    def _send(self, update: Update, channels: list[Any], group: Any, timeout_s: float) -> dict[str, float]:
        t0 = time.perf_counter()
        head = {"op": "weights", "version": update.version, "layout": update.layout.to_json()}
        for ch in channels:
            ch.send(head)
        sums = []
        while True:
            try:
                item = update.packed.get(timeout=timeout_s)
            except queue.Empty:
                raise WeightLinkError(f"weight update {update.version}: the trainer staged nothing for "
                                      f"{timeout_s:g} s") from None
            if item is None:
                break
            if isinstance(item, BaseException):
                raise item
            if item.ready is not None:
                item.ready.synchronize()
            wire = item.bytes
            if wire.device != group.device:  # host staging to a GPU group: through one reused device buffer
                if not self.wire or self.wire[0].numel() < wire.numel():
                    self.wire = [torch.empty(item.buffer.numel(), dtype=torch.uint8, device=group.device)]
                wire = self.wire[0][:item.nbytes]
                wire.copy_(item.bytes)
            group.broadcast(wire)
            sums.append([int(x) for x in item.checksum.tolist()])
            if item.stage is not None:
                item.stage.give(item.key)
        end = {"op": "weights_end", "version": update.version, "checksums": sums, "probe": update.probe,
               "dtype": update.dtype}
        for ch in channels:
            ch.send(end)
        for ch in channels:
            verdict, _ = ch.recv(timeout_s)
            if verdict.get("ok") is not True:
                raise WeightLinkError(f"weight update {update.version}: the sampler refused it: "
                                      f"{str(verdict.get('message', ''))[:500]}")
        # the update in motion: its sending, and the part of its packing that did not overlap it (K = 0 packs while
        # it is sent; with K > 0 it was packed before its turn came)
        before = max(0.0, min(update.pack_started + update.pack_s, t0) - update.pack_started) if update.pack_s else 0.0
        return {"sync/seconds": time.perf_counter() - t0 + before, "sync/bytes": float(update.layout.nbytes),
                "sync/pack_s": update.pack_s, "sync/staging_bytes": float(update.staging_bytes),
                "sync/staging_wait_s": update.staging_wait_s}


# ----------------------------------------------------------------------------------------------- receiving
def received(group: Any, layout: Layout, holder: dict[str, torch.Tensor]) -> Iterator[tuple[Bucket, torch.Tensor,
                                                                                           torch.Tensor]]:
    """``layout``'s buckets as they arrive from the weight group, into one reused buffer on the group's device
    (``holder["buffer"]``, made or grown as needed): each bucket, its typed elements and its checksum (on the
    device). The next bucket overwrites the buffer: use (or copy) what was yielded before asking for it.
    ``WeightGroupError`` when the sender is gone."""
    buffer = holder.get("buffer")
    if buffer is None or buffer.numel() < layout.capacity or buffer.device != group.device:
        buffer = holder["buffer"] = torch.empty(layout.capacity, dtype=torch.uint8, device=group.device)
    for i, bucket in enumerate(layout.buckets):
        if ON_BUCKET is not None:
            ON_BUCKET(i)
        flat = buffer[:bucket.nbytes]
        group.broadcast(flat)
        dtype = DTYPES[bucket.dtype]
        yield bucket, flat[:bucket.numel * dtype.itemsize].view(dtype), bucket_checksum(flat)


def receive_buckets(group: Any, layout: Layout, load: Callable[[Bucket, torch.Tensor], None],
                    holder: dict[str, torch.Tensor]) -> tuple[list[list[int]], str]:
    """Every bucket of ``layout`` (``received``), each handed to ``load`` as it arrives; their checksums, and what
    went wrong loading them (''). A bucket that fails to load does not stop the others from being taken: the
    trainer broadcasts them all, and hears the refusal in the verdict."""
    from dschat.errors import first_line

    sums, problem = [], ""
    for bucket, flat, checksum in received(group, layout, holder):
        sums.append(checksum)
        if problem:
            continue
        try:
            load(bucket, flat)
        except Exception as e:  # noqa: BLE001 - the update is refused with it; the transfer goes on
            first = bucket.entries[0].name if bucket.entries else "a bucket"
            problem = f"loading the bucket holding {first} failed: {first_line(e)}"
    return [[int(x) for x in s.tolist()] for s in sums], problem


def damaged(got: list[list[int]], sent: Any, layout: Layout) -> str:
    """What arrived damaged (the first bucket whose checksum differs), or ''."""
    if not isinstance(sent, list) or len(sent) != len(got):
        return f"{len(got)} buckets arrived where the trainer sent checksums of {len(sent) if sent else 0}"
    for i, (a, b) in enumerate(zip(got, sent, strict=True)):
        if a != b:
            first = layout.buckets[i].entries[0].name if layout.buckets[i].entries else f"#{i}"
            return f"the bucket holding {first} arrived damaged (checksum {a} where the trainer sent {b})"
    return ""


class ModuleReceiver:
    """Updates loaded into a module's own parameters (the sampler's decoder samples from them). A LoRA update's
    base weights are kept beside the module (its adapted layers' size again) and each adapted layer's weight is
    their merge with the adapter (``dschat.models.lora.merge``), so the decoder runs plain layers."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.params = dict(module.state_dict(keep_vars=True))
        self.base: dict[str, torch.Tensor] = {}
        self.adapters: dict[str, dict[str, Any]] = {}
        self.holder: dict[str, torch.Tensor] = {}  # the reused receive buffer
        self.group: Any = None
        self.problem = ""

    def join(self, spec: dict[str, Any]) -> None:
        """Join the weight group the trainer described (``weight_group_spec``)."""
        self.group = join_group(spec, 0)

    def identities(self) -> list[str]:
        """The GPU each receiving rank holds ('' on a CPU): NCCL only where every member has one of its own."""
        from dschat import engine as E

        return [E.gpu_identity() if self.device.type == "cuda" else ""]

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    def receive(self, layout: Layout, version: int) -> list[list[int]]:
        self.problem = ""
        touched: set[str] = set()

        @torch.no_grad()
        def load(bucket: Bucket, flat: torch.Tensor) -> None:
            for e in bucket.entries:
                t = flat[e.offset:e.offset + e.numel].view(e.shape)
                if e.role == "weight":
                    target = self.params.get(e.name)
                    if target is None or tuple(target.shape) != e.shape:
                        self.problem = self.problem or f"{e.name}: the sampler's model has no weight of shape " \
                                                       f"{list(e.shape)} under that name"
                        continue
                    target.copy_(t)
                elif e.role == "base":
                    kept = self.base.get(e.name)
                    if kept is None or tuple(kept.shape) != e.shape:
                        target = self.params.get(e.name)
                        dtype = target.dtype if target is not None else t.dtype
                        kept = self.base[e.name] = torch.empty(e.shape, dtype=dtype, device=self.device)
                    kept.copy_(t)
                    touched.add(e.layer)
                else:
                    slot = self.adapters.setdefault(e.layer, {})
                    slot[e.role] = t.to(self.device, torch.float32, copy=True)
                    slot["scale"], slot["fan"] = e.scale, e.fan_in_fan_out
                    touched.add(e.layer)

        if self.group is None:
            raise BadMessage("weights: the trainer has not formed the weight group")
        sums, self.problem = receive_buckets(self.group, layout, load, self.holder)
        with torch.no_grad():
            for layer in sorted(touched):
                name, slot = f"{layer}.weight", self.adapters.get(layer, {})
                target, base = self.params.get(name), self.base.get(name)
                if target is None or base is None or "lora_A" not in slot or "lora_B" not in slot:
                    self.problem = self.problem or f"{layer}: an adapter without its base (or a base without its " \
                                                   "adapter) arrived"
                    continue
                from dschat.models.lora import merge

                try:
                    target.copy_(merge(base, slot["lora_A"], slot["lora_B"], slot["scale"], slot["fan"]))
                except RuntimeError as e:  # shapes that do not fit: refused, never sampled from
                    self.problem = self.problem or f"{layer}: its adapter does not merge into it ({e})"
        return sums

    def probe_logprobs(self) -> list[float]:
        return probe_logprobs(self.module)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.module.parameters()).dtype


def join_group(spec: dict[str, Any], offset: int) -> Any:
    """A receiving rank's membership of the weight group the trainer described over the control channel
    (``{"store": [host, port], "prefix", "rank", "size", "nccl", "timeout", "host"}``: ``host`` this side's address
    as the trainer reaches it, where gloo listens; ``offset``: this rank's place among its sampler's receiving
    ranks)."""
    from dschat import engine as E

    host, port = spec["store"]
    store = E.WeightStore.client(host, int(port), float(spec["timeout"]))
    return E.WeightGroup(store, spec["prefix"], int(spec["rank"]) + offset, int(spec["size"]), float(spec["timeout"]),
                         bool(spec["nccl"]), spec.get("host"))


def verdict_of(receiver: Any, layout: Layout, sums: list[list[int]], end: dict[str, Any]) -> str:
    """The receiving side's check of an update (''), or what is wrong with it: a damaged bucket, a tensor its
    engine has no place for, log-probs off the trainer's on the probe."""
    from dschat.generation.channel import Fields

    f = Fields(end, "weights_end")
    problem = damaged(sums, f.list("checksums"), layout) or getattr(receiver, "problem", "")
    if problem:
        return problem
    sent = f.list("probe")
    if not all(type(x) in (int, float) and math.isfinite(x) for x in sent):
        return "the trainer's probe is not a list of finite numbers"
    ours = receiver.probe_logprobs()
    if len(ours) != len(sent):
        return f"the probe has {len(ours)} log-probs here and {len(sent)} on the trainer"
    diff = max((abs(a - b) for a, b in zip(ours, sent, strict=True)), default=0.0)
    limit = tolerance(f.str("dtype", list(DTYPES)), receiver.dtype)
    if not diff <= limit:
        return f"its log-probs differ from the trainer's by {diff:.4g} nats on the probe (tolerance {limit:g})"
    return ""


def entries_of(bucket: Bucket, flat: torch.Tensor) -> Iterator[tuple[Entry, torch.Tensor]]:
    """A bucket's tensors, each a view of ``flat`` (its typed elements) in its shape."""
    for e in bucket.entries:
        yield e, flat[e.offset:e.offset + e.numel].view(e.shape)


def take_update(channel: Any, receiver: Any, head: dict[str, Any]) -> int:
    """A receiver's whole part of one update, its ``weights`` message ``head`` read: the buckets into ``receiver``
    (``ModuleReceiver``, a fed vLLM engine), the trainer's ``weights_end``, the checks, the verdict sent back. Returns
    the update's version; ``WeightLinkError`` (after telling the trainer) when it failed its checks, ``UserError``
    when the trainer is gone mid-update, ``BadMessage`` for messages out of place."""
    from dschat.engine import WeightGroupError
    from dschat.errors import first_line
    from dschat.generation.channel import Fields

    version, layout = Fields(head, "weights").int("version", 0), Layout.from_json(head.get("layout"))
    try:
        sums = receiver.receive(layout, version)
    except WeightGroupError as e:
        raise UserError(f"the trainer is gone (weight update {version}): {first_line(e)}") from None
    except (BadMessage, UserError):
        raise
    except Exception as e:  # noqa: BLE001 - this side failed before it took every bucket: it cannot go on
        raise UserError(f"weight update {version}: this sampler could not take it: {first_line(e)}") from None
    end, _ = channel.recv()
    if Fields(end, "weights_end").str("op", ("weights_end",)) != "weights_end" or end.get("version") != version:
        raise BadMessage(f"weights_end: not the end of weight update {version}")
    problem = verdict_of(receiver, layout, sums, end)
    channel.send({"ok": not problem, "message": problem})
    if problem:
        raise WeightLinkError(f"weight update {version}: {problem}; the sampler stops")
    return version
