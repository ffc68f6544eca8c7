"""Emulates, on a CPU machine, a world process group with no backend for CPU tensors, as a group made with NCCL
alone has none, for the collectives dschat itself makes. Put this folder first on ``PYTHONPATH`` of a launched run; with
``CUDA_ONLY_WORLD_REPORT=DIR`` each rank writes ``DIR/rank<N>.json`` at exit (the world's backends, and how many
collectives dschat and the others made).

* The world group is created as ``cuda:gloo``: a collective over CPU tensors on it raises ``No backend type
  associated with device type cpu``, exactly as on NCCL, and an object collective asks for CUDA.
* A collective called from dschat's own code goes through unchanged: a CPU tensor dschat sends over the world group
  fails here as it would on GPUs.
* Everyone else's collectives (DeepSpeed's ZeRO gathers and reductions, torch's own) are sent over a gloo group of
  the same ranks instead: on GPUs they move CUDA tensors, which NCCL serves, and only their placement on a CPU here
  would make them fail. Groups they create default to gloo for the same reason.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import json
import os
import sys

import torch.distributed as dist

_FULL = None  # a gloo group of the world's ranks, for collectives that are not dschat's
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single", "barrier",
               "monitored_barrier", "broadcast_object_list", "all_gather_object", "gather_object",
               "scatter_object_list", "send", "recv", "isend", "irecv", "all_reduce_coalesced",
               "all_gather_coalesced")
CALLS = {"dschat": 0, "others": 0}  # how many collectives each side made (written out at exit when asked)


def _from_dschat(frame) -> bool:
    return str(frame.f_globals.get("__name__", "")).startswith("dschat")


def _init_process_group(real, *args, **kwargs):
    global _FULL
    kwargs.pop("backend", None)
    if args:
        args = args[1:]
    real("cuda:gloo", *args, **kwargs)
    _FULL = dist.new_group(backend="gloo")
    report = os.environ.get("CUDA_ONLY_WORLD_REPORT")
    if report:  # each rank: the world's backends and how many collectives each side made
        path = os.path.join(report, f"rank{dist.get_rank()}.json")
        config = str(dist.get_backend_config())
        atexit.register(lambda: open(path, "w").write(json.dumps({"world": config, **CALLS})))


def _new_group(real, *args, **kwargs):
    if not _from_dschat(sys._getframe(2)) and kwargs.get("backend") is None and len(args) < 3:
        kwargs["backend"] = "gloo"
    return real(*args, **kwargs)


def _collective(real, *args, **kwargs):
    mine = _from_dschat(sys._getframe(2))
    CALLS["dschat" if mine else "others"] += 1
    if not mine and _FULL is not None:
        bound = inspect.signature(real).bind_partial(*args, **kwargs)
        if bound.arguments.get("group") in (None, dist.GroupMember.WORLD):
            bound.arguments["group"] = _FULL
            return real(*bound.args, **bound.kwargs)
    return real(*args, **kwargs)


def _wrap(name, how) -> None:
    real = getattr(dist, name, None)
    if real is None:
        return

    @functools.wraps(real)
    def wrapper(*args, **kwargs):
        return how(real, *args, **kwargs)

    setattr(dist, name, wrapper)


_wrap("init_process_group", _init_process_group)
_wrap("new_group", _new_group)
for _name in COLLECTIVES:
    _wrap(_name, _collective)
