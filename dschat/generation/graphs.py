"""The token step captured as a CUDA graph (``--generation-backend graph``; ``auto``'s choice on CUDA without vLLM).

A decode step of a 1B model is some 700 small kernels; launched one by one from Python, the GPU waits on the CPU
between them. Captured once, the whole step replays as one launch. What a capture needs, and what this module
keeps:

* **Constant shapes.** ``LeanLlama.step`` writes one cache column and attends over the cache's whole width,
  unfilled columns masked: the same kernels at every token.
* **Tensors that stay put.** A graph replays the addresses it captured. The step's inputs (token ids, rotary
  positions, the cache column, the mask of real columns) are static buffers that each token copies into; the KV
  cache is allocated once per bucket and emptied in place (``LeanLlama.reset``) for the next batch; the weights are
  the module's own, read where they live.
* **Buckets.** A capture serves one (batch, cache width) shape: the batch is padded up to a multiple of
  ``BATCH_BUCKET`` rows and the width to a multiple of ``WIDTH_BUCKET`` columns, so the generation calls of one
  phase (an evaluation's batches, its last short batch; a chat's turns) share a few captures. They are kept
  (``GraphCache``, at most ``KEEP``) until the phase ends, or for good by a caller that never trains (``dschat
  chat``, the judge); an optimizer step updates the weights in place, which the replay reads. Weights that moved
  are caught by their addresses, and that bucket is captured again.
* **Released when the phase ends.** Each capture holds its bucket's KV cache (in bf16 at 64 rows of 384 tokens:
  0.55 GB for TinyLlama-1.1B's shape, 12 GiB for Llama-2-7B's) and its memory pool. Stage 3's hybrid engine
  releases them after each training rollout and each evaluation (``GraphCache.release``: the captures dropped,
  CUDA's cached blocks returned), so a step's scoring, experience forwards and training never run beside them and
  the plan counts them in the generate phase alone (docs/planning.md). The next call captures again, a few eager
  token steps, logged per step as ``generation/graph_captures`` and ``generation/graph_capture_s``.
* **ZeRO-3.** A ZeRO-3 gather puts the weights in new memory for every generation call, so a capture made over
  them holds for that call; since a training rollout's capture is released when the call ends anyway, a step
  captures as often as without ZeRO-3. Within an evaluation the batches' gathers may land elsewhere, and each such
  batch is captured again (the weights' addresses are part of the capture's key: never a replay over stale
  memory). No copy of the weights is made for the graph.

Sampling runs right after the replay, on the GPU (``dschat.generation.sampling``): the loop asks the host whether
every row has ended only every few tokens (``STOP_CHECK_EVERY``) and cuts the overshoot afterwards, so its output
is what the eager loop gives.

Off CUDA nothing is captured: ``CapturedStep`` runs the same static-buffer step eagerly, which is how the CPU
tests check this path.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

import torch

from dschat.generation.lean_llama import LeanLlama

BATCH_BUCKET = 8
WIDTH_BUCKET = 128
KEEP = 4  # captures kept (each holds its bucket's KV cache)
STOP_CHECK_EVERY = 8  # tokens between the host's looks at "has every row ended" on CUDA
WARMUP_STEPS = 2  # eager steps before a capture (cuBLAS handles and workspaces are made outside the graph)


def bucket(n: int, size: int) -> int:
    """``n`` rounded up to a multiple of ``size``."""
    return -(-n // size) * size


def weights_key(module: torch.nn.Module) -> tuple[int, ...]:
    """Where the module's weights live: a capture is valid while they stay there."""
    return tuple(p.data_ptr() for p in module.parameters())


class CapturedStep:
    """``LeanLlama.step`` for one decoder (one bucket) over static input buffers, captured as a CUDA graph when
    ``capture`` (else run eagerly: the same buffers, the same arithmetic)."""

    def __init__(self, dec: LeanLlama, capture: bool, pool: Any = None):
        B = dec.keys.shape[0]
        device = dec.keys.device
        self.dec = dec
        self.ids = torch.zeros(B, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(B, dtype=torch.long, device=device)
        self.column = torch.zeros(1, dtype=torch.long, device=device)
        self.logits: torch.Tensor | None = None
        self.graph: Any = None
        self.capture_seconds = 0.0
        if capture:
            self._capture(pool)

    def _run(self) -> torch.Tensor:
        logits, keys = self.dec.step(self.ids, self.positions, self.column, self.dec.keys)
        self.dec.keys.copy_(keys)  # in place: the mask is a buffer the graph reads back at the next token
        return logits

    def _capture(self, pool: Any) -> None:
        t0 = time.perf_counter()
        self.column.fill_(self.dec.keys.shape[1] - 1)  # warm-up writes land in the last column, then are forgotten
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self._run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread-local: another thread's CUDA work during the capture (the courier sending a weight update to a
        # sampler, on a stream of its own) neither joins this graph nor fails it, as the global mode would make it
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            self.logits = self._run()
        torch.cuda.synchronize()
        self.graph = graph
        self.dec.reset()
        self.capture_seconds = time.perf_counter() - t0

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
        """The next logits (n, V) for tokens ``ids`` (n, 1) at ``positions`` (n,) written to ``column`` (1,): the
        first n rows of the bucket (the spare rows keep their last token and position, and their answers are never
        read). On CUDA the returned tensor is a view of the graph's own output, overwritten by the next call."""
        n = ids.shape[0]
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(positions)
        self.column.copy_(column)
        if self.graph is None:
            return self._run()[:n]
        self.graph.replay()
        assert self.logits is not None
        return self.logits[:n]


class GraphCache:
    """The captured steps of one backend, by (module, batch bucket, width bucket, dtype), most recent last; a
    capture whose weights moved is made again. ``captures`` and ``capture_seconds`` count what it cost over the
    cache's life (the hybrid engine reports them per step)."""

    def __init__(self, capture: bool | None = None):
        self.capture = torch.cuda.is_available() if capture is None else capture
        self.steps: OrderedDict[tuple[Any, ...], tuple[tuple[int, ...], CapturedStep]] = OrderedDict()
        self.pool: Any = None
        self.captures = 0
        self.capture_seconds = 0.0

    def get(self, module: torch.nn.Module, batch: int, width: int) -> CapturedStep:
        """A step for ``batch`` rows (already a bucket) and a cache ``width`` columns wide (already a bucket), its
        decoder emptied for a new batch of prompts."""
        w = module.model.embed_tokens.weight
        key = (id(module), batch, width, w.dtype, w.device)
        where = weights_key(module)
        held = self.steps.pop(key, None)
        if held is not None and held[0] == where:
            self.steps[key] = held
            held[1].dec.reset()
            return held[1]
        held = None  # a stale capture's memory goes back before the new one is made
        if self.capture and self.pool is None and torch.cuda.is_available():
            self.pool = torch.cuda.graph_pool_handle()  # one memory pool for every bucket's graph
        step = CapturedStep(LeanLlama(module, batch, width), self.capture, self.pool)
        if self.capture:
            self.captures += 1
            self.capture_seconds += step.capture_seconds
        self.steps[key] = (where, step)
        while len(self.steps) > KEEP:
            self.steps.popitem(last=False)
        return step

    def release(self) -> None:
        """Free every capture, its static KV cache and the graphs' memory pool; on CUDA the allocator's cached
        blocks go back to the device as well (a freed graph pool is reusable only once returned). Nothing to do
        when nothing is held."""
        if not self.steps and self.pool is None:
            return
        self.steps.clear()
        self.pool = None
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # no replay may still be reading what is freed
            torch.cuda.empty_cache()
