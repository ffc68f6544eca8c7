"""``dschat sampler``: a policy in a process of its own, answering a trainer's batches of prompts and taking its
weight updates over the weight plane (``dschat.generation.sampler``).

    DSCHAT_SAMPLER_TOKEN=... dschat sampler --model output/step1_sft/model --listen 10.0.0.5:29700   # its host

It listens at exactly ``--listen`` until a trainer that proves the shared secret connects, then serves it until the
trainer says stop (exit 0) or is gone (one line, exit 2).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any

import click

from dschat.cli.options import DeclaredFlagsCommand, declared_config, given_flags
from dschat.config import VLLM_ENGINE_FLAGS, ModelArgs, VLLMArgs, backend_help, piece
from dschat.errors import UserError
from dschat.utils import address


@functools.cache
def sampler_flags() -> type:
    """``SamplerFlags``: the model, backend and vLLM engine flags a sampler shares with stage 3, from their
    declarations; the vLLM ones refused unless vLLM samples."""
    from dschat.rlhf.config import RLArgs, vllm_inert

    def inert_flags(self: Any) -> dict[str, str]:
        return {k: v for k, v in vllm_inert(self.rl.generation_backend, with_training=True).items()
                if k in VLLM_ENGINE_FLAGS}

    return dataclasses.make_dataclass("SamplerFlags", [
        ("model", ModelArgs, piece(ModelArgs, only=("dtype", "trust_remote_code"))),
        ("rl", RLArgs, piece(RLArgs, only=("generation_backend",),
                             help={"generation_backend": backend_help("dschat")})),
        ("vllm", VLLMArgs, piece(VLLMArgs, only=VLLM_ENGINE_FLAGS)),
    ], namespace={"inert_flags": inert_flags})


@click.command("sampler", cls=DeclaredFlagsCommand, flags=sampler_flags, context_settings={"max_content_width": 110})
@click.option("--model", required=True, help="The policy to start from: a folder, an HF id in the cache, an alias or "
                                             "the preset 'tiny'; the trainer's updates replace its weights.")
@click.option("--listen", required=True, help="HOST:PORT this sampler listens at (exactly that address) until its "
                                             "trainer connects.")
@click.option("--token-file", default="", help="File holding the secret this sampler and its trainer share (default: "
                                              "$DSCHAT_SAMPLER_TOKEN); a peer that cannot prove it is refused.")
@click.option("--device", default="auto", show_default=True,
              help="auto = CUDA when available, else CPU; or e.g. cpu, cuda:1.")
@click.option("--timeout", type=click.FloatRange(min=1), default=600.0, show_default=True,
              help="Seconds to wait for the trainer (to connect, and for each message): past it, exit with one line.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads for sampling (default: torch's, one per core this process may use).")
@click.option("--cpus", default="", help="Run on these CPU cores alone, e.g. 1 or 2-3,6 (Linux).")
def sampler_command(model: str, listen: str, token_file: str, device: str, timeout: float, threads: int | None,
                    cpus: str, **declared: Any) -> None:
    """Hold a policy on its own devices and answer a trainer's batches of prompts."""
    from dschat.generation.channel import load_secret

    cfg = declared_config(sampler_flags(), declared, given_flags())
    host, port = address(listen)
    secret = load_secret(token_file)
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

    from dschat.devices import pick_device, resolve_dtype
    from dschat.generation.sampler import serve_sampler
    from dschat.models.loading import resolve_saved_model

    if threads:
        torch.set_num_threads(threads)
    dev = pick_device(device)
    if dev.type == "cuda":  # its weight group and any seeding on the sampler's own GPU
        torch.cuda.set_device(dev)
    serve_sampler(resolve_saved_model(model), (host, port), secret, timeout, cfg.rl.generation_backend, dev,
                  resolve_dtype(cfg.model.dtype, dev), cfg.vllm, cfg.model.trust_remote_code,
                  lambda line: print(f"[sampler] {line}", file=sys.stderr, flush=True))
