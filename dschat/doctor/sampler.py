"""The doctor's sampler check (stage 3's asynchronous rollouts): a sampler started apart (``--sampler HOST:PORT``)
takes a connection there and proves the run's secret; a sampler stage 3 starts itself (``--async-rollouts``) has
the devices ``--sampler-devices`` names on this machine, and a GPU of its own unless told to share."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from typing import Any

from dschat.doctor.plan import GPUMemory
from dschat.doctor.report import ERROR, OK, WARN, Report
from dschat.units import fmt_bytes

CHECK = "sampler"


def check_sampler(cfg: Any, report: Report, timeout: float, gpus: Sequence[GPUMemory],
                  num_gpus: int | None = None) -> None:
    """Nothing without asynchronous rollouts. ``--sampler HOST:PORT``: one TCP connection there within ``timeout``
    seconds, closed at once (as stage 3 probes the port before it joins; the link itself is not joined).
    ``--async-rollouts``: what stage 3 starts, and on ``cuda:N`` that GPU ``N`` is among ``gpus`` (the visible
    GPUs; not checked on a host without them: the doctor may run away from the GPUs), on ``cpu:CORES`` that the
    cores are this process's."""
    a = getattr(cfg, "rollouts", None)
    if a is None or not a.enabled:
        return
    if a.sampler:
        probe_sampler(a.sampler, cfg.actor.model, timeout, report, a.sampler_token_file)
    else:
        check_sampler_devices(a.sampler_devices, gpus, num_gpus, report, a.sampler_share_gpu)


def probe_sampler(addr: str, model: str, timeout: float, report: Report, token_file: str = "") -> None:
    """A connection to ``addr`` (a sampler's ``--listen HOST:PORT``) in which both sides prove the run's secret,
    closed before a hello (the sampler then waits on for its trainer): ok when it is taken and the secret
    agrees, an error naming why (and the command that starts a sampler there) when not."""
    from dschat.errors import UserError
    from dschat.generation.channel import ChannelClosed, Refused, connect, load_secret
    from dschat.utils import address

    host, port = address(addr)
    try:
        secret = load_secret(token_file, "--sampler-token-file")
    except UserError as e:
        report.add(CHECK, ERROR, f"--sampler {addr}: {e}")
        return
    try:
        socket.getaddrinfo(host, port)
    except socket.gaierror as e:
        report.add(CHECK, ERROR, f"--sampler {addr}: host {host} does not resolve ({e.strerror or e}); name the "
                                 "sampler's host as this machine reaches it")
        return
    try:
        connect(host, port, secret, timeout).close()
    except Refused as e:
        report.add(CHECK, ERROR, f"the peer at {addr} is not this run's sampler: {e} (the same secret on both "
                                 "sides: --sampler-token-file here, --token-file or $DSCHAT_SAMPLER_TOKEN there)")
        return
    except ChannelClosed as e:
        why = str(e)
        report.add(CHECK, ERROR, f"no sampler answers at {addr} ({why}): start one there with `dschat sampler "
                                 f"--model {model or '...'} --listen {addr}`")
        return
    report.add(CHECK, OK, f"the sampler at {addr} answers and proves the run's secret")


def check_sampler_devices(devices: str, gpus: Sequence[GPUMemory], num_gpus: int | None, report: Report,
                          share: bool = False) -> None:
    """What ``--async-rollouts`` starts on ``--sampler-devices``, checked against this machine where it can be."""
    from dschat.rlhf.config import sampler_devices

    device, cores = sampler_devices(devices)  # parsed already by the flags check
    start = f"stage 3 starts a sampler on {devices}"
    if device.startswith("cuda:"):
        n = int(device.partition(":")[2])
        if not gpus:
            report.add(CHECK, OK, f"{start} (not checked: no CUDA GPU visible to the doctor here)")
            return
        found = next((g for g in gpus if g.index == n), None)
        if found is None:
            seen = ", ".join(f"cuda:{g.index}" for g in gpus)
            report.add(CHECK, ERROR, f"--sampler-devices {devices}: no GPU {n} here ({len(gpus)} visible: {seen}); "
                                     "pick one of them or check CUDA_VISIBLE_DEVICES")
            return
        if n < (num_gpus or 1) and not share:
            report.add(CHECK, ERROR, f"--sampler-devices {devices}: a training rank uses GPU {n} too (--num-gpus "
                                     f"{num_gpus or 1}); name a GPU of its own, or pass --sampler-share-gpu")
            return
        shared = (f"; a training rank uses GPU {n} too (--sampler-share-gpu): the plan counts the sampler's "
                  "copy of the actor on it, and weights cross over gloo") if n < (num_gpus or 1) else ""
        report.add(CHECK, OK, f"{start} (GPU {n}, {found.name}, {fmt_bytes(found.free)} free){shared}")
        return
    if not cores:
        report.add(CHECK, OK, f"{start} (as many threads as the trainer)")
        return
    mine = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    missing = sorted(set(cores) - set(mine))
    if mine and missing:
        report.add(CHECK, WARN, f"--sampler-devices {devices}: core(s) {', '.join(map(str, missing))} not among "
                                f"the {len(mine)} this process may use here; the sampler could not pin them on "
                                "this machine")
        return
    report.add(CHECK, OK, f"{start} (cores {', '.join(map(str, cores))} alone, which the trainer then leaves)")
