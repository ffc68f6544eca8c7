"""Sampling answers: the one decode loop behind every caller that generates (stage 3's rollouts and evaluation,
``dschat generate``, ``dschat eval``, ``dschat chat``, the generative judge).

A backend turns left-padded prompts ``(B, P)`` into ``Generated``: the sequences ``(B, P + A)`` (A <= the token
budget; the loop stops as soon as every row has ended) and, where the backend computes them, the log-prob of
every sampled token under the tempered full-vocabulary distribution (what ``rollout.answer_logprobs`` computes
with a forward pass, so PPO can take its old log-probs from here instead of a second actor forward).

Backends (``--generation-backend``):

* ``dschat``: our decode loop. Prefill once (rows repeating a prompt share one prompt forward), then one forward
  per token into a KV cache that is allocated once for the whole answer budget (no per-token concatenation),
  sampling in the loop (``dschat.generation.sampling``: temperature, top-k, top-p in the order HF applies them),
  stopping when every row has produced EOS. For Llama-architecture models (llama, mistral, qwen2 and other
  configs with the same layer layout) the per-token forward is ``dschat.generation.lean_llama.LeanLlama`` over the
  model's own weights; on CUDA its step has constant shapes (the whole cache width, masked). Any other model, or
  one whose layers are wrapped (LoRA), runs the same loop through its HF ``forward`` with a ``DynamicCache``.
* ``graph``: the same loop with the lean step captured as a CUDA graph per (batch, cache width) bucket and
  replayed per token (``dschat.generation.graphs``); ``auto``'s choice on CUDA without vLLM.
* ``compiled``: the same loop with the lean step compiled by ``torch.compile`` (static shapes within a call, the
  cache in 64-column buckets; the first call compiles). The fused kernels round differently from the eager ones,
  so samples may differ from ``hf``'s in rare near-ties.
* ``hf``: ``model.generate`` (HF's loop; no log-probs).
* ``vllm``: a colocated vLLM engine (``dschat.generation.vllm_engine``), which holds its own copy of the weights.

Greedy decoding gives the same tokens as HF ``generate`` (tested). Every backend meets one contract, ``Backend``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dschat.data.packing import prompt_ids
from dschat.generation.graphs import BATCH_BUCKET, STOP_CHECK_EVERY, WIDTH_BUCKET, GraphCache, bucket
from dschat.generation.lean_llama import LEAN_MODEL_TYPES, LeanLlama
from dschat.generation.sampling import (
    GenerationConfig,
    SamplingFlags,
    next_token,
    penalize_repeats,
    token_logprobs,
)

__all__ = ["LEAN_MODEL_TYPES", "Backend", "DschatBackend", "GenerationConfig", "Generated", "HFBackend",
           "HFForward", "SamplingFlags", "decode_answers"]


@dataclass
class Generated:
    sequences: torch.Tensor  # (B, P + A): prompts as given, then the answers (pad after each row's EOS)
    logprobs: torch.Tensor | None = None  # (B, A) float32 log-prob of each answer token (0 after EOS)
    # (B, A) float32: a serving engine's own log-probs of the answer tokens (vLLM: under the distribution it sampled
    # from), for the importance-sampling correction; never used as the trainer's log-probs
    engine_logprobs: torch.Tensor | None = None
    # episodes (``config.episodes``): (B, A) bool, the policy's own tokens, and the tokens fed at all (policy, tool
    # results and observations; not the masked columns of a row waiting on a tool, nor what follows its end)
    policy_mask: torch.Tensor | None = None
    real_mask: torch.Tensor | None = None


class Backend(Protocol):
    """What the hybrid engine calls on whatever samples. The hybrid engine, not the backend, decides when weights
    sync: before sampling from a backend that ``owns_weights`` it calls ``sync``; backends that sample from the
    module's own weights have nothing to sync."""

    name: str
    owns_weights: bool  # holds its own copy of the weights (vLLM): no ZeRO-3 gather around generate, a sync instead
    # what the last sync measured, for the step's metrics; the hybrid engine empties it once read
    last: dict[str, float]

    def generate(self, module: torch.nn.Module, prompt: torch.Tensor, prompt_mask: torch.Tensor,
                 config: GenerationConfig, eos_token_id: int | list[int], pad_token_id: int) -> Generated: ...

    def sync(self, module: torch.nn.Module, engine: Any = None, batch: int = 1, total: int = 64) -> dict[str, float]:
        """Bring the backend's weights to ``module``'s (every rank calls it); what it measured."""
        ...

    def release(self) -> None:
        """At the end of a generate phase: give memory back to training (vLLM's sleep, dschat's captured graphs
        and their KV caches); a no-op where nothing is held."""
        ...

    def close(self) -> None:
        """Free what the backend holds (an engine, captured graphs); it may be used again only after ``sync``."""
        ...


