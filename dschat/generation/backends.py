"""Choosing what samples and sampling through it: ``--generation-backend`` names (``BACKENDS``), ``auto``'s choice,
the backend objects (``dschat.generation.decode``'s loop and HF ``generate``; ``dschat.generation.vllm_engine``'s
engine), and ``generate``, the one entry every caller samples through.

What ``auto`` picks (docs/speed.md has the figures behind it):

| machine | ``auto`` |
|---|---|
| CUDA with vLLM installed and the architecture supported | ``vllm`` |
| CUDA otherwise, Llama-architecture model without wrapped layers | ``graph`` (captured token step) |
| CUDA otherwise (other architectures, LoRA) | the fallback (``dschat``: the loop over the model's forward) |
| CPU | the fallback (``dschat``; ``hf`` for ``dschat chat`` and the judge) |
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dschat.config import BACKENDS
from dschat.errors import UserError
from dschat.generation.decode import (
    Backend,
    CompiledBackend,
    DschatBackend,
    Generated,
    GenerationConfig,
    GraphBackend,
    HFBackend,
    OnToken,
    Prompts,
)
from dschat.generation.lean_llama import LeanLlama
from dschat.generation.turns import generate_by_turns
from dschat.generation.vllm_engine import VLLMBackend, supports

if TYPE_CHECKING:
    from dschat.agents.episode import Episodes


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
        return GraphBackend()
    return {"hf": HFBackend, "compiled": CompiledBackend}.get(name, DschatBackend)()


def require_cuda_for_graph() -> None:
    """The one-line refusal of ``--generation-backend graph`` where there is no CUDA device to capture on."""
    if not torch.cuda.is_available():
        raise UserError("--generation-backend graph captures the token step as a CUDA graph and needs a CUDA "
                        "device; on this machine use --generation-backend dschat (or auto)")


def generate(backend: Backend, module: torch.nn.Module, prompts: Prompts, settings: GenerationConfig, *,
             episodes: Episodes | None = None, on_token: OnToken | None = None, engine: Any = None) -> Generated:
    """The one way into generation: every caller samples through this (stage 3's rollouts and evaluation through
    the hybrid engine, ``dschat generate``, ``dschat eval``, ``dschat chat``, the generative judge).

    ``backend`` samples ``prompts`` with ``settings`` from ``module``. Where it holds its own copy of the weights
    (``caps.owns_weights``: vLLM) they are brought to ``module``'s first (a sync pushes only what changed since the
    last; ``engine`` is the module's training engine, whose step count says when it did) and its memory is given
    back after. ``episodes`` (tools and environments, ``dschat.agents.episode.Episodes``) run where the backend
    lets them: inside dschat's loop, token by token, where it is one (``caps.token_by_token``), else turn by turn
    over whole answers (``dschat.generation.turns``). ``on_token`` sees every step (``OnToken``)."""
    B, P = prompts.ids.shape
    if backend.caps.owns_weights:
        backend.sync(module, engine, batch=B, total=P + settings.max_new_tokens)
    try:
        if episodes is not None and not backend.caps.token_by_token:
            def whole(ids: torch.Tensor, mask: torch.Tensor, config: GenerationConfig) -> Generated:
                return backend.generate(module, ids, mask, config, prompts.eos_token_id, prompts.pad_token_id)

            return generate_by_turns(whole, prompts, settings, episodes, on_token)
        return backend.generate(module, prompts.ids, prompts.mask, settings, prompts.eos_token_id,
                                prompts.pad_token_id, on_token=on_token, rows=episodes)
    finally:
        if backend.caps.owns_weights:
            backend.release()
