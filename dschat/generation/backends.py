"""Choosing what samples: ``--generation-backend`` names (``BACKENDS``), ``auto``'s choice, and the backend
objects (``dschat.generation.decode``'s loops and HF ``generate``; ``dschat.generation.vllm_engine``'s engine).

What ``auto`` picks (docs/speed.md has the figures behind it):

| machine | ``auto`` |
|---|---|
| CUDA with vLLM installed and the architecture supported | ``vllm`` |
| CUDA otherwise, Llama-architecture model without wrapped layers | ``graph`` (captured token step) |
| CUDA otherwise (other architectures, LoRA) | the fallback (``dschat``: the loop over the model's forward) |
| CPU | the fallback (``dschat``; ``hf`` for ``dschat chat`` and the judge) |
"""

from __future__ import annotations

from typing import Any

import torch

from dschat.config import BACKENDS
from dschat.errors import UserError
from dschat.generation.decode import Backend, DschatBackend, Generated, GenerationConfig, HFBackend
from dschat.generation.lean_llama import LeanLlama
from dschat.generation.vllm_engine import VLLMBackend, supports


def resolve_backend(name: str, module: torch.nn.Module | None = None, fallback: str = "dschat") -> str:
    """``auto``: vLLM on a GPU where it is installed and runs the model's architecture; else on a GPU the captured
    step where the lean decoder runs the model; else ``fallback`` (our loop: on a CPU it is the faster one at small
    sizes, docs/benchmarks.md; ``dschat chat`` and the judge fall back to HF ``generate``, which reads the model's
    own generation config). Any other name is itself."""
    if name != "auto":
        return name
    if torch.cuda.is_available() and module is not None:
        if supports(module)[0]:
            return "vllm"
        if LeanLlama.supported(module, 0)[0]:
            return "graph"
    return fallback


def make_backend(name: str, module: torch.nn.Module | None = None, vllm: Any = None,
                 max_model_len: int | None = None, fallback: str = "dschat") -> Backend:
    """``auto`` (``resolve_backend``), ``vllm`` (a colocated vLLM engine with checked weight sync, ``vllm`` its
    ``VLLMArgs``), ``dschat`` our loop, ``compiled`` the same with its per-token step compiled, ``graph`` with it
    captured as a CUDA graph (CUDA only); ``hf`` is transformers' ``generate``."""
    if name not in BACKENDS:
        raise ValueError(f"unknown generation backend {name!r}; choose one of {', '.join(BACKENDS)}")
    name = resolve_backend(name, module, fallback)
    if name == "vllm":
        return VLLMBackend(vllm, max_model_len=max_model_len)  # type: ignore[return-value]
    if name == "graph":
        require_cuda_for_graph()
        return DschatBackend(graph=True)
    return HFBackend() if name == "hf" else DschatBackend(compiled=name == "compiled")


def require_cuda_for_graph() -> None:
    """The one-line refusal of ``--generation-backend graph`` where there is no CUDA device to capture on."""
    if not torch.cuda.is_available():
        raise UserError("--generation-backend graph captures the token step as a CUDA graph and needs a CUDA "
                        "device; on this machine use --generation-backend dschat (or auto)")


def generate_with(backend: Backend, module: torch.nn.Module, prompt: torch.Tensor, prompt_mask: torch.Tensor,
                  config: GenerationConfig, eos_token_id: int | list[int], pad_token_id: int,
                  engine: Any = None) -> Generated:
    """One sample from ``backend``, its weights brought to ``module``'s first where it holds its own (vLLM: a sync,
    which pushes only weights that changed since the last; ``engine`` the module's training engine, whose step
    count says when they did), and its memory given back after. The hybrid engine samples through this; so do
    the callers that sample a frozen model (``dschat chat``, the judge)."""
    if not backend.owns_weights:
        return backend.generate(module, prompt, prompt_mask, config, eos_token_id, pad_token_id)
    backend.sync(module, engine, batch=prompt.shape[0], total=prompt.shape[1] + config.max_new_tokens)
    try:
        return backend.generate(module, prompt, prompt_mask, config, eos_token_id, pad_token_id)
    finally:
        backend.release()
