"""Choosing what samples: ``--generation-backend`` names (``BACKENDS``), ``auto``'s choice, and the backend
objects (``dschat.generation.decode``'s loops and HF ``generate``; ``dschat.generation.vllm_engine``'s engine)."""

from __future__ import annotations

from typing import Any

import torch

from dschat.config import BACKENDS
from dschat.generation.decode import Backend, DschatBackend, HFBackend
from dschat.generation.vllm_engine import VLLMBackend, supports


def resolve_backend(name: str, module: torch.nn.Module | None = None, fallback: str = "dschat") -> str:
    """``auto``: vLLM on a GPU where it is installed and runs the model's architecture, else ``fallback`` (our
    loop: on a CPU it is the faster one at small sizes, docs/benchmarks.md; ``dschat chat`` and the judge fall back
    to HF ``generate``, which reads the model's own generation config). Any other name is itself."""
    if name != "auto":
        return name
    if torch.cuda.is_available() and module is not None:
        if supports(module)[0]:
            return "vllm"
    return fallback


def make_backend(name: str, module: torch.nn.Module | None = None, vllm: Any = None,
                 max_model_len: int | None = None, fallback: str = "dschat") -> Backend:
    """``auto`` (``resolve_backend``), ``vllm`` (a colocated vLLM engine with checked weight sync, ``vllm`` its
    ``VLLMArgs``), ``dschat`` our loop, ``compiled`` the same with its per-token step compiled; ``hf`` is
    transformers' ``generate``."""
    if name not in BACKENDS:
        raise ValueError(f"unknown generation backend {name!r}; choose one of {', '.join(BACKENDS)}")
    name = resolve_backend(name, module, fallback)
    if name == "vllm":
        return VLLMBackend(vllm, max_model_len=max_model_len)  # type: ignore[return-value]
    return HFBackend() if name == "hf" else DschatBackend(compiled=name == "compiled")