class OwnWeights:
    """The ``Backend`` members of a backend that samples from the module's own weights: nothing to sync or give
    back."""

    owns_weights = False

    def __init__(self) -> None:
        self.last: dict[str, float] = {}

    def sync(self, module: torch.nn.Module, engine: Any = None, batch: int = 1, total: int = 64) -> dict[str, float]:
        return {}

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


def decode_answers(tokenizer: Any, answers: torch.Tensor) -> tuple[list[str], list[int]]:
    """Answers ``(B, A)`` (the sampled columns, padding after an EOS) as text, each cut at its first EOS with
    special tokens dropped (what reward functions and judges read), and each answer's length in tokens, its EOS
    included (an answer that never ended counts all ``A``)."""
    answers = answers.cpu()
    is_eos = answers == tokenizer.eos_token_id
    ended = is_eos.any(-1)
    first_eos = torch.where(ended, is_eos.long().argmax(-1), torch.full_like(answers[:, 0], answers.shape[1]))
    texts = tokenizer.batch_decode([row[:n] for row, n in zip(answers, first_eos.tolist(), strict=True)],
                                   skip_special_tokens=True)
    return texts, torch.where(ended, first_eos + 1, first_eos).tolist()



_compiled_step: Any = None


def compiled_step() -> Any:
    """``LeanLlama.step`` through ``torch.compile``, made once per process (its compiled graphs are cached by the
    shapes they were made for)."""
    global _compiled_step
    if _compiled_step is None:
        _compiled_step = torch.compile(LeanLlama.step)
    return _compiled_step


class HFForward:
    """The same contract through the model's own ``forward`` and a ``DynamicCache`` (any causal LM)."""

    def __init__(self, model: torch.nn.Module, batch: int, total: int):
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.mask = torch.zeros(batch, 0, dtype=torch.long, device=next(model.parameters()).device)
        # only the last position's logits when the model can skip the rest (a prefill over a large vocabulary)
        self.keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, real.long()], dim=1)
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=positions, past_key_values=self.cache,
                         use_cache=True, **self.keep)
        return out.logits[:, -1].float()


def _eos_ids(eos_token_id: int | list[int], device: torch.device) -> torch.Tensor:
    ids = eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
    return torch.tensor(list(ids), device=device)


