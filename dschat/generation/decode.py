"""Sampling answers: the backends behind the one entry every caller samples through
(``dschat.generation.backends.generate``), and dschat's own decode loop.

A backend turns left-padded prompts ``(B, P)`` into ``Generated``: the sequences ``(B, P + A)`` (A <= the token
budget; the loop stops as soon as every row has ended) and, where the backend computes them, the log-prob of
every sampled token under the tempered full-vocabulary distribution (what ``rollout.answer_logprobs`` computes
with a forward pass, so PPO can take its old log-probs from here instead of a second actor forward). Each backend
says what it can do (``Capabilities``), and the entry picks how episodes run from that.

Backends (``--generation-backend``):

* ``dschat``: our decode loop. Prefill once (rows repeating a prompt share one prompt forward), then one forward
  per token into a KV cache that is allocated once for the whole answer budget (no per-token concatenation),
  sampling in the loop (``dschat.generation.sampling``: temperature, top-k, top-p in the order HF applies them),
  stopping when every row has ended. For Llama-architecture models (llama, mistral, qwen2 and other configs with
  the same layer layout) the per-token forward is ``dschat.generation.lean_llama.LeanLlama`` over the model's own
  weights; on CUDA its step has constant shapes (the whole cache width, masked). Any other model, or one whose
  layers are wrapped (LoRA), runs the same loop through its HF ``forward`` with a ``DynamicCache``.
* ``graph`` (``GraphBackend``): the same loop with the lean step captured as a CUDA graph per (batch, cache width)
  bucket and replayed per token (``dschat.generation.graphs``); ``auto``'s choice on CUDA without vLLM.
* ``compiled`` (``CompiledBackend``): the same loop with the lean step compiled by ``torch.compile`` (static shapes
  within a call, the cache in 64-column buckets; the first call compiles). The fused kernels round differently
  from the eager ones, so samples may differ from ``hf``'s in rare near-ties.
* ``hf``: ``model.generate`` (HF's loop; whole answers). Its log-probs are computed afterwards from the raw
  logits HF returns per step (``output_logits``), with the repetition penalty over the tokens HF's own
  penalty counts (``hf_logprobs``).
* ``vllm``: a colocated vLLM engine (``dschat.generation.vllm_engine``), which holds its own copy of the weights.

The loop is one loop. Its token step is chosen once per call, before the first token (``Step``: graph replay,
compiled, constant-shape eager or growing eager), and its rows are run by a per-row controller it consults at
every token (``Rows``): plain rows end at EOS (``EndAtEos``); a batch of episodes
(``dschat.agents.episode.Episodes``) keeps, replaces or masks each row's token. Repetition penalty, log-probs and
the ``on_token`` hook are the loop's own, so they hold for both.

Greedy decoding gives the same tokens as HF ``generate`` (tested). Every backend meets one contract, ``Backend``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dschat.data.packing import prompt_ids
from dschat.generation.graphs import BATCH_BUCKET, STOP_CHECK_EVERY, WIDTH_BUCKET, CapturedStep, GraphCache, bucket
from dschat.generation.lean_llama import LEAN_MODEL_TYPES, LeanLlama
from dschat.generation.sampling import (
    GenerationConfig,
    SamplingFlags,
    next_token,
    penalize_repeats,
    token_logprobs,
)

__all__ = ["LEAN_MODEL_TYPES", "Backend", "Capabilities", "CompiledBackend", "DschatBackend", "EndAtEos",
           "GenerationConfig", "Generated", "GraphBackend", "HFBackend", "HFForward", "OnToken", "Prompts", "Rows",
           "SamplingFlags", "SharesWeights", "decode_answers"]

# Called after each step with the step's tokens ``(B,)`` and which of them are the policy's own samples ``(B,)``
# bool (not a tool's result or an observation fed in an episode, nor padding after a row's end); returning True
# stops every row there. ``dschat chat`` streams the text and stops at a stop string through it.
OnToken = Callable[[torch.Tensor, torch.Tensor], bool]


@dataclass(frozen=True)
class Prompts:
    """A batch to sample from: left-padded prompt ids ``(B, P)``, their mask, and the ids that end (one or several)
    and pad an answer."""

    ids: torch.Tensor
    mask: torch.Tensor
    eos_token_id: int | list[int]
    pad_token_id: int


@dataclass
class Generated:
    sequences: torch.Tensor  # (B, P + A): prompts as given, then the answers (pad after each row's EOS)
    logprobs: torch.Tensor | None = None  # (B, A) float32 log-prob of each answer token (0 after EOS)
    # (B, A) float32: a serving engine's own log-probs of the answer tokens (vLLM: under the distribution it sampled
    # from), for the importance-sampling correction; never used as the trainer's log-probs
    engine_logprobs: torch.Tensor | None = None
    # episodes: (B, A) bool, the policy's own tokens, and the tokens fed at all (policy, tool results and
    # observations; not the masked columns of a row waiting on a tool, nor what follows its end)
    policy_mask: torch.Tensor | None = None
    real_mask: torch.Tensor | None = None


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; the entry (``backends.generate``) and the hybrid engine read it instead of the
    backend's type."""

    token_by_token: bool  # runs dschat's loop: a per-row controller (episodes) is consulted at every token
    logprobs: bool  # computes the sampled tokens' log-probs when the settings ask (GenerationConfig.logprobs)
    engine_logprobs: bool  # returns a serving engine's own log-probs of what it sampled (vLLM)
    owns_weights: bool  # holds its own copy of the weights: synced before sampling, put to sleep after
    graphs: bool = False  # captures CUDA graphs (their count and seconds are reported per step)


