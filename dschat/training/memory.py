"""Memory per phase of a run, measured in every run (docs/planning.md, Memory in every run).

Phases: stages 1-2 ``train`` and ``eval``; stage 3 ``generate``, ``experience``, ``train_actor``, ``train_critic``
and ``eval``. A phase is a ``with phase(name):`` block around the code that runs it (a training micro-batch's is
entered by the loop's ``dschat.training.stage.ResumableLoop.micro_batch``); blocks nest, and the bytes of an inner
block count for the inner phase only (the ``generate`` inside stage 3's ``experience``), so each phase's figure is
its own.

What a phase records, as its peak over the blocks since the figures were last taken:

* on CUDA, ``peak_allocated`` and ``peak_reserved`` (``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``,
  their peaks reset at each block's start) and ``device_used``, the device's used total at the block's end
  (``torch.cuda.mem_get_info``: every process's memory on it, as ``nvidia-smi`` counts);
* on a CPU, ``peak_rss``: the process's resident-set high-water mark (``VmHWM``), reset at each block's start by
  writing ``5`` to ``/proc/self/clear_refs`` (Linux). Where the reset is refused the figure is the process's
  lifetime peak (``ru_maxrss``) and ``peak_rss_lifetime`` says so.

The figures are this process's (one rank's): ranks are not reduced, since a collective per log row would tie the
logging of every rank together. ``take()`` gives them as ``memory/<phase>_<figure>_mib`` keys for a metrics row,
with ``memory/oom_splits`` (forwards split in halves after running out of memory: ``dschat.training.oom``);
``summary()`` the run's peaks for eval.json.
"""

from __future__ import annotations

import contextlib
import re
import resource
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

MiB = 1024**2


class Probe(Protocol):
    """Resets and reads one device's peak memory figures (bytes)."""

    def reset(self) -> None: ...

    def read(self) -> dict[str, int]: ...


class CudaProbe:
    """``torch.cuda``'s peak counters of one device (``cuda`` injectable, so the arithmetic is tested on a CPU)."""

    def __init__(self, device: Any = None, cuda: Any = None):
        import torch

        self.cuda = cuda if cuda is not None else torch.cuda
        self.device = device

    def reset(self) -> None:
        self.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> dict[str, int]:
        free, total = self.cuda.mem_get_info(self.device)
        return {"peak_allocated": int(self.cuda.max_memory_allocated(self.device)),
                "peak_reserved": int(self.cuda.max_memory_reserved(self.device)), "device_used": int(total - free)}


class RssProbe:
    """The process's peak resident set since the last reset (Linux ``VmHWM``, reset through ``clear_refs``)."""

    def __init__(self, proc: Path = Path("/proc/self")):
        self.proc = proc
        self.resettable = True

    def reset(self) -> None:
        if not self.resettable:
            return
        try:
            (self.proc / "clear_refs").write_text("5")
        except OSError:
            self.resettable = False

    def read(self) -> dict[str, int]:
        try:
            found = re.search(r"VmHWM:\s+(\d+)\s*kB", (self.proc / "status").read_text())
        except OSError:
            found = None
        if found is not None and self.resettable:
            return {"peak_rss": int(found.group(1)) * 1024}
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        return {"peak_rss": int(peak) * (1 if sys.platform == "darwin" else 1024), "peak_rss_lifetime": 1}


def default_probe() -> Probe:
    """CUDA's counters on a CUDA device, else the process's RSS."""
    import torch

    if torch.cuda.is_available():
        return CudaProbe(torch.cuda.current_device())
    return RssProbe()


class MemoryMeter:
    """Peak memory per phase (module docstring). ``probe`` defaults to the device's (``default_probe``)."""

    def __init__(self, probe: Probe | None = None):
        self._probe = probe
        self.stack: list[str] = []
        self.window: dict[str, dict[str, int]] = {}  # since the last take()
        self.peaks: dict[str, dict[str, int]] = {}  # since the run began
        self.oom_splits = 0

    @property
    def probe(self) -> Probe:
        if self._probe is None:
            self._probe = default_probe()
        return self._probe

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure the block as phase ``name``; a block inside a block of the same name is part of it."""
        if self.stack and self.stack[-1] == name:
            yield
            return
        if self.stack:
            self._fold(self.stack[-1])  # the enclosing phase's peak up to here is its own
        self.probe.reset()
        self.stack.append(name)
        try:
            yield
        finally:
            self._fold(name)
            self.stack.pop()
            self.probe.reset()  # the enclosing phase goes on from here

    def _fold(self, name: str) -> None:
        figures = self.probe.read()
        for store in (self.window, self.peaks):
            kept = store.setdefault(name, {})
            for k, v in figures.items():
                kept[k] = max(kept.get(k, v), v)

    def take(self) -> dict[str, float]:
        """The figures since the last call, as metrics (``memory/<phase>_<figure>_mib``), and the split count."""
        out: dict[str, float] = {}
        for name, figures in sorted(self.window.items()):
            for k, v in sorted(figures.items()):
                out[f"memory/{name}_{k}" if k == "peak_rss_lifetime" else f"memory/{name}_{k}_mib"] = \
                    v if k == "peak_rss_lifetime" else round(v / MiB, 1)
        self.window = {}
        if out or self.oom_splits:
            out["memory/oom_splits"] = float(self.oom_splits)
        return out

    def peak(self) -> tuple[str, str, int] | None:
        """``(phase, figure, bytes)`` of the run's largest figure: the device's used total on CUDA, the peak RSS on a
        CPU."""
        best: tuple[str, str, int] | None = None
        for name, figures in self.peaks.items():
            for k in ("device_used", "peak_reserved", "peak_rss"):
                if k in figures:
                    if best is None or figures[k] > best[2]:
                        best = (name, k, figures[k])
                    break
        return best

    def summary(self) -> dict[str, Any]:
        """eval.json's ``memory``: the run's peak figure and phase, and every phase's peaks (MiB)."""
        top = self.peak()
        if top is None:
            return {}
        return {"peak_mib": round(top[2] / MiB, 1), "peak_figure": top[1], "peak_phase": top[0],
                "oom_splits": self.oom_splits,
                "phases": {name: {k: (v if k == "peak_rss_lifetime" else round(v / MiB, 1))
                                  for k, v in sorted(f.items())} for name, f in sorted(self.peaks.items())}}


# The run's meter: phases are measured where their code runs (rollout, scoring, the loops), far from the loop that
# logs them, so one meter per process (``reset`` by ``begin_stage``).
METER = MemoryMeter()


class phase(contextlib.ContextDecorator):  # noqa: N801 - used as a function: ``with phase("generate"):``
    """The run's meter's ``phase(name)``, looked up when the block starts (so it also decorates a function, and
    follows ``reset``)."""

    def __init__(self, name: str):
        self.name = name
        self._cms: list[contextlib.AbstractContextManager[None]] = []

    def __enter__(self) -> None:
        cm = METER.phase(self.name)
        self._cms.append(cm)
        cm.__enter__()

    def __exit__(self, *exc: Any) -> bool | None:
        return self._cms.pop().__exit__(*exc)


def take() -> dict[str, float]:
    return METER.take()


def reset(probe: Probe | None = None) -> MemoryMeter:
    """A fresh meter for a new run (a rollback's rerun in the same process starts from nothing)."""
    global METER
    METER = MemoryMeter(probe)
    return METER


def summary() -> dict[str, Any]:
    return METER.summary()
