"""vLLM as a sampler's engine, fed by the weight plane (``dschat.generation.weight_plane``): no copy of the policy
outside vLLM's own model.

``WeightReceiver`` is a vLLM worker extension (``worker_extension_cls``): each of the engine's workers (one, or one
per tensor-parallel rank) joins the weight group itself and takes every bucket straight into its model through
vLLM's in-place reload (``reload_weights``: checkpoint names, fused projections mapped as a checkpoint load maps
them), one tensor at a time as the buckets arrive. A LoRA update's adapter matrices are handed back to the sampler,
which registers them as a vLLM LoRA adapter of that version and keeps the ``K + 1`` newest (``FedVLLM``).

``FedVLLM`` is the sampler's backend: the vLLM backend with its sync replaced by the plane (``receive``), and the
probe computed by vLLM itself as the prompt log-probs of the probe sequence, the engine that will sample.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from dschat.generation.vllm_engine import VLLMBackend, WeightSyncError, _refresh_cpu_gemms
from dschat.generation.weight_plane import Layout, entries_of, join_group, probe_ids, received

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM can be built for (max_lora_rank)
EXTENSION = "dschat.generation.vllm_worker.WeightReceiver"


class WeightReceiver:
    """Methods vLLM adds to each of its workers (called through ``collective_rpc``)."""

    def dschat_join(self, spec: dict[str, Any]) -> None:
        """Join the weight group as this sampler's ranks' ``rank``-th (the tensor-parallel rank)."""
        self._dschat_group = join_group(spec, int(getattr(self, "rank", 0) or 0))
        self._dschat_holder: dict[str, torch.Tensor] = {}

    def dschat_gpu(self) -> str:
        from dschat import engine as E

        return E.gpu_identity() if torch.cuda.is_available() else ""

    @torch.no_grad()
    def dschat_receive(self, layout_json: dict[str, Any]) -> dict[str, Any]:
        """One update into this worker's model; the checksum of every bucket and, where it carried adapters,
        their matrices on the CPU (name -> tensor)."""
        layout = Layout.from_json(layout_json)
        sums: list[torch.Tensor] = []
        adapter: dict[str, torch.Tensor] = {}

        def weights() -> Any:
            for bucket, flat, checksum in received(self._dschat_group, layout, self._dschat_holder):
                sums.append(checksum)
                for e, t in entries_of(bucket, flat):
                    if e.role in ("lora_A", "lora_B"):
                        adapter[e.name] = t.to("cpu", copy=True)
                    else:  # vLLM may hold a tensor until its layer is complete: a copy, not the reused buffer
                        yield e.name, t.clone()

        from dschat.engine import WeightGroupError
        from dschat.errors import first_line

        stream, problem = weights(), ""
        if any(e.role in ("weight", "base") for b in layout.buckets for e in b.entries):
            try:
                self.model_runner.reload_weights(weights_iterator=stream)
                _refresh_cpu_gemms(self.model_runner.get_model())
            except WeightGroupError:
                raise
            except Exception as e:  # noqa: BLE001 - the update is refused with it; the transfer goes on
                problem = f"vLLM could not load it: {first_line(e)}"
        for _ in stream:  # whatever the load did not ask for (adapters after the last weight, or after a failure)
            pass
        return {"checksums": [[int(x) for x in s.tolist()] for s in sums], "adapter": adapter, "problem": problem}


def lora_rank(r: int) -> int:
    """The smallest rank vLLM can be built for that holds ``r``."""
    for rank in LORA_RANKS:
        if rank >= r:
            return rank
    raise WeightSyncError(f"vLLM holds LoRA ranks up to {LORA_RANKS[-1]}; this adapter's is {r}")


class FedVLLM(VLLMBackend):
    """The vLLM backend of a sampler: built from the model's config with dummy weights, every weight from the plane,
    LoRA adapters as vLLM adapters (``K + 1`` versions live), never synced from a module."""

    def __init__(self, args: Any, config: Any, dtype: torch.dtype, max_model_len: int, lora: dict[str, Any] | None,
                 keep: int, sampling: Any, dedicated: bool, batch: int = 8):
        super().__init__(args, max_model_len=max_model_len, sampling=sampling, dedicated=dedicated)
        self.config, self.lora, self.keep = config, lora, max(keep, 1)
        self.adapters: dict[int, Any] = {}  # version -> LoRARequest
        self.version: int | None = None
        self.problem = ""
        self._adapter_dirs = Path(tempfile.mkdtemp(prefix="dschat-adapters-",
                                                   dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
        extra: dict[str, Any] = {"worker_extension_cls": EXTENSION}
        if lora is not None:
            extra.update(enable_lora=True, max_lora_rank=lora_rank(int(lora["r"])), max_loras=self.keep,
                         max_cpu_loras=self.keep)
        self._build_from(config, dtype, batch, max_model_len, **extra)
        self.synced = (0, 0)  # never synced from a module: ``sync`` below does nothing

    def describe(self) -> str:
        """The engine's settings as the run and the flags made them, for the sampler's log."""
        share = "vLLM's default" if self.memory_utilization is None else f"{self.memory_utilization:g}"
        memory = (f"GPU memory share {share}, sleep {'on' if self.sleep_mode else 'off'}" if torch.cuda.is_available()
                  else f"KV cache {self._kv_bytes(self.config, 8, self.max_len) >> 20} MiB")
        lora = f", LoRA rank {self.lora['r']} x {self.keep} adapters" if self.lora else ""
        return (f"vLLM {self.dtype} | max length {self.max_len} | {memory} | tensor parallel "
                f"{self.args.vllm_tensor_parallel_size} | log-probs {self.logprobs_mode}{lora}")

    def sync(self, module: torch.nn.Module, engine: Any = None, batch: int = 1, total: int = 64) -> dict[str, float]:
        if self.version is None:
            raise WeightSyncError("vLLM was asked to sample before a weight update reached it")
        return {}

    # ------------------------------------------------------------------------------------------- the plane
    def identities(self) -> list[str]:
        return [str(g) for g in self.llm.collective_rpc("dschat_gpu")]

    def join(self, spec: dict[str, Any]) -> None:
        self.llm.collective_rpc("dschat_join", args=(spec,))

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def receive(self, layout: Layout, version: int) -> list[list[int]]:
        """One update into the engine; its buckets' checksums (each worker's; the first's are returned, the others
        must agree). A LoRA update becomes adapter ``version``, the oldest beyond ``keep`` dropped."""
        self.problem = ""
        self._wake()  # asleep between samples (a sampler sharing a trainer's GPU): its weights must be back
        results = self.llm.collective_rpc("dschat_receive", args=(layout.to_json(),))
        first = results[0]
        self.problem = next((r["problem"] for r in results if r["problem"]), "")
        if any(r["checksums"] != first["checksums"] for r in results[1:]):
            self.problem = self.problem or "the engine's ranks received different bytes"
        if first["adapter"] and not self.problem:
            self._add_adapter(version, first["adapter"], layout.lora or {})
        self.llm.reset_prefix_cache()  # blocks cached before hold the old weights' keys and values
        self.version = version
        return first["checksums"]

    def _add_adapter(self, version: int, tensors: dict[str, torch.Tensor], spec: dict[str, Any]) -> None:
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        folder = self._adapter_dirs / f"v{version}"
        folder.mkdir(parents=True, exist_ok=True)
        save_file({f"base_model.model.{k.removesuffix('.weight')}.weight": v.contiguous() for k, v in tensors.items()},
                  str(folder / "adapter_model.safetensors"))
        targets = sorted({t.rsplit(".", 1)[-1] for t in spec.get("targets", [])})
        (folder / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": int(spec["r"]), "lora_alpha": float(spec["alpha"]), "target_modules": targets,
            "bias": "none", "lora_dropout": 0.0, "fan_in_fan_out": False, "task_type": "CAUSAL_LM"}))
        request = LoRARequest(f"dschat-v{version}", version + 1, str(folder))
        self.llm.llm_engine.add_lora(request)
        self.adapters[version] = request
        for old in sorted(self.adapters)[:-self.keep]:
            self.llm.llm_engine.remove_lora(self.adapters.pop(old).lora_int_id)
            for f in (self._adapter_dirs / f"v{old}").glob("*"):
                f.unlink()

    def request_for(self, version: int | None = None) -> Any:
        """The adapter that samples ``version`` (default: the newest), or None without LoRA."""
        if not self.adapters:
            return None
        return self.adapters[max(self.adapters) if version is None else version]

    @torch.no_grad()
    def probe_logprobs(self) -> list[float]:
        """vLLM's own log-prob of each next token of the probe sequence (its prompt log-probs, which run the
        model's forward over the prompt as sampling does)."""
        from vllm import SamplingParams

        ids = probe_ids(int(self.config.vocab_size))[0].tolist()
        sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        out = self.llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False,
                                lora_request=self.request_for())[0]
        return [float(lp[t].logprob) for lp, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]

    def _ready(self, module: Any) -> bool:
        return self.version is not None

    def _generate_kwargs(self) -> dict[str, Any]:
        return {"lora_request": self.request_for()}

    def close(self) -> None:
        super().close()
        import shutil

        shutil.rmtree(self._adapter_dirs, ignore_errors=True)