class Rows(Protocol):
    """A per-row controller of the decode loop: ``start`` before the first token; ``advance`` with each step's
    sampled tokens ``(B,)`` gives the tokens to feed, which are real (fed and attended to; None: every row), which
    are the policy's own samples, and which rows are done, each ``(B,)``."""

    host_every_token: bool  # needs the host at every token (its rows change on what was sampled)

    def start(self) -> None: ...

    def advance(self, sampled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor,
                                                      torch.Tensor]: ...


class EndAtEos:
    """Plain rows: each row's answer ends at its first EOS, padding after it, all on the device (no host look)."""

    host_every_token = False

    def __init__(self, batch: int, eos_token_id: int | list[int], pad_token_id: int, device: torch.device):
        ids = eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
        self.eos = torch.tensor(list(ids), device=device)
        self.pad = pad_token_id
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)

    def start(self) -> None:
        pass

    def advance(self, sampled: torch.Tensor) -> tuple[torch.Tensor, None, torch.Tensor, torch.Tensor]:
        policy = ~self.done  # before this token: a row that ended earlier feeds padding
        tok = sampled.masked_fill(self.done, self.pad)
        self.done = self.done | (tok == self.eos[0] if self.eos.numel() == 1 else torch.isin(tok, self.eos))
        return tok, None, policy, self.done


class Backend(Protocol):
    """What the entry calls on whatever samples. The entry, not the backend, decides when weights sync: before
    sampling from a backend that owns its weights it calls ``sync``; backends that sample from the module's own
    weights have nothing to sync."""

    name: str
    caps: Capabilities
    # what the last sync measured, for the step's metrics; the hybrid engine empties it once read
    last: dict[str, float]

    def generate(self, module: torch.nn.Module, prompt: torch.Tensor, prompt_mask: torch.Tensor,
                 config: GenerationConfig, eos_token_id: int | list[int], pad_token_id: int, *,
                 on_token: OnToken | None = None, rows: Rows | None = None) -> Generated:
        """Sample; ``rows`` only where ``caps.token_by_token``."""
        ...

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


class SharesWeights:
    """The ``Backend`` members of a backend that samples from the module's own weights (it shares them, holds no
    copy): nothing to sync or give back."""

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
    """The decoder contract through the model's own ``forward`` and a ``DynamicCache`` (any causal LM)."""

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


# ------------------------------------------------------------------------------------------------ token steps
def prefill(dec: LeanLlama | HFForward, module: torch.nn.Module, prompt: torch.Tensor, positions: torch.Tensor,
            prompt_mask: torch.Tensor) -> torch.Tensor:
    """The prompts' forward into ``dec``'s cache; the last position's logits. Rows that repeat a prompt (a GRPO
    group's completions, ``--num-generations`` per prompt) share one forward: the distinct prompts run through a
    decoder of their own, whose cache rows are then copied to every row that repeats them (the prompt's prefix
    cached once, as serving engines do), so the prefill costs about as much as the distinct prompts alone. Lean
    decoders only."""
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


