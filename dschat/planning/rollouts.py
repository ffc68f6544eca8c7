"""Stage 3's asynchronous rollouts in the plan (``--async-rollouts``, ``--sampler HOST:PORT``): per update, the
sampler's time beside the trainer's, the step time when they overlap (``--max-staleness`` K > 0) and in lockstep
(K = 0), and the split of the run's devices between sampling and training that balances the two.

The figures come from the plan's own time model (``dschat.planning.plan``): the sampler's time is the generation
estimate for the rows of every training rank (one request holds them all) on the sampler's device; the
trainer's is its experience forwards and training. Each side also waits for the weight update once per update:
the trainer while it copies its weights to host memory (the snapshot), the sampler while it receives them. Both
are counted as the update's bytes at ``WEIGHT_LINK_BANDWIDTH``. Then, per update::

    sampling  S = generation of all rows on the sampler's device + bytes / link
    training  T = experience + training (per trainer rank) + bytes / link
    lockstep    = S + T        (K = 0, or a sampler sharing a device with the trainer)
    overlapped  = max(S, T)    (K > 0: the sampler samples the next update's answers while the trainer trains)

The split of ``N`` devices gives ``s`` to sampling and ``N - s`` to training with the global batch kept: the
sampling side's rows are divided over its ``s`` devices (each samples ``ceil(rows / s)``, reading the whole
weights per token, so more devices help less than ``1/s`` where decoding is bandwidth-bound), the training side's
time scales as ``N / (N - s)``. The best ``s`` minimises ``max(S_s, T_{N-s})``. This module holds the arithmetic
and the report; it imports nothing of the plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dschat.units import fmt_bytes

# The weight update's rate on each side: the trainer's copy to host memory (pageable, over PCIe) and the sampler's
# receive over the link (NCCL between GPUs, gloo on a CPU). A nominal figure for a pageable PCIe copy, not measured.
WEIGHT_LINK_BANDWIDTH = 10e9


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
    update_bytes: int
    without_sampler_seconds: float  # the plan's own step: every rank samples its own rows
    sampler_items: list[tuple[str, int]]  # the sampler's memory on its device, term by term
    sampler_memory: int  # its device's memory (bytes)
    devices: int  # the run's devices the split divides
    device_index: int | None = None  # N of --sampler-devices cuda:N
    splits: list[Split] = field(default_factory=list)
    shares: str = ""  # what the sampler shares with the trainer ("" when it has a device of its own)
    shared_peak: int = 0  # a shared GPU's peak: the trainer's and the sampler's (0: not a shared GPU)
    shared_memory: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def update_seconds(self) -> float:
        return self.update_bytes / WEIGHT_LINK_BANDWIDTH

    @property
    def sampling_seconds(self) -> float:
        return self.generate_seconds + self.update_seconds

    @property
    def training_seconds(self) -> float:
        return self.experience_seconds + self.train_seconds + self.update_seconds

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
    def sampler_bytes(self) -> int:
        return sum(b for _, b in self.sampler_items)

    @property
    def fits(self) -> bool:
        """A GPU shared with a training rank holds both: part of the plan's verdict."""
        return not self.shared_peak or self.shared_peak <= self.shared_memory

    @property
    def sampler_fits(self) -> bool:
        """The sampler's bytes within its device's memory (a device of its own: not part of the verdict)."""
        return self.sampler_bytes <= self.sampler_memory

    @property
    def best(self) -> Split | None:
        return best_split(self.splits) if not self.lockstep else None

    def lines(self, secs: Callable[[float], str], gpu: str) -> list[str]:
        """The plan's text lines (``secs`` formats seconds; ``gpu`` names the run's devices)."""
        sampler = f"sampler {self.where} ({self.device}, {self.dtype})"
        calls = f"{self.rows} rows" if self.calls == 1 else f"{self.calls} calls of {self.rows} rows"
        s = (f"sampling {secs(self.sampling_seconds)} (generate {calls} {secs(self.generate_seconds)}, receive the "
             f"update {secs(self.update_seconds)})")
        t = (f"training {secs(self.training_seconds)} (experience {secs(self.experience_seconds)}, train "
             f"{secs(self.train_seconds)}, snapshot of the update {secs(self.update_seconds)})")
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
                    f"{'fits' if self.fits else 'does NOT fit'}")
        else:
            line = (f"sampler memory: {fmt_bytes(self.sampler_bytes)} of {fmt_bytes(self.sampler_memory)} on its "
                    f"device: {'fits' if self.sampler_fits else 'does NOT fit'} ({items})")
        out.append(line)
        out.append(self.split_line(secs, gpu))
        out.append(f"async assuming the update's {fmt_bytes(self.update_bytes)} at "
                   f"{WEIGHT_LINK_BANDWIDTH / 1e9:g} GB/s on each side" + "".join(f"; {n}" for n in self.notes))
        return out

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
            "link_bandwidth": WEIGHT_LINK_BANDWIDTH,
            "sampling_seconds": self.sampling_seconds, "training_seconds": self.training_seconds,
            "step_seconds": self.step_seconds, "lockstep_seconds": self.lockstep_seconds, "speedup": self.speedup,
            "without_sampler_seconds": self.without_sampler_seconds,
            "sampler_bytes": self.sampler_bytes,
            "sampler_items": [{"what": w, "bytes": n} for w, n in self.sampler_items],
            "sampler_memory_bytes": self.sampler_memory, "sampler_fits": self.sampler_fits,
            "shared_peak_bytes": self.shared_peak or None, "fits": self.fits,
            "devices": self.devices, "split": b.to_json() if b else None,
            "splits": [x.to_json() for x in self.splits] if not self.lockstep else [],
            "assumptions": self.notes,
        }
