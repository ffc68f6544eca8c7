"""The loop of the one-model stages (1 SFT, 2 reward model), written once: set up, evaluate, train, evaluate.

A stage main describes itself as a ``OneModelStage`` (its data phase, collator, model, what one micro-batch does
and how the model is evaluated) and gets back a ``Trained`` run to save and report. Resume, Ctrl-C, logging,
progress and step counting are the same for both (``dschat.training.stage``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dschat import engine as E
from dschat.data import PhaseData, load_phase
from dschat.data.packing import check_packing
from dschat.devices import resolve_dtype
from dschat.models.loading import load_tokenizer, resolve_model
from dschat.models.lora import lora_param_groups
from dschat.training import memory
from dschat.training.health import HealthMonitor
from dschat.training.run_tracker import RunTracker
from dschat.training.stage import (
    ResumableLoop,
    Stage,
    begin_stage,
    eval_loader,
    learning_rate,
    plan_steps,
    training_loader,
)


@dataclass
class OneModelStage:
    name: str  # e.g. step1_sft: log prefix and default output folder (output/<name>)
    phase: int  # the data's train phase (docs/data.md, Train phases)
    collator: Callable[[int], Any]  # pad token id -> batch collator
    make_model: Callable[[str, torch.dtype, Any], torch.nn.Module]  # (path, dtype, tokenizer) -> module
    micro_step: Callable[[Any, dict[str, Any]], dict[str, float]]  # forward, backward, step; the batch's stats
    evaluate: Callable[[Any, Any], dict[str, Any]]  # (engine, eval loader) -> metrics (JSON-able)
    logged: tuple[str, ...]  # keys of ``evaluate``'s metrics logged as eval/<key>
    describe: str = ""  # extra words for the start-up line
    check_data: Callable[[PhaseData, Callable[[str], None]], None] | None = None  # (data, log): notes or errors
    default_data: Callable[[], Sequence[str]] | None = None  # --data when none is given (the mains: the demo's)
    # (model path, tokenizer, dtype): load what micro_step and evaluate need beside the model (stage 1's teacher);
    # called on every rank after the data and before the model, so a mismatch stops before the long part.
    prepare: Callable[[str, Any, torch.dtype], None] | None = None


@dataclass
class Trained:
    stage: Stage
    engine: Any
    tokenizer: Any
    data: PhaseData
    collator: Any
    before: dict[str, Any]
    after: dict[str, Any]
    steps: int
    alarms: list[dict[str, Any]]  # the health alarms of the run (eval.json's "alarms")
    first_loss: float
    last_loss: float
    lr: float
    seconds: float


def train_one_model(cfg: Any, spec: OneModelStage) -> Trained:
    """Run a one-model stage: ``micro_step`` returns sums over its batch ('loss' first; 'tokens', if present, is
    reported as tokens/s), averaged over each optimizer step's micro-batches and all ranks, logged as
    ``train/<name>`` with the learning rate and epoch."""
    started = time.time()
    stage = begin_stage(cfg, spec.name, f"output/{spec.name}")
    quiet = stage.log if E.is_main() else (lambda _: None)
    with E.main_process_first():  # rank 0 materialises the tiny preset and the data cache; the rest read them
        model_path = resolve_model(cfg.model.model)
        tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code)
        data = load_phase(cfg.data, spec.phase, tokenizer, cfg.run.seed, log=quiet, default_data=spec.default_data)
    if spec.check_data is not None:
        spec.check_data(data, stage.log)
    dtype = resolve_dtype(cfg.model.dtype)
    if spec.prepare is not None:
        spec.prepare(model_path, tokenizer, dtype)
    collator = spec.collator(tokenizer.pad_token_id)
    loader = training_loader(data.train, cfg.optim.per_device_train_batch_size, collator, cfg.run.seed, cfg.data)
    evals = eval_loader(data.eval, cfg.optim.per_device_eval_batch_size, collator)
    total_steps, epochs = plan_steps(len(loader), cfg.optim)

    model = spec.make_model(model_path, dtype, tokenizer)
    if cfg.data.packing:
        check_packing(model, cfg.data.max_seq_len)
    n_params = sum(p.numel() for p in model.parameters())
    lr = learning_rate(cfg.optim, cfg.model.model, n_params)
    engine = E.build_train_engine(model, engine=cfg.engine, optim=cfg.optim, dtype=dtype, total_steps=total_steps,
                                  lr=lr, param_groups=lora_param_groups(model, cfg.optim.weight_decay, lr,
                                                                        cfg.lora.lora_learning_rate))
    packed = f" packed into {len(loader.dataset)} sequences" if cfg.data.packing else ""  # type: ignore[arg-type]
    stage.log(f"model {model_path} | {n_params / 1e6:.2f}M params{spec.describe} | train rows {len(data.train)}"
              f"{packed} eval rows {len(data.eval)} | {total_steps} optimizer steps | lr {lr:g} | ZeRO "
              f"{cfg.engine.zero_stage} | world {E.world_size()}")

    def evaluation() -> dict[str, Any]:
        with memory.phase("eval"):
            return spec.evaluate(engine, evals) if data.eval else {}

    def eval_scalars(metrics: dict[str, Any]) -> dict[str, Any]:
        return {f"eval/{k}": metrics[k] for k in spec.logged}

    # accumulation 1: a state saved inside a window (Ctrl-C) is the last optimizer step's, where the position is
    loop = ResumableLoop(stage, {"model": engine}, tokenizer, cfg.run)
    state = loop.state
    before = state.get("before") or evaluation()
    tracker = RunTracker(stage.output_dir, E.is_main(), total_steps, cfg.run.progress, desc=spec.name.split("_")[-1])
    if before and loop.resumed_from is None:
        tracker.log(0, eval_scalars(before) | memory.take())

    engine.train()
    accum = cfg.optim.gradient_accumulation_steps
    tracker.advance(loop.step)
    health = HealthMonitor(cfg.health, spec.phase, stage.output_dir, log=stage.log, tracker=tracker)
    loop.watch(health)
    loop.extras = {"before": before, "first_loss": state.get("first_loss", float("nan")),
                   "last_loss": state.get("last_loss", float("nan"))}
    if before and loop.resumed_from is None:
        health.observe(0, eval_scalars(before))
    window: dict[str, float] = {}  # summed over the micro-batches of one optimizer step
    t0 = [time.time()]

    micro = [0]  # micro-batches of the optimizer step under way

    def micro_step(batch: dict[str, Any]) -> None:
        micro[0] += 1
        with loop.micro_batch("train", micro[0]):
            stats = spec.micro_step(engine, batch)
        for k, v in stats.items():
            window[k] = window.get(k, 0.0) + v

    def on_step(step: int, epoch: int) -> None:
        tokens = window.pop("tokens", None)
        names = list(window)
        means = dict(zip(names, E.all_reduce_mean(torch.tensor([window[k] / accum for k in names],
                                                                dtype=torch.float64)).tolist(), strict=True))
        norms = E.take_grad_norms(engine)
        if norms:
            means["grad_norm"] = max(norms)
        health.observe(step, {f"train/{k}": v for k, v in means.items()})
        if step == 1:
            loop.extras["first_loss"] = means["loss"]
        loop.extras["last_loss"] = means["loss"]
        if step % cfg.run.log_interval == 0 or step == total_steps:
            row = {f"train/{k}": v for k, v in means.items()} | {"train/lr": engine.get_lr()[0], "train/epoch": epoch}
            row.update(memory.take())
            if tokens is not None:
                total = E.all_reduce_sum(torch.tensor(tokens, dtype=torch.float64)).item()
                row["train/tokens_per_s"] = total / max(time.time() - t0[0], 1e-9)
            tracker.log(step, row)
        tracker.advance(1, **{k: means[k] for k in names[:2]})
        window.clear()
        micro[0] = 0
        t0[0] = time.time()
        if cfg.run.eval_interval and step % cfg.run.eval_interval == 0 and step < total_steps and data.eval:
            scalars = eval_scalars(evaluation())
            tracker.log(step, scalars | memory.take())
            health.observe(step, scalars)

    try:
        loop.run(loader, epochs, total_steps, micro_step, on_step)
        after = evaluation()
        if after:
            tracker.log(loop.step, eval_scalars(after) | memory.take())
            health.observe(loop.step, eval_scalars(after))
            health.respond(loop, final=True)
    finally:
        tracker.close()
    return Trained(stage, engine, tokenizer, data, collator, before, after, loop.step, health.summary(),
                   loop.extras["first_loss"], loop.extras["last_loss"], lr, time.time() - started)
