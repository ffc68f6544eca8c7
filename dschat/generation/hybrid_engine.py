"""The hybrid engine: one object that flips the actor between training and fast generation (docs/algorithms.md, PPO).

What samples, chosen once when the engine is made; every path goes through the one entry,
``dschat.generation.backends.generate``:

* DeepSpeed's own hybrid engine (``--enable-hybrid-engine``), which swaps in CUDA inference kernels. It exists
  only on CUDA for supported architectures; elsewhere dschat says so once and uses the fallback.
* vLLM (``--generation-backend vllm``, or ``auto`` on a GPU with vLLM installed): a colocated engine that holds its
  own copy of the weights, pushed and checked after every optimizer step (``dschat.generation.vllm_engine``).
* The fallback, correct everywhere: eval mode (no dropout) and a KV-cache decode loop (``dschat.generation.decode``:
  dschat's own loop by default, or HF ``generate``) on the actor's module, with ZeRO-3 parameters gathered once
  for the whole call (a per-token gather would cost a collective per layer per token), then back to training
  mode.

Stage 3 calls ``release`` at the end of every generate phase (each training rollout, each evaluation), before
scoring and training: the backend's memory goes back (the CUDA-graph captures and their KV caches). What the
captures cost is reported with the step's metrics (``sync_metrics``).
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import TYPE_CHECKING, Any

import torch

from dschat import engine as E
from dschat.devices import forked_rng
from dschat.generation.backends import generate, make_backend
from dschat.generation.decode import Backend, Generated, GenerationConfig, HFBackend, OnToken, Prompts

if TYPE_CHECKING:
    from dschat.agents.agent import Agent
    from dschat.agents.episode import Episodes


def deepspeed_hybrid_supported(model: torch.nn.Module) -> tuple[bool, str]:
    """Whether DeepSpeed's hybrid engine can run this actor here, and why not."""
    if not torch.cuda.is_available():
        return False, "DeepSpeed's hybrid engine needs CUDA inference kernels (none on CPU)"
    supported = ("llama", "opt", "bloom", "gpt_neox", "gptj", "gpt2", "mistral", "qwen2")
    kind = getattr(getattr(model, "config", None), "model_type", "")
    if kind not in supported:
        return False, f"DeepSpeed's hybrid engine has no kernels for model_type {kind!r}"
    return True, ""