class DschatBackend(OwnWeights):
    """Our decode loop (``dschat``), with its lean step compiled (``compiled``) or captured as CUDA graphs
    (``graph``). ``constant_shapes`` (None: on CUDA) runs the eager lean step over the whole cache width;
    ``capture`` (None: on CUDA) whether ``graph`` really captures (off, its static-buffer step runs eagerly);
    ``stop_check_every`` how many tokens pass between the host's looks at whether every row has ended."""

    name = "dschat"

    def __init__(self, lean: bool = True, compiled: bool = False, graph: bool = False,
                 constant_shapes: bool | None = None, capture: bool | None = None,
                 stop_check_every: int | None = None):
        super().__init__()
        if compiled and graph:
            raise ValueError("one of compiled and graph")
        self.lean, self.compiled, self.constant_shapes = lean, compiled, constant_shapes
        self.stop_check_every = stop_check_every  # None: every token on a CPU, STOP_CHECK_EVERY on CUDA
        self.graphs = GraphCache(capture) if graph else None
        if compiled:
            self.name = "compiled"
        if graph:
            self.name = "graph"

    def release(self) -> None:
        """The end of a generate phase: the captured graphs and their KV caches are freed (CUDA's cached blocks
        with them), so training has that memory; the next generation captures again (``GraphCache.release``)."""
        if self.graphs is not None:
            self.graphs.release()

    def close(self) -> None:
        self.release()

    def _lean_or_refuse(self, module: torch.nn.Module, total: int) -> None:
        ok, why = LeanLlama.supported(module, total)
        if not ok:
            from dschat.errors import UserError

            raise UserError(f"--generation-backend {self.name} needs a Llama-architecture model (llama, mistral, "
                            f"qwen2 layouts) without wrapped layers; this one has {why}: use dschat")

    def decoder(self, module: torch.nn.Module, batch: int, total: int) -> LeanLlama | HFForward:
        if self.compiled:
            self._lean_or_refuse(module, total)
            return LeanLlama(module, batch, -(-total // 64) * 64)  # 64-column buckets: few shapes to compile
        if self.lean and LeanLlama.supported(module, total)[0]:
            return LeanLlama(module, batch, total)
        return HFForward(module, batch, total)

    def prefill(self, dec: LeanLlama | HFForward, module: torch.nn.Module, prompt: torch.Tensor,
                positions: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
        """The prompts' forward into ``dec``'s cache; the last position's logits. Rows that repeat a prompt (a
        GRPO group's completions, ``--num-generations`` per prompt) share one forward: the distinct prompts run
        through a decoder of their own, whose cache rows are then copied to every row that repeats them (the
        prompt's prefix cached once, as serving engines do), so the prefill costs about as much as the distinct
        prompts alone. Lean decoders only."""
        if not isinstance(dec, LeanLlama):
            return dec.forward(prompt, positions, prompt_mask)
        rows = prompt_ids(prompt, prompt_mask)
        distinct = int(rows.max()) + 1
        if distinct == len(prompt):
            return dec.forward(prompt, positions, prompt_mask)
        first = torch.empty(distinct, dtype=torch.long, device=prompt.device)
        first[rows] = torch.arange(len(prompt), device=prompt.device)  # one row of each distinct prompt
        own = LeanLlama(module, distinct, prompt.shape[1])  # a cache just wide enough for the prompts
        logits = own.forward(prompt[first], positions[first], prompt_mask[first])
        dec.adopt(own, rows)
        return logits[rows]

    @torch.no_grad()
    def generate(self, module: torch.nn.Module, prompt: torch.Tensor, prompt_mask: torch.Tensor,
                 config: GenerationConfig, eos_token_id: int | list[int], pad_token_id: int) -> Generated:
        try:
            return self._generate(module, prompt, prompt_mask, config, eos_token_id, pad_token_id)
        except BaseException:
            self.release()  # a caller that retries on halves after an OOM starts with nothing held
            raise

    def _generate(self, module: torch.nn.Module, prompt: torch.Tensor, prompt_mask: torch.Tensor,
                  config: GenerationConfig, eos_token_id: int | list[int], pad_token_id: int) -> Generated:
        B, P = prompt.shape
        N = config.max_new_tokens
        device = prompt.device
        positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
        step = None
        # graphs: the cache's batch is a bucket; its spare rows repeat the last prompt (one more row of the shared
        # prefill) and then run along unread, so the loop samples the real rows alone (the same draws as without
        # padding). A model the lean step cannot run at this length (config-time checks refuse the others)
        # decodes through the plain loop.
        episodes = config.episodes
        if episodes is not None:  # rows advance on their own: the eager step, which takes a mask per row
            return self._episodes(module, prompt, prompt_mask, config, episodes, pad_token_id)
        if self.graphs is not None and LeanLlama.supported(module, P + N)[0]:
            rows = bucket(B, BATCH_BUCKET)
            step = self.graphs.get(module, rows, bucket(P + N, WIDTH_BUCKET))
            dec: LeanLlama | HFForward = step.dec
            spare = rows - B
            full, full_mask = prompt, prompt_mask
            if spare:
                full = torch.cat([prompt, prompt[-1:].expand(spare, P)])
                full_mask = torch.cat([prompt_mask, prompt_mask[-1:].expand(spare, P)])
            logits = self.prefill(dec, module, full, (full_mask.long().cumsum(-1) - 1).clamp(min=0), full_mask)[:B]
        else:
            dec = self.decoder(module, B, P + N)
            logits = self.prefill(dec, module, prompt, positions, prompt_mask)
        constant = isinstance(dec, LeanLlama) and not self.compiled and step is None and (
            device.type == "cuda" if self.constant_shapes is None else self.constant_shapes)
        eos = _eos_ids(eos_token_id, device)
        keys = dec.keys.clone() if self.compiled else None  # the compiled step's cache mask, passed along
        columns = torch.arange(P, P + N, device=device)  # the cache column of each answer token
        position = positions[:, -1:] + 1
        done = torch.zeros(B, dtype=torch.bool, device=device)
        tokens, logps, ended = [], [], []
        ones = torch.ones(B, 1, dtype=torch.bool, device=device)
        # the host looks at "has every row ended" each token on a CPU or for a streaming hook; on CUDA every few
        # tokens (each look waits for the GPU), and the steps past the end are cut below
        every = self.stop_check_every or (1 if device.type != "cuda" else STOP_CHECK_EVERY)
        if config.on_token is not None:
            every = 1
        seen = None
        if config.repetition_penalty != 1.0:  # (B, V): the tokens of each row so far
            seen = torch.zeros(B, logits.shape[-1], dtype=torch.bool, device=device)
            real = prompt_mask.bool()
            seen[torch.arange(B, device=device)[:, None].expand_as(prompt)[real], prompt[real]] = True
        for t in range(N):
            if seen is not None:
                logits = penalize_repeats(logits, seen, config.repetition_penalty)
            tok = next_token(logits, config)
            if config.logprobs:  # 0 after a row has ended
                logps.append(token_logprobs(logits, tok, config.temperature).masked_fill(done, 0.0))
            if t:  # before the first token no row has ended
                tok = tok.masked_fill(done, pad_token_id)
            tokens.append(tok)
            done = done | (tok == eos[0] if eos.numel() == 1 else torch.isin(tok, eos))
            if every > 1:
                ended.append(done.all())
            if seen is not None:
                seen.scatter_(1, tok[:, None], True)
            stop = config.on_token is not None and config.on_token(tok)  # every token, the last one too
            if t == N - 1 or stop or ((t + 1) % every == 0 and bool(done.all())):
                break
            column = columns[t:t + 1]
            if step is not None:
                logits = step(tok[:, None], position[:, 0], column)
            elif self.compiled:
                assert isinstance(dec, LeanLlama)
                logits, keys = compiled_step()(dec, tok[:, None], position[:, 0], column, keys)
            elif constant:
                assert isinstance(dec, LeanLlama)
                logits, dec.keys = dec.step(tok[:, None], position[:, 0], column, dec.keys, dec.products(1))
            else:
                logits = dec.forward(tok[:, None], position, ones)
            position = position + 1
        if ended:  # where the eager loop would have stopped: the first step after which every row had ended
            flags = torch.stack(ended)
            if bool(flags.any()):
                last = int(flags.int().argmax()) + 1
                tokens, logps = tokens[:last], logps[:last]
        answer = torch.stack(tokens, dim=1)
        return Generated(torch.cat([prompt, answer], dim=1), torch.stack(logps, dim=1) if logps else None)


    def _episodes(self, module: torch.nn.Module, prompt: torch.Tensor, prompt_mask: torch.Tensor,
                  config: GenerationConfig, episodes: Any, pad_token_id: int) -> Generated:
        """The loop for a batch of episodes (``dschat.agents.episode``): each step ``episodes.advance`` keeps,
        replaces (a tool's result, an observation) or masks (a row waiting on a tool) each row's sampled token,
        and says which rows are done; a masked column is fed with its key hidden and its position not advanced,
        so every row's cache stays its own sequence. The eager step (plain or HF forward) whatever the backend's
        kind: a captured or compiled step has one position and one column for the whole batch."""
        B, P = prompt.shape
        N = config.max_new_tokens
        positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
        dec = LeanLlama(module, B, P + N) if self.lean and LeanLlama.supported(module, P + N)[0] \
            else HFForward(module, B, P + N)
        logits = self.prefill(dec, module, prompt, positions, prompt_mask)
        position = positions[:, -1:] + 1
        tokens, logps, policies, reals = [], [], [], []
        episodes.start()
        for t in range(N):
            tok, real, policy, done = episodes.advance(next_token(logits, config))
            if config.logprobs:
                logps.append(token_logprobs(logits, tok, config.temperature).masked_fill(~policy, 0.0))
            tokens.append(tok)
            policies.append(policy)
            reals.append(real)
            if t == N - 1 or bool(done.all()):
                break
            logits = dec.forward(tok[:, None], position, real[:, None])
            position = position + real[:, None].long()
        answer = torch.stack(tokens, dim=1)
        return Generated(torch.cat([prompt, answer], dim=1), torch.stack(logps, dim=1) if logps else None,
                         policy_mask=torch.stack(policies, dim=1), real_mask=torch.stack(reals, dim=1))


class HFBackend(OwnWeights):
    name = "hf"

    @torch.no_grad()
    def generate(self, module: torch.nn.Module, prompt: torch.Tensor, prompt_mask: torch.Tensor,
                 config: GenerationConfig, eos_token_id: int | list[int], pad_token_id: int) -> Generated:
        kwargs: dict[str, Any] = {"attention_mask": prompt_mask, "max_new_tokens": config.max_new_tokens,
                                  "do_sample": config.do_sample, "pad_token_id": pad_token_id,
                                  "eos_token_id": eos_token_id, "use_cache": True}
        if config.do_sample:
            kwargs.update(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k)
        else:  # neutral sampling knobs: greedy ignores them, and transformers warns when a model's config sets them
            kwargs.update(temperature=1.0, top_p=1.0, top_k=0)
        if config.repetition_penalty != 1.0:
            kwargs["repetition_penalty"] = config.repetition_penalty
        if config.on_token is not None:
            kwargs["stopping_criteria"] = _stop_when(config.on_token)
        return Generated(module.generate(prompt, **kwargs))


def _stop_when(on_token: Callable[[torch.Tensor], bool]) -> Any:
    """``on_token`` as HF ``generate``'s stopping criterion: called after each step with the newest tokens."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class OnToken(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            stop = bool(on_token(input_ids[:, -1]))
            return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([OnToken()])

