"""Stage 3's asynchronous rollouts in the plan (``--async-rollouts``, ``--sampler HOST:PORT``): per update, the
sampler's time beside the trainer's, the step time when they overlap (``--max-staleness`` K > 0) and in lockstep
(K = 0), the weight update on the weight plane, and the split of the run's devices between sampling and training
that balances the two.

The figures come from the plan's own time model (``dschat.planning.plan``): the sampler's time is the generation
estimate for the rows of every training rank (one request holds them all) on the sampler's device; the
trainer's is its experience forwards and training. Each side also spends time on the weight update once per update
(``WeightUpdate``: the trainer packs it on its training thread, the sampler waits for the wire and loads it).
Then, per update::

    sampling  S = generation of all rows on the sampler's device + the update's wire + its load on the sampler
    training  T = experience + training (per trainer rank) + the update's pack
    lockstep    = S + T        (K = 0, or a sampler sharing a device with the trainer)
    overlapped  = max(S, T)    (K > 0: the sampler samples the next update's answers while the trainer trains)

The split of ``N`` devices gives ``s`` to sampling and ``N - s`` to training with the global batch kept: the
sampling side's rows are divided over its ``s`` devices (each samples ``ceil(rows / s)``, reading the whole
weights per token, so more devices help less than ``1/s`` where decoding is bandwidth-bound), the training side's
time scales as ``N / (N - s)``. The best ``s`` minimises ``max(S_s, T_{N-s})``. This module holds the arithmetic
and the report; it imports nothing of the plan (nor torch: ``BUCKET_BYTES`` is the weight plane's, which tests hold
equal).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dschat.units import fmt_bytes

# The weight plane's bucket size (``dschat.generation.weight_plane.BUCKET_BYTES``, which imports torch).
BUCKET_BYTES = 32 << 20
# Nominal rates of the weight update's legs (not measured here; docs/planning.md, "Asynchronous rollouts"):
NCCL_BANDWIDTH = 100e9  # nominal: a broadcast between two GPUs of one node (NVLink or PCIe peer-to-peer)
GLOO_BANDWIDTH = 1.2e9  # nominal: gloo's broadcast of CPU tensors over TCP
PCIE_BANDWIDTH = 20e9  # nominal: a copy between pinned host memory and a GPU
CPU_SUM_BANDWIDTH = 5e9  # nominal: the bucket checksum's two integer reductions on a CPU
# A pack reads the weights, writes the bucket and reads it again for the checksum; a load reads the received
# bucket for the checksum and again to copy it into the engine.
PACK_PASSES = 3
LOAD_PASSES = 2


def pack_buckets(tensors: list[int], bucket_bytes: int = BUCKET_BYTES) -> tuple[int, int]:
    """How ``weight_plane.plan_layout`` packs tensors of ``tensors`` bytes (one dtype, in the order the sender walks
    them): consecutive tensors up to ``bucket_bytes``, a larger one alone in its bucket. Returns the buckets and the
    capacity (the largest bucket's bytes, padded to whole 8-byte words, as ``Layout.capacity``)."""
    count = capacity = at = 0
    open_ = False
    for n in tensors:
        if open_ and at + n > bucket_bytes:
            count, capacity, at = count + 1, max(capacity, -(-at // 8) * 8), 0
        at, open_ = at + n, True
    if open_:
        count, capacity = count + 1, max(capacity, -(-at // 8) * 8)
    return count, capacity


@dataclass
class WeightUpdate:
    """One weight update on the weight plane (``dschat.generation.weight_plane``), as planned.

    ``U`` (``bytes``) is each later update's bytes and ``C`` (``capacity``) a bucket's; every staging and receive
    buffer is ``C`` bytes (the first update's layout makes them, later ones reuse them). Per update:

    - the trainer's pack, on its training thread: ``3 U / B_t`` (``B_t`` its device's bandwidth), plus
      ``U / PCIE_BANDWIDTH`` where a GPU trainer stages in pinned host memory;
    - the wire: NCCL (a GPU trainer, a GPU of the sampler's own) ``U / NCCL_BANDWIDTH``, plus ``U / PCIE_BANDWIDTH``
      when host-staged (the courier copies each bucket back to the GPU to broadcast it); else gloo
      ``U / GLOO_BANDWIDTH + U / CPU_SUM_BANDWIDTH`` (the sampler's checksum on the CPU), plus ``U / PCIE_BANDWIDTH``
      for a GPU sampler (it receives in host memory and copies in);
    - the sampler's side: the wire plus ``2 U / B_s`` (checksum and load on its device).

    The staging (``Sender._staging``, ``Staging``): with K = 0 two buffers of ``C`` that the update streams through;
    with K > 0 one buffer per bucket, each of its bucket's size, so a whole update waits in exactly its bytes
    (``U_first`` at the first update; a LoRA run lets the full update's go and holds ``U`` after). ``auto`` stages
    on the trainer's GPU where the group is NCCL and the GPU has room for the staging twice over beside the
    trainer's planned peak.
    """

    first_bytes: int  # U_first: the merged model, or base + adapters with LoRA
    bytes: int  # U: each later update (the adapters alone with LoRA, unless the base trains too)
    capacity: int  # C
    buckets: int  # the first update's buckets
    trainer_bandwidth: float  # B_t
    sampler_bandwidth: float  # B_s
    trainer_gpu: bool
    sampler_gpu: bool
    streaming: bool  # K = 0
    choice: str = "auto"  # --weight-staging
    nccl: bool = False  # this run's weight group: NCCL (else gloo)
    staging: str = "host"  # where the staging is: "device" (the trainer's GPU) or "host" (``place`` decides)
    room: bool = False  # the trainer's GPU has room for the staging twice over beside its peak

    @property
    def limit(self) -> int:
        """Staging buffers: two in turn (K = 0), else one per bucket of the first update."""
        return 2 if self.streaming else self.buckets

    @property
    def staging_bytes(self) -> int:
        """Their bytes at most: two buckets' capacity, or the whole first update (each buffer its bucket's size)."""
        return 2 * self.capacity if self.streaming else self.first_bytes

    def place(self, peak: int, memory: int) -> None:
        """Where the staging goes on a trainer whose planned peak is ``peak`` of ``memory`` (``Sender._staging``:
        the device only where the weights and the group are both on GPUs, and under ``auto`` only with room for the
        staging twice over)."""
        self.room = peak + 2 * self.staging_bytes < memory
        possible = self.trainer_gpu and self.nccl
        self.staging = "device" if possible and (self.choice == "device" or self.choice == "auto" and self.room) \
            else "host"

    @property
    def pinned(self) -> bool:
        return self.staging == "host" and self.trainer_gpu

    @property
    def host_bytes(self) -> int:
        """The staging in host memory (pinned beside a GPU trainer)."""
        return self.staging_bytes if self.staging == "host" else 0

    @property
    def device_bytes(self) -> int:
        """On the trainer's GPU: the staging, or with host staging the bucket it packs and sums in (and the
        courier's bucket it broadcasts from over NCCL)."""
        if not self.trainer_gpu:
            return 0
        if self.staging == "device":
            return self.staging_bytes
        return self.capacity * (2 if self.nccl else 1)

    @property
    def trainer_bytes(self) -> int:
        """The first rank's extra bytes in the memory its verdict counts: its GPU's, or the host's on a CPU."""
        return self.device_bytes if self.trainer_gpu else self.host_bytes

    @property
    def pack_seconds(self) -> float:
        return PACK_PASSES * self.bytes / self.trainer_bandwidth + (self.bytes / PCIE_BANDWIDTH if self.pinned else 0)

    @property
    def nccl_seconds(self) -> float:
        return self.bytes / NCCL_BANDWIDTH + (self.bytes / PCIE_BANDWIDTH if self.pinned else 0)

    @property
    def gloo_seconds(self) -> float:
        return (self.bytes / GLOO_BANDWIDTH + self.bytes / CPU_SUM_BANDWIDTH +
                (self.bytes / PCIE_BANDWIDTH if self.sampler_gpu else 0))

    @property
    def wire(self) -> str:
        return "NCCL" if self.nccl else "gloo"

    @property
    def wire_seconds(self) -> float:
        return self.nccl_seconds if self.nccl else self.gloo_seconds

    @property
    def receive_seconds(self) -> float:
        """The sampler's side: the wire, then the checksum and the load on its device."""
        return self.wire_seconds + LOAD_PASSES * self.bytes / self.sampler_bandwidth

    @property
    def own_gpu_receive_seconds(self) -> float:
        """The sampler's side on a GPU of the run's kind of its own (the split's sampling devices): NCCL."""
        return self.nccl_seconds + LOAD_PASSES * self.bytes / self.trainer_bandwidth

    @property
    def receive_on_device(self) -> bool:
        """The sampler's receive buffer is on its device (NCCL, or a CPU sampler), else in host memory (gloo to a
        GPU sampler)."""
        return self.nccl or not self.sampler_gpu

    def to_json(self) -> dict[str, Any]:
        return {"first_bytes": self.first_bytes, "bytes": self.bytes, "capacity": self.capacity,
                "buckets": self.buckets, "pack_seconds": self.pack_seconds, "nccl_seconds": self.nccl_seconds,
                "gloo_seconds": self.gloo_seconds, "wire": self.wire.lower(), "wire_seconds": self.wire_seconds,
                "receive_seconds": self.receive_seconds, "weight_staging": self.choice, "staging": self.staging,
                "staging_buffers": self.limit, "staging_bytes": self.staging_bytes, "pinned": self.pinned,
                "host_bytes": self.host_bytes, "device_bytes": self.device_bytes,
                "receive_buffer_bytes": self.capacity,
                "receive_buffer_on": "device" if self.receive_on_device else "host",
                "bandwidths": {"nccl": NCCL_BANDWIDTH, "gloo": GLOO_BANDWIDTH, "pcie": PCIE_BANDWIDTH,
                               "cpu_sum": CPU_SUM_BANDWIDTH, "trainer": self.trainer_bandwidth,
                               "sampler": self.sampler_bandwidth}}


@dataclass(frozen=True)
class Split:
    """``sampler_devices`` sampling, ``trainer_devices`` training: each side's seconds per update."""

    sampler_devices: int
    trainer_devices: int
    sampling_seconds: float
    training_seconds: float

    @property
    def step_seconds(self) -> float:
        return max(self.sampling_seconds, self.training_seconds)

    def to_json(self) -> dict[str, Any]:
        return {"sampler_devices": self.sampler_devices, "trainer_devices": self.trainer_devices,
                "sampling_seconds": self.sampling_seconds, "training_seconds": self.training_seconds,
                "step_seconds": self.step_seconds}


def balance(devices: int, sampling: Callable[[int], float], training: Callable[[int], float]) -> list[Split]:
    """Every split of ``devices`` with at least one on each side: ``sampling(s)`` and ``training(t)`` are each
    side's seconds per update on ``s`` and ``t`` devices."""
    return [Split(s, devices - s, sampling(s), training(devices - s)) for s in range(1, devices)]


def best_split(splits: list[Split]) -> Split | None:
    """The split whose slower side is fastest (ties: fewer sampling devices); None without a split."""
    return min(splits, key=lambda x: (x.step_seconds, x.sampler_devices)) if splits else None


@dataclass
class RolloutsPlan:
    """Asynchronous rollouts as planned: the sampler, each side's seconds per update, the step time, the split."""

    where: str  # how the run gets its sampler: "on cuda:8" (--async-rollouts), "at HOST:PORT" (--sampler)
    device: str  # the device table's name of the sampler's device
    dtype: str
    max_staleness: int
    rows: int  # rows of one sampling request: every training rank's
    calls: int  # requests per update (PPO: --generation-batches)
    generate_seconds: float  # the sampler's generation per update
    experience_seconds: float  # per trainer rank
    train_seconds: float
    update: WeightUpdate
    without_sampler_seconds: float  # the plan's own step: every rank samples its own rows
    sampler_model_items: list[tuple[str, int]]  # the sampler's memory on its device but the receive buffer
    sampler_memory: int  # its device's memory (bytes)
    devices: int  # the run's devices the split divides
    device_index: int | None = None  # N of --sampler-devices cuda:N
    split_generate: list[float] = field(default_factory=list)  # generation seconds on s = 1 .. devices - 1
    shares: str = ""  # what the sampler shares with the trainer ("" when it has a device of its own)
    shared_peak: int = 0  # a shared GPU's peak: the trainer's and the sampler's (0: not a shared GPU)
    shared_memory: int = 0
    trainer_peak: int = 0  # the trainer's planned peak per GPU (0: not settled)
    trainer_memory: int = 0
    notes: list[str] = field(default_factory=list)

    def settle(self, peak: int, memory: int, shares: str = "") -> None:
        """What needs the trainer's planned ``peak`` of ``memory`` (``make_plan``): a training rank's GPU the sampler
        shares (``shares``: the weight group is then gloo, and the GPU holds both), and where the update is staged."""
        if shares:
            self.shares = shares
            self.update.nccl = False  # two processes on one GPU: gloo (dschat.generation.sampler)
        self.update.place(peak, memory)
        self.trainer_peak, self.trainer_memory = peak, memory
        if shares:
            first = self.update.trainer_bytes if self.device_index == 0 else 0  # the first rank stages on cuda:0
            self.shared_peak, self.shared_memory = peak + self.sampler_bytes + first, memory

    @property
    def update_bytes(self) -> int:
        """Each later update's bytes (``U``)."""
        return self.update.bytes

    @property
    def update_seconds(self) -> float:
        """The update's wire time in this run (NCCL or gloo)."""
        return self.update.wire_seconds

    @property
    def sampling_seconds(self) -> float:
        return self.generate_seconds + self.update.receive_seconds

    @property
    def training_seconds(self) -> float:
        return self.experience_seconds + self.train_seconds + self.update.pack_seconds

    @property
    def lockstep(self) -> bool:
        return self.max_staleness == 0

    @property
    def overlapped(self) -> bool:
        return not self.lockstep and not self.shares

    @property
    def lockstep_seconds(self) -> float:
        return self.sampling_seconds + self.training_seconds

    @property
    def step_seconds(self) -> float:
        return max(self.sampling_seconds, self.training_seconds) if self.overlapped else self.lockstep_seconds

    @property
    def speedup(self) -> float:
        return self.lockstep_seconds / self.step_seconds if self.step_seconds else 1.0

    @property
    def sampler_items(self) -> list[tuple[str, int]]:
        """The sampler's memory on its device, term by term: with the weight update's receive buffer where it is
        there (not with gloo to a GPU sampler, which receives in host memory)."""
        buffer = [("weight update's receive buffer", self.update.capacity)] if self.update.receive_on_device else []
        return self.sampler_model_items + buffer

    @property
    def sampler_bytes(self) -> int:
        return sum(b for _, b in self.sampler_items)

    @property
    def shared_fits(self) -> bool:
        """A GPU shared with a training rank holds both."""
        return not self.shared_peak or self.shared_peak <= self.shared_memory

    @property
    def trainer_fits(self) -> bool:
        """The first training rank holds its planned peak and the update's staging beside it."""
        return not self.trainer_peak or self.trainer_peak + self.update.trainer_bytes <= self.trainer_memory

    @property
    def fits(self) -> bool:
        """Part of the plan's verdict: a shared GPU holds both, the first rank its staging."""
        return self.shared_fits and self.trainer_fits

    @property
    def sampler_fits(self) -> bool:
        """The sampler's bytes within its device's memory (a device of its own: not part of the verdict)."""
        return self.sampler_bytes <= self.sampler_memory

    @property
    def splits(self) -> list[Split]:
        """Every split of the run's devices (none on the host's cores): ``s`` devices of the run's kind sample and
        receive the update over NCCL, ``N - s`` train the global batch and pack it."""
        n, u = self.devices, self.update
        return balance(n, lambda s: self.split_generate[s - 1] + u.own_gpu_receive_seconds,
                       lambda t: (self.experience_seconds + self.train_seconds) * n / t + u.pack_seconds) \
            if len(self.split_generate) == n - 1 and n > 1 else []

    @property
    def best(self) -> Split | None:
        return best_split(self.splits) if not self.lockstep else None

    def lines(self, secs: Callable[[float], str], gpu: str) -> list[str]:
        """The plan's text lines (``secs`` formats seconds; ``gpu`` names the run's devices)."""
        sampler = f"sampler {self.where} ({self.device}, {self.dtype})"
        calls = f"{self.rows} rows" if self.calls == 1 else f"{self.calls} calls of {self.rows} rows"
        u = self.update
        s = (f"sampling {secs(self.sampling_seconds)} (generate {calls} {secs(self.generate_seconds)}, receive the "
             f"update {secs(u.receive_seconds)})")
        t = (f"training {secs(self.training_seconds)} (experience {secs(self.experience_seconds)}, train "
             f"{secs(self.train_seconds)}, pack the update {secs(u.pack_seconds)})")
        without = f"without a sampler {secs(self.without_sampler_seconds)}"
        if self.lockstep:
            out = [f"async rollouts: --max-staleness 0 is lockstep, no overlap: {sampler}: {s} + {t} = "
                   f"{secs(self.lockstep_seconds)} per update; {without}"]
        elif self.shares:
            out = [f"async rollouts: {sampler} shares {self.shares}: no overlap counted: {s} + {t} = "
                   f"{secs(self.lockstep_seconds)} per update; {without}"]
        else:
            out = [f"async rollouts: {sampler}, --max-staleness {self.max_staleness}: {s}, {t}: "
                   f"{secs(self.step_seconds)} per update overlapped (the slower side) against "
                   f"{secs(self.lockstep_seconds)} in lockstep (the sum), {self.speedup:.2f}x; {without}"]
        items = "; ".join(f"{w} {fmt_bytes(b)}" for w, b in self.sampler_items)
        if self.shared_peak:
            line = (f"sampler memory: {fmt_bytes(self.sampler_bytes)} ({items}); with the training rank's peak "
                    f"{fmt_bytes(self.shared_peak)} of {fmt_bytes(self.shared_memory)}: "
                    f"{'fits' if self.shared_fits else 'does NOT fit'}")
        else:
            line = (f"sampler memory: {fmt_bytes(self.sampler_bytes)} of {fmt_bytes(self.sampler_memory)} on its "
                    f"device: {'fits' if self.sampler_fits else 'does NOT fit'} ({items})")
        out.append(line)
        out.append(self.split_line(secs, gpu))
        out.append(self.update_line(secs))
        out.append(f"async assuming NCCL {NCCL_BANDWIDTH / 1e9:g} GB/s, gloo {GLOO_BANDWIDTH / 1e9:g} GB/s, pinned "
                   f"copies {PCIE_BANDWIDTH / 1e9:g} GB/s, checksums on a CPU {CPU_SUM_BANDWIDTH / 1e9:g} GB/s "
                   f"(nominal)" + "".join(f"; {n}" for n in self.notes))
        return out

    def update_line(self, secs: Callable[[float], str]) -> str:
        """The weight update: its bytes, the pack, both wires, the staging and the receive buffer."""
        u = self.update
        first = "" if u.first_bytes == u.bytes else f" (the first, with the base weights: {fmt_bytes(u.first_bytes)})"
        pinned = " and its copy to pinned host memory" if u.pinned else ""
        buckets = f"{u.buckets} bucket{'s' if u.buckets != 1 else ''}"
        buffers = f"2 buffers of {fmt_bytes(u.capacity)}" if u.streaming else f"{buckets}, each its own size"
        why = "K = 0 streams it" if u.streaming else f"K = {self.max_staleness} holds a whole update"
        if u.staging == "device":
            staged = f"staged on the trainer's GPU: {fmt_bytes(u.staging_bytes)} ({buffers}: {why})"
        else:
            where = "pinned host memory" if u.pinned else "host memory"
            staged = f"staged in {where}: {fmt_bytes(u.host_bytes)} ({buffers}: {why})"
            if u.device_bytes:
                staged += (f", and {fmt_bytes(u.device_bytes)} on the trainer's GPU (the bucket it packs in"
                           f"{' and the one it broadcasts from' if u.nccl else ''})")
        if u.choice == "auto" and u.trainer_gpu and u.nccl:
            staged += f" (auto: twice the staging {'fits' if u.room else 'does not fit'} beside the trainer's peak)"
        elif u.choice == "device" and u.staging == "host":
            staged += " (--weight-staging device: only where both sides of the group are GPUs)"
        if not self.trainer_fits:
            staged += (f"; the first rank: its peak and the staging {fmt_bytes(self.trainer_peak + u.trainer_bytes)}"
                       f" of {fmt_bytes(self.trainer_memory)}: does NOT fit")
        receive = "on its device" if u.receive_on_device else "in host memory"
        return (f"weight update: {fmt_bytes(u.bytes)} each{first}, {buckets} of up to "
                f"{fmt_bytes(u.capacity)}; packed in {secs(u.pack_seconds)} on the trainer (reading the weights, "
                f"writing and summing each bucket{pinned}); over NCCL {secs(u.nccl_seconds)}, over gloo "
                f"{secs(u.gloo_seconds)} (this run: {u.wire}), then {secs(u.receive_seconds - u.wire_seconds)} to sum "
                f"and load it on the sampler; {staged}; the sampler's receive buffer {fmt_bytes(u.capacity)} "
                f"{receive}")

    def split_line(self, secs: Callable[[float], str], gpu: str) -> str:
        if self.lockstep:
            return "split: none in lockstep (nothing overlaps)"
        if self.devices == 1:
            return ("split: one device, none possible: the sampler shares it with the trainer (--sampler-devices "
                    "cuda:0) or samples on the CPU (--sampler-devices cpu)")
        b = self.best
        if b is None:
            return "split: none planned: the ranks share the host's cores"
        one = self.splits[0]
        line = (f"split: of {self.devices} x {gpu}, {b.sampler_devices} sampling + {b.trainer_devices} training "
                f"balance best: sampling {secs(b.sampling_seconds)}, training {secs(b.training_seconds)}, "
                f"{secs(b.step_seconds)} per update (the global batch kept); without a sampler on all "
                f"{self.devices}: {secs(self.without_sampler_seconds)}" +
                (", faster than any split" if self.without_sampler_seconds <= b.step_seconds else ""))
        if b.sampler_devices > 1:
            line += (f"; this build runs one sampler process on one device per run (--async-rollouts starts one, "
                     f"--sampler takes one address), so it runs 1 sampling + {one.trainer_devices} training: "
                     f"{secs(one.step_seconds)} per update")
        return line

    def to_json(self) -> dict[str, Any]:
        b = self.best
        return {
            "where": self.where, "device": self.device, "dtype": self.dtype, "max_staleness": self.max_staleness,
            "lockstep": self.lockstep, "overlapped": self.overlapped, "shares": self.shares or None,
            "rows_per_call": self.rows, "calls": self.calls, "generate_seconds": self.generate_seconds,
            "experience_seconds": self.experience_seconds, "train_seconds": self.train_seconds,
            "update_bytes": self.update_bytes, "update_seconds": self.update_seconds,
            "weight_update": self.update.to_json(),
            "sampling_seconds": self.sampling_seconds, "training_seconds": self.training_seconds,
            "step_seconds": self.step_seconds, "lockstep_seconds": self.lockstep_seconds, "speedup": self.speedup,
            "without_sampler_seconds": self.without_sampler_seconds,
            "sampler_bytes": self.sampler_bytes,
            "sampler_items": [{"what": w, "bytes": n} for w, n in self.sampler_items],
            "sampler_memory_bytes": self.sampler_memory, "sampler_fits": self.sampler_fits,
            "shared_peak_bytes": self.shared_peak or None, "fits": self.fits, "trainer_fits": self.trainer_fits,
            "devices": self.devices, "split": b.to_json() if b else None,
            "splits": [x.to_json() for x in self.splits] if not self.lockstep else [],
            "assumptions": self.notes,
        }