class HybridEngine:
    """Wraps the actor engine: ``sample`` in inference mode, training everywhere else. ``agent`` is the run's tools
    and environments (``dschat.agents.agent.Agent``; None without): with one, ``dschat.rlhf.rollout`` samples every
    batch as episodes."""

    behaviour = "vllm"  # what samples when its log-probs differ from the trainer's (a serving engine)

    def __init__(self, actor: Any, pad_token_id: int, eos_token_id: int, use_deepspeed: bool = False,
                 backend: str | Backend = "auto", vllm: Any = None, max_model_len: int | None = None,
                 agent: Agent | None = None):
        self.actor = actor
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.use_deepspeed = use_deepspeed
        self.agent = agent
        self.backend = (make_backend(backend, E.unwrap(actor), vllm, max_model_len) if isinstance(backend, str)
                        else backend)
        # what samples: DeepSpeed's engine has its own generate with HF's signature, over its own kernels
        self.sampler: Backend = HFBackend() if use_deepspeed else self.backend
        self.last_generate_seconds = 0.0
        self._said_capture = False
        self._counted = (0, 0.0)  # the graph cache's captures and their seconds when last reported

    def sync_metrics(self) -> dict[str, float]:
        """What the backend measured since the last call, once: a weight sync (vLLM: ``sync/max_logprob_diff``,
        ``time/sync_s``) and the CUDA-graph captures (``capture_metrics``); empty when nothing was measured."""
        out = dict(self.backend.last)
        self.backend.last.clear()
        out.update(self.capture_metrics())
        return out

    def capture_metrics(self) -> dict[str, float]:
        """The CUDA-graph captures made since the last call: ``generation/graph_captures`` and their seconds,
        ``generation/graph_capture_s`` (zero when every generation replayed a capture). Empty for a backend that
        captures nothing, or when DeepSpeed's hybrid engine samples instead."""
        graphs = getattr(self.sampler, "graphs", None)
        if graphs is None:
            return {}
        out = {"generation/graph_captures": float(graphs.captures - self._counted[0]),
               "generation/graph_capture_s": graphs.capture_seconds - self._counted[1]}
        self._counted = (graphs.captures, graphs.capture_seconds)
        return out

    def release(self) -> None:
        """End a generate phase: the backend gives its memory back before anything else runs (dschat's captured
        graphs and their KV caches; vLLM is put to sleep after every sample already). Stage 3 calls it after each
        training rollout, before the scores, the experience forwards and training, and after each evaluation;
        the next generation captures again."""
        if not self.backend.caps.owns_weights:
            self.backend.release()

    def close(self) -> None:
        """Free what the backend holds (vLLM's engine, before torch.distributed is torn down; captured graphs)."""
        self.backend.close()

    @property
    def module(self) -> torch.nn.Module:
        return E.unwrap(self.actor)

    @torch.no_grad()
    def sample(self, prompt: torch.Tensor, prompt_mask: torch.Tensor, config: GenerationConfig,
               generator_seed: int | None = None, *, episodes: Episodes | None = None,
               on_token: OnToken | None = None) -> Generated:
        """Sample answers for left-padded prompts ``(B, P)`` through the entry (``backends.generate``): sequences
        ``(B, P + A)`` (A <= max_new_tokens) and, with ``config.logprobs``, when the backend computes them and the
        actor runs in float32, each answer token's log-prob. (In fp32 the KV-cache log-probs equal a full
        forward's to ~1e-6; in half precision they are left to the forward.) A seeded sample (evaluation) draws its
        own random stream and leaves training's where it was, CPU and CUDA alike."""
        t0 = time.time()
        module = self.module
        was_training = module.training
        graphs = getattr(self.sampler, "graphs", None)
        captures = graphs.captures if graphs is not None else 0
        prompts = Prompts(prompt, prompt_mask, self.eos_token_id, self.pad_token_id)
        try:
            with forked_rng(generator_seed) if generator_seed is not None else contextlib.nullcontext(), \
                    self._inference():
                out = generate(self.sampler, self.actor if self.use_deepspeed else module, prompts, config,
                               episodes=episodes, on_token=on_token, engine=self.actor)
        finally:
            if was_training:
                (self.actor if self.use_deepspeed else module).train()
        if out.logprobs is not None and next(module.parameters()).dtype != torch.float32:
            out.logprobs = None
        self.last_generate_seconds = time.time() - t0
        if graphs is not None and graphs.captures > captures and not self._said_capture and E.is_main():
            self._said_capture = True  # once: the figures of every later capture are in the step's metrics
            print(f"[generation] token step captured as a CUDA graph for {prompt.shape[0]} rows in "
                  f"{graphs.capture_seconds:.2f} s and replayed per token; freed at the end of each generate phase "
                  "and captured again at the next (generation/graph_captures, generation/graph_capture_s)",
                  file=sys.stderr)
        return out

    @contextlib.contextmanager
    def _inference(self) -> Any:
        """The actor as its sampler reads it: DeepSpeed's engine in eval mode; the module in eval mode with its
        ZeRO-3 parameters gathered once for the whole call (the engine's prefetches settle first); nothing for a
        backend with its own copy (its sync reads the module)."""
        if self.use_deepspeed:
            self.actor.eval()
            yield
        elif self.sampler.caps.owns_weights:
            yield
        else:
            self.module.eval()
            with E.gathered_parameters(self.actor):
                yield

    def generate(self, prompt: torch.Tensor, prompt_mask: torch.Tensor, config: GenerationConfig,
                 generator_seed: int | None = None) -> torch.Tensor:
        """The sequences of ``sample``."""
        return self.sample(prompt, prompt_mask, config, generator_seed).sequences


def make_hybrid_engine(actor: Any, tokenizer: Any, requested: bool, backend: str = "auto", vllm: Any = None,
                       max_model_len: int | None = None, agent: Agent | None = None) -> HybridEngine:
    """The generation path for ``actor``: DeepSpeed's hybrid engine when ``requested`` and supported, else the
    ``backend`` (``vllm`` its ``VLLMArgs``; ``max_model_len`` the longest prompt plus answer, for vLLM); ``agent``
    the run's tools and environments, if any."""
    use = False
    if requested:
        ok, why = deepspeed_hybrid_supported(E.unwrap(actor))
        use = ok and E.is_hybrid_engine(actor)
        if not use and E.is_main():
            print(f"[hybrid engine] {why or 'actor engine was not built as a hybrid engine'}; "
                  "using eval-mode KV-cache generation with one ZeRO-3 gather per call", file=sys.stderr)
    return HybridEngine(actor, tokenizer.pad_token_id, tokenizer.eos_token_id, use_deepspeed=use, backend=backend,
                        vllm=vllm, max_model_len=max_model_len, agent=agent)
