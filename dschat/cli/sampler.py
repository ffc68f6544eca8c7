"""``dschat sampler``: a copy of a policy in a process of its own, answering a trainer's batches of prompts and
taking its weight updates over a link (``dschat.generation.sampler``).

    dschat sampler --model output/step1_sft/model --listen 0.0.0.0:29700       # on the sampler's host

It listens at ``--listen`` until the trainer connects, then serves it until the trainer says stop (exit 0) or is
gone (one line, exit 2).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any

import click

from dschat.cli.options import DeclaredFlagsCommand, declared_config, given_flags
from dschat.config import ModelArgs, backend_help, piece
from dschat.errors import UserError
from dschat.utils import address


@functools.cache
def sampler_flags() -> type:
    """``SamplerFlags``: the model and backend flags a sampler shares with stage 3, from their declarations."""
    from dschat.rlhf.config import RLArgs

    return dataclasses.make_dataclass("SamplerFlags", [
        ("model", ModelArgs, piece(ModelArgs, only=("dtype", "trust_remote_code"))),
        ("rl", RLArgs, piece(RLArgs, only=("generation_backend",),
                             help={"generation_backend": backend_help("dschat")})),
    ])


@click.command("sampler", cls=DeclaredFlagsCommand, flags=sampler_flags, context_settings={"max_content_width": 110})
@click.option("--model", required=True, help="The policy to start from: a folder, an HF id in the cache, an alias or "
                                             "the preset 'tiny'; the trainer's updates replace its weights.")
@click.option("--listen", required=True, help="HOST:PORT this sampler listens at until its trainer connects.")
@click.option("--device", default="auto", show_default=True,
              help="auto = CUDA when available, else CPU; or e.g. cpu, cuda:1.")
@click.option("--timeout", type=click.FloatRange(min=1), default=600.0, show_default=True,
              help="Seconds to wait for the trainer (to connect, and for each message): past it, exit with one line.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads for sampling (default: torch's, one per core this process may use).")
@click.option("--cpus", default="", help="Run on these CPU cores alone, e.g. 1 or 2-3,6 (Linux).")
def sampler_command(model: str, listen: str, device: str, timeout: float, threads: int | None, cpus: str,
                    **declared: Any) -> None:
    """Hold a policy on its own devices and answer a trainer's batches of prompts."""
    cfg = declared_config(sampler_flags(), declared, given_flags())
    host, port = address(listen)
    if cpus:
        import os

        from dschat.rlhf.config import sampler_devices

        cores = sampler_devices(f"cpu:{cpus}")[1]
        try:
            os.sched_setaffinity(0, cores)
        except (OSError, AttributeError) as e:
            raise UserError(f"--cpus {cpus}: {e}") from None
        threads = threads or len(cores)
    import torch

    from dschat import engine as E  # the training stack: after the flags are checked
    from dschat.devices import pick_device, resolve_dtype
    from dschat.generation.backends import make_backend
    from dschat.generation.sampler import SAMPLER_RANK, SamplerServer
    from dschat.models.loading import create_causal_lm, load_tokenizer, resolve_saved_model

    if threads:
        torch.set_num_threads(threads)
    dev = pick_device(device)
    if dev.type == "cuda":  # the link, its NCCL communicator and any seeding are on the sampler's own GPU
        torch.cuda.set_device(dev)
    path = resolve_saved_model(model)
    module = create_causal_lm(path, dtype=resolve_dtype(cfg.model.dtype, dev),
                              trust_remote_code=cfg.model.trust_remote_code).to(dev).eval()
    backend = make_backend(cfg.rl.generation_backend, module)
    print(f"[sampler] {path} on {dev}, sampling on {backend.name}; listening at {host}:{port}", file=sys.stderr,
          flush=True)
    link = E.Link(host, port, SAMPLER_RANK, 2, timeout, cuda=dev.type == "cuda", hosts=True)
    server = SamplerServer(link, module, backend, tokenizer=load_tokenizer(path, cfg.model.trust_remote_code))
    try:
        server.serve()
    finally:
        server.close()
        backend.close()
