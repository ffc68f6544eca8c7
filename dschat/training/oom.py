"""Out of memory on the device (docs/planning.md, Out of memory): detecting it, and a forward without gradient
split in halves.

A forward without gradient (sampling, the experience forwards, evaluation) that runs out of memory is run again on
the two halves of its batch (each split again if it must) and the results are put together: the same rows in the
same order. Only where the forward is this rank's alone: under ZeRO-3 with more than one rank every forward is a
collective, and one rank running two where the others run one would hang them all.

A training micro-batch that runs out of memory stops the run instead, with the planner's advice
(``dschat.training.oom_advice``). Both paths detect the error with ``is_oom`` (``torch.OutOfMemoryError``, CUDA's
and the other accelerators'); ``INJECT`` raises one on purpose, so both are tested on a CPU.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

from dschat.training import memory

T = TypeVar("T")

# Tests: ``INJECT(site, n) -> True`` raises an out-of-memory error at that call. ``site`` is a forward's name
# (``generate``, ``experience``, ``score``, ``eval``) with ``n`` its rows, or ``train <phase>`` with ``n`` the
# micro-batch's number (from 1) in its step.
INJECT: Callable[[str, int], bool] | None = None


def is_oom(error: BaseException) -> bool:
    """Whether ``error`` is the device running out of memory (and not some other failure, which goes on)."""
    import torch

    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "out of memory" in str(error) and "CUDA" in str(error))


def check(site: str, n: int) -> None:
    """Raise the injected out-of-memory error of ``INJECT`` at ``site``, if it asks for one."""
    if INJECT is not None and INJECT(site, n):
        import torch

        raise torch.OutOfMemoryError(f"CUDA out of memory (injected at {site}, {n})")


def release() -> None:
    """Give a failed attempt's cached blocks back: before its halves run, or before a stopped run plans and saves."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def rank_local(model: Any) -> bool:
    """Whether a forward of ``model`` involves no other rank: one rank, or weights that ZeRO-3 does not partition."""
    from dschat import engine as E

    if E.world_size() == 1:
        return True
    module = getattr(model, "module", model)
    params = getattr(module, "parameters", None)
    return params is None or not any(hasattr(p, "ds_id") for p in params())


def split_on_oom(site: str, rows: int, run: Callable[[int, int], T], combine: Callable[[list[T]], T], *,
                 local: bool = True) -> T:
    """``run(0, rows)``; on out of memory, ``combine([run(0, m), run(m, rows)])`` with ``m = rows // 2``, halving
    further as needed (``run(a, b)``: the rows ``a:b``). Not ``local`` (a collective forward), or one row: the error
    goes on. Each split is counted (``memory/oom_splits``) and told in one line."""

    def attempt(a: int, b: int) -> T:
        try:
            check(site, b - a)
            return run(a, b)
        except Exception as e:  # noqa: BLE001 - only an out-of-memory error is handled; the rest go on
            if not (is_oom(e) and local and b - a > 1):
                raise
        # out of the except block: its traceback holds the failed attempt's tensors
        release()
        mid = (a + b) // 2
        memory.METER.oom_splits += 1
        _say(f"out of memory in {site} over {b - a} rows: running halves of {mid - a} and {b - mid} rows "
             f"(memory/oom_splits {memory.METER.oom_splits})")
        return combine([attempt(a, mid), attempt(mid, b)])

    return attempt(0, rows)


def _say(text: str) -> None:
    from dschat import engine as E

    rank = f" rank {E.rank()}" if E.world_size() > 1 else ""
    print(f"[memory{rank}] {text}", file=sys.stderr, flush=True)