class Step:
    """The decode loop's token step, chosen once per call: ``prefill`` the prompts (the last position's logits),
    then ``__call__`` per token: the fed tokens ``(B,)``, each row's position ``(B, 1)``, the cache column ``(1,)``
    and which rows' tokens are real (None: all) -> the next logits ``(B, V)`` float32."""

    def prefill(self, prompt: torch.Tensor, positions: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, tok: torch.Tensor, position: torch.Tensor, column: torch.Tensor,
                 real: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class GrowingStep(Step):
    """Eager, the attention as wide as the tokens so far: the lean decoder's or the model's own forward. The one
    step that takes a real-token mask per row (a masked column is fed with its key hidden)."""

    def __init__(self, dec: LeanLlama | HFForward, module: torch.nn.Module):
        self.dec, self.module = dec, module
        self.every_row: torch.Tensor | None = None  # (B, 1) True: the mask of a step whose rows are all real

    def prefill(self, prompt: torch.Tensor, positions: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
        self.every_row = torch.ones(prompt.shape[0], 1, dtype=torch.bool, device=prompt.device)
        return prefill(self.dec, self.module, prompt, positions, prompt_mask)

    def __call__(self, tok: torch.Tensor, position: torch.Tensor, column: torch.Tensor,
                 real: torch.Tensor | None) -> torch.Tensor:
        return self.dec.forward(tok[:, None], position, self.every_row if real is None else real[:, None])


class ConstantStep(GrowingStep):
    """Eager lean step over the whole cache width, unfilled columns masked: the same shapes at every token."""

    def __call__(self, tok: torch.Tensor, position: torch.Tensor, column: torch.Tensor,
                 real: torch.Tensor | None) -> torch.Tensor:
        dec = self.dec
        assert isinstance(dec, LeanLlama)
        logits, dec.keys = dec.step(tok[:, None], position[:, 0], column, dec.keys, dec.products(1))
        return logits


class CompiledStep(GrowingStep):
    """The constant-shape lean step through ``torch.compile``; its cache mask is passed along."""

    def __init__(self, dec: LeanLlama, module: torch.nn.Module):
        super().__init__(dec, module)
        self.keys: torch.Tensor | None = None

    def prefill(self, prompt: torch.Tensor, positions: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
        logits = super().prefill(prompt, positions, prompt_mask)
        assert isinstance(self.dec, LeanLlama)
        self.keys = self.dec.keys.clone()
        return logits

    def __call__(self, tok: torch.Tensor, position: torch.Tensor, column: torch.Tensor,
                 real: torch.Tensor | None) -> torch.Tensor:
        logits, self.keys = compiled_step()(self.dec, tok[:, None], position[:, 0], column, self.keys)
        return logits


class GraphStep(Step):
    """A captured step replayed per token. The cache's batch is a bucket: its spare rows repeat the last prompt
    (one more row of the shared prefill) and then run along unread, so the loop samples the real rows alone (the
    same draws as without padding)."""

    def __init__(self, captured: CapturedStep, module: torch.nn.Module):
        self.captured, self.module = captured, module

    def prefill(self, prompt: torch.Tensor, positions: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
        B, P = prompt.shape
        spare = self.captured.dec.keys.shape[0] - B  # the bucket's rows
        if spare:
            prompt = torch.cat([prompt, prompt[-1:].expand(spare, P)])
            prompt_mask = torch.cat([prompt_mask, prompt_mask[-1:].expand(spare, P)])
            positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
        return prefill(self.captured.dec, self.module, prompt, positions, prompt_mask)[:B]

    def __call__(self, tok: torch.Tensor, position: torch.Tensor, column: torch.Tensor,
                 real: torch.Tensor | None) -> torch.Tensor:
        return self.captured(tok[:, None], position[:, 0], column)


# ------------------------------------------------------------------------------------------------ the loop
def decode(step: Step, rows: Rows, prompt: torch.Tensor, prompt_mask: torch.Tensor, config: GenerationConfig,
           on_token: OnToken | None = None, stop_check_every: int = 1) -> Generated:
    """The decode loop: prefill, then per token the repetition penalty, a draw, the rows' say (``rows.advance``),
    the log-prob, the hook, and the next step. The host looks at "has every row ended" every ``stop_check_every``
    tokens (each look waits for the device); the steps past the end are cut afterwards, so the output is what a
    look at every token gives."""
    B, P = prompt.shape
    N = config.max_new_tokens
    device = prompt.device
    positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = step.prefill(prompt, positions, prompt_mask)
    columns = torch.arange(P, P + N, device=device)  # the cache column of each answer token
    position = positions[:, -1:] + 1
    every = 1 if on_token is not None or rows.host_every_token else stop_check_every
    seen = None
    if config.repetition_penalty != 1.0:  # (B, V): the tokens each row has fed so far
        seen = torch.zeros(B, logits.shape[-1], dtype=torch.bool, device=device)
        real_prompt = prompt_mask.bool()
        seen[torch.arange(B, device=device)[:, None].expand_as(prompt)[real_prompt], prompt[real_prompt]] = True
    tokens, logps, policies, reals, ended = [], [], [], [], []
    rows.start()
    for t in range(N):
        if seen is not None:
            logits = penalize_repeats(logits, seen, config.repetition_penalty)
        tok, real, policy, done = rows.advance(next_token(logits, config))
        if config.logprobs:  # 0 where the token is not the policy's
            logps.append(token_logprobs(logits, tok, config.temperature).masked_fill(~policy, 0.0))
        tokens.append(tok)
        policies.append(policy)
        if real is not None:
            reals.append(real)
        if every > 1:
            ended.append(done.all())
        if seen is not None:
            if real is None:
                seen.scatter_(1, tok[:, None], True)
            else:
                seen[torch.arange(B, device=device)[real], tok[real]] = True
        stop = on_token is not None and on_token(tok, policy)  # every token, the last one too
        if t == N - 1 or stop or ((t + 1) % every == 0 and bool(done.all())):
            break
        logits = step(tok, position, columns[t:t + 1], real)
        position = position + (1 if real is None else real[:, None].long())
    if ended:  # where a look at every token would have stopped: the first step after which every row had ended
        flags = torch.stack(ended)
        if bool(flags.any()):
            last = int(flags.int().argmax()) + 1
            tokens, logps, policies = tokens[:last], logps[:last], policies[:last]
    answer = torch.stack(tokens, dim=1)
    per_row = bool(reals)
    return Generated(torch.cat([prompt, answer], dim=1), torch.stack(logps, dim=1) if logps else None,
                     policy_mask=torch.stack(policies, dim=1) if per_row else None,
                     real_mask=torch.stack(reals, dim=1) if per_row else None)


class DschatBackend(SharesWeights):
    """Our decode loop (``dschat``). ``constant_shapes`` (None: on CUDA) runs the eager lean step over the whole
    cache width; ``stop_check_every`` how many tokens pass between the host's looks at whether every row has ended
    (None: every token on a CPU, ``STOP_CHECK_EVERY`` on CUDA). Subclasses choose another step: ``CompiledBackend``,
    ``GraphBackend``."""

    name = "dschat"
    caps = Capabilities(token_by_token=True, logprobs=True, engine_logprobs=False, owns_weights=False)

    def __init__(self, lean: bool = True, constant_shapes: bool | None = None, stop_check_every: int | None = None):
        super().__init__()
        self.lean, self.constant_shapes = lean, constant_shapes
        self.stop_check_every = stop_check_every

    def eager(self, module: torch.nn.Module, batch: int, total: int) -> LeanLlama | HFForward:
        """The eager decoder: the lean one where it runs this model at this length, else the model's forward."""
        if self.lean and LeanLlama.supported(module, total)[0]:
            return LeanLlama(module, batch, total)
        return HFForward(module, batch, total)

    def step(self, module: torch.nn.Module, batch: int, total: int, device: torch.device) -> Step:
        """The token step of one call without a per-row controller: constant shapes where the lean decoder runs
        (on CUDA unless ``constant_shapes`` says otherwise), else growing."""
        dec = self.eager(module, batch, total)
        constant = device.type == "cuda" if self.constant_shapes is None else self.constant_shapes
        return ConstantStep(dec, module) if isinstance(dec, LeanLlama) and constant else GrowingStep(dec, module)

    @torch.no_grad()
    def generate(self, module: torch.nn.Module, prompt: torch.Tensor, prompt_mask: torch.Tensor,
                 config: GenerationConfig, eos_token_id: int | list[int], pad_token_id: int, *,
                 on_token: OnToken | None = None, rows: Rows | None = None) -> Generated:
        """The loop over this backend's step; a per-row controller (episodes: rows that advance on their own)
        takes the eager growing step whatever the backend's kind, since a captured or compiled step has one
        position and one column for the whole batch."""
        B, P = prompt.shape
        total = P + config.max_new_tokens
        device = prompt.device
        try:
            if rows is None:
                step = self.step(module, B, total, device)
                rows = EndAtEos(B, eos_token_id, pad_token_id, device)
            else:
                step = GrowingStep(self.eager(module, B, total), module)
            every = self.stop_check_every or (1 if device.type != "cuda" else STOP_CHECK_EVERY)
            return decode(step, rows, prompt, prompt_mask, config, on_token, every)
        except BaseException:
            self.release()  # a caller that retries on halves after an OOM starts with nothing held
            raise


class CompiledBackend(DschatBackend):
    """``compiled``: the lean step through ``torch.compile`` (the cache in 64-column buckets: few shapes to
    compile). Llama-architecture models only."""

    name = "compiled"

    def step(self, module: torch.nn.Module, batch: int, total: int, device: torch.device) -> Step:
        ok, why = LeanLlama.supported(module, total)
        if not ok:
            from dschat.errors import UserError

            raise UserError(f"--generation-backend {self.name} needs a Llama-architecture model (llama, mistral, "
                            f"qwen2 layouts) without wrapped layers; this one has {why}: use dschat")
        return CompiledStep(LeanLlama(module, batch, -(-total // 64) * 64), module)


class GraphBackend(DschatBackend):
    """``graph``: the lean step captured as a CUDA graph per (batch, cache width) bucket and replayed per token.
    ``capture`` (None: on CUDA) whether it really captures (off, its static-buffer step runs eagerly). A model the
    lean step cannot run at this length (config-time checks refuse the others) decodes through the eager step."""

    name = "graph"
    caps = Capabilities(token_by_token=True, logprobs=True, engine_logprobs=False, owns_weights=False, graphs=True)

    def __init__(self, capture: bool | None = None, stop_check_every: int | None = None):
        super().__init__(stop_check_every=stop_check_every)
        self.graphs = GraphCache(capture)

    def step(self, module: torch.nn.Module, batch: int, total: int, device: torch.device) -> Step:
        if not LeanLlama.supported(module, total)[0]:
            return super().step(module, batch, total, device)
        return GraphStep(self.graphs.get(module, bucket(batch, BATCH_BUCKET), bucket(total, WIDTH_BUCKET)), module)

    def release(self) -> None:
        """The end of a generate phase: the captured graphs and their KV caches are freed (CUDA's cached blocks
        with them), so training has that memory; the next generation captures again (``GraphCache.release``)."""
        self.graphs.release()

    def close(self) -> None:
        self.release()


class HFBackend(SharesWeights):
    """``hf``: transformers' ``generate`` (whole answers; it reads the rest of the model's generation config)."""

    name = "hf"
    caps = Capabilities(token_by_token=False, logprobs=True, engine_logprobs=False, owns_weights=False)

    @torch.no_grad()
    def generate(self, module: torch.nn.Module, prompt: torch.Tensor, prompt_mask: torch.Tensor,
                 config: GenerationConfig, eos_token_id: int | list[int], pad_token_id: int, *,
                 on_token: OnToken | None = None, rows: Rows | None = None) -> Generated:
        assert rows is None, "hf samples whole answers: episodes run turn by turn (dschat.generation.turns)"
        kwargs: dict[str, Any] = {"attention_mask": prompt_mask, "max_new_tokens": config.max_new_tokens,
                                  "do_sample": config.do_sample, "pad_token_id": pad_token_id,
                                  "eos_token_id": eos_token_id, "use_cache": True}
        if config.do_sample:
            kwargs.update(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k)
        else:  # neutral sampling knobs: greedy ignores them, and transformers warns when a model's config sets them
            kwargs.update(temperature=1.0, top_p=1.0, top_k=0)
        if config.repetition_penalty != 1.0:
            kwargs["repetition_penalty"] = config.repetition_penalty
        if on_token is not None:
            kwargs["stopping_criteria"] = _stop_when(on_token, eos_token_id)
        if not config.logprobs:
            return Generated(module.generate(prompt, **kwargs))
        # the raw logits of every step (before any processor): the flags change what is returned, not what is drawn
        out = module.generate(prompt, output_logits=True, return_dict_in_generate=True, **kwargs)
        return Generated(out.sequences, hf_logprobs(out.sequences, out.logits, prompt_mask, config, eos_token_id))


def hf_logprobs(sequences: torch.Tensor, logits: tuple[torch.Tensor, ...], prompt_mask: torch.Tensor,
                config: GenerationConfig, eos_token_id: int | list[int]) -> torch.Tensor:
    """The log-prob of each answer token of HF ``generate``'s ``sequences`` ``(B, P + A)`` under the distribution
    dschat's loop takes them from (``token_logprobs``: the tempered whole vocabulary, no top-k/top-p), from the raw
    logits of its ``A`` steps; 0 after a row's first EOS, as the loop gives. ``(B, A)`` float32.

    The repetition penalty is applied as HF applied it, so the log-probs are of the distribution HF drew from: its
    penalty reads the ``input_ids`` it has at each step (the prompt, then every generated token, padding after a
    row's end included), from each row's first attended prompt token on (transformers' ``generate``, 5.25 tested,
    passes the left padding's width as ``prompt_ignore_length``; the tests check this rule against HF's own scores).
    dschat's loop counts real tokens only; the two differ only after a row's end, where the log-probs are 0. Other
    processors a model's own generation config may add (``no_repeat_ngram_size``, ``suppress_tokens``) are not
    reproduced: dschat sets none of them."""
    P = prompt_mask.shape[1]
    answer = sequences[:, P:]
    B, A = answer.shape
    assert len(logits) == A, f"{len(logits)} steps of logits for {A} answer tokens"
    if A == 0:
        return torch.zeros(B, 0, device=sequences.device)
    ids = eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
    is_eos = torch.isin(answer, torch.tensor(list(ids), device=answer.device)).long()
    policy = is_eos.cumsum(1) - is_eos == 0  # no EOS before the token: the EOS itself is the policy's
    seen = None
    if config.repetition_penalty != 1.0:  # (B, V): the tokens HF's penalty counts at the first step
        seen = torch.zeros(B, logits[0].shape[-1], dtype=torch.bool, device=answer.device)
        start = (prompt_mask != 0).int().argmax(1)  # each row's left padding, which HF ignores
        counted = torch.arange(P, device=answer.device)[None, :] >= start[:, None]
        rows = torch.arange(B, device=answer.device)[:, None].expand(B, P)
        seen[rows[counted], sequences[:, :P][counted]] = True
    logps = []
    for t, step in enumerate(logits):
        step = step.to(answer.device).float()
        if seen is not None:
            step = penalize_repeats(step, seen, config.repetition_penalty)
            seen.scatter_(1, answer[:, t:t + 1], True)  # what HF's input_ids hold at the next step
        logps.append(token_logprobs(step, answer[:, t], config.temperature))
    return torch.stack(logps, dim=1).masked_fill(~policy, 0.0)


def _stop_when(on_token: OnToken, eos_token_id: int | list[int]) -> Any:
    """``on_token`` as HF ``generate``'s stopping criterion: called after each step with the newest tokens (a row
    that ended before this step feeds padding, which is not the policy's)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    ids = eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]

    class OnTokenStop(StoppingCriteria):
        def __init__(self) -> None:
            self.done: torch.Tensor | None = None

        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            tok = input_ids[:, -1]
            done = torch.zeros_like(tok, dtype=torch.bool) if self.done is None else self.done
            stop = bool(on_token(tok, ~done))
            self.done = done | torch.isin(tok, torch.tensor(list(ids), device=tok.device))
            return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([OnTokenStop()])
