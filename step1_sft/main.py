"""Stage 1: supervised fine-tuning of a causal LM on prompt + chosen answer.

    python step1_sft/main.py --model tiny --output-dir out/step1 --max-steps 50
    deepspeed --num_gpus 2 step1_sft/main.py --model chinese-llama-2-7b --zero-stage 3 ...
    dschat train --step 1 ...        (the same flags)

Reads top to bottom: set up, evaluate, train, evaluate, save.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from dschat import engine as E
from dschat.checkpoint import save_hf
from dschat.cli import run_command, stage_command
from dschat.config import DataArgs, EngineArgs, LoraArgs, ModelArgs, OptimArgs, RunArgs
from dschat.data import DataCollatorSFT, load_phase
from dschat.lora import lora_param_groups
from dschat.models import create_causal_lm, load_tokenizer, resolve_model
from dschat.stage import (
    ResumableLoop,
    begin_stage,
    check_finite,
    eval_loader,
    learning_rate,
    lockstep_batches,
    plan_steps,
    to_device,
    train_loader,
)
from dschat.tracking import RunTracker, write_eval


@dataclass
class SFTConfig:
    model: ModelArgs = field(default_factory=ModelArgs)
    data: DataArgs = field(default_factory=DataArgs)
    optim: OptimArgs = field(default_factory=OptimArgs)
    engine: EngineArgs = field(default_factory=EngineArgs)
    lora: LoraArgs = field(default_factory=LoraArgs)
    run: RunArgs = field(default_factory=RunArgs)


@torch.no_grad()
def evaluate_perplexity(model: Any, loader: Any) -> dict[str, float]:
    """Token-level perplexity over the answer tokens (labels != -100), summed exactly across ranks."""
    was_training = model.training
    model.eval()
    nll, count = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    dev = E.device()
    for batch, real in lockstep_batches(loader):
        batch = to_device(batch, dev)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        if not real:
            continue
        labels = batch["labels"][:, 1:]
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels.flatten(),
                                                 ignore_index=-100, reduction="sum")
        nll += loss.double().cpu()
        count += (labels != -100).sum().double().cpu()
    nll, count = E.all_reduce_sum(nll), E.all_reduce_sum(count)
    if was_training:
        model.train()
    mean = (nll / count.clamp(min=1)).item()
    return {"loss": mean, "perplexity": math.exp(min(mean, 50.0))}


def run(cfg: SFTConfig) -> dict[str, Any]:
    stage = begin_stage(cfg, "step1_sft", "output/step1_sft")
    model_path = resolve_model(cfg.model.model)
    tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code)
    with E.main_process_first():
        data = load_phase(cfg.data, 1, tokenizer, cfg.run.seed, log=stage.log if E.is_main() else lambda _: None)
    collator = DataCollatorSFT(tokenizer.pad_token_id)
    loader = train_loader(data.train, cfg.optim.per_device_train_batch_size, collator, cfg.run.seed)
    evals = eval_loader(data.eval, cfg.optim.per_device_eval_batch_size, collator)
    total_steps, epochs = plan_steps(len(loader), cfg.optim)

    dtype = E.resolve_dtype(cfg.model.dtype)
    model = create_causal_lm(model_path, dtype, cfg.model.dropout, cfg.model.gradient_checkpointing,
                             cfg.model.trust_remote_code, lora=cfg.lora)
    n_params = sum(p.numel() for p in model.parameters())
    lr = learning_rate(cfg.optim, cfg.model.model, n_params)
    engine = E.build_train_engine(model, engine=cfg.engine, optim=cfg.optim, dtype=dtype, total_steps=total_steps,
                                  lr=lr, param_groups=lora_param_groups(model, cfg.optim.weight_decay, lr,
                                                                        cfg.lora.lora_learning_rate))
    stage.log(f"model {model_path} | {n_params / 1e6:.2f}M params | "
              f"train rows {len(data.train)} eval rows {len(data.eval)} | {total_steps} optimizer steps | "
              f"lr {lr:g} | ZeRO {cfg.engine.zero_stage} | world {E.world_size()}")

    loop = ResumableLoop(stage, engine, tokenizer, cfg.run)
    state = loop.state
    before = state.get("before") or (evaluate_perplexity(engine, evals) if data.eval else {})
    tracker = RunTracker(stage.output_dir, E.is_main(), total_steps, cfg.run.progress, desc="sft")
    if before and loop.resumed_from is None:
        tracker.log(0, {"eval/perplexity": before["perplexity"], "eval/loss": before["loss"]})

    engine.train()
    accum = cfg.optim.gradient_accumulation_steps
    tracker.advance(loop.step)
    loop.extras = {"before": before, "first_loss": state.get("first_loss", float("nan")),
                   "last_loss": state.get("last_loss", float("nan"))}
    window = {"loss": 0.0, "tokens": 0, "t0": time.time()}  # summed over the micro-batches of one step

    def micro_step(batch: dict[str, Any]) -> None:
        loss = engine(**batch, use_cache=False).loss
        engine.backward(loss)
        engine.step()
        window["loss"] += loss.item()
        window["tokens"] += int(batch["attention_mask"].sum())

    def on_step(step: int, epoch: int) -> None:
        mean_loss = E.all_reduce_mean(torch.tensor(window["loss"] / accum)).item()
        check_finite(mean_loss, step)
        if step == 1:
            loop.extras["first_loss"] = mean_loss
        loop.extras["last_loss"] = mean_loss
        if step % cfg.run.log_interval == 0 or step == total_steps:
            elapsed = time.time() - window["t0"]
            tokens = E.all_reduce_sum(torch.tensor(float(window["tokens"]))).item()
            tracker.log(step, {"train/loss": mean_loss, "train/lr": engine.get_lr()[0], "train/epoch": epoch,
                               "train/tokens_per_s": tokens / max(elapsed, 1e-9)})
        tracker.advance(1, loss=mean_loss)
        window.update(loss=0.0, tokens=0, t0=time.time())
        if cfg.run.eval_interval and step % cfg.run.eval_interval == 0 and data.eval:
            mid = evaluate_perplexity(engine, evals)
            tracker.log(step, {"eval/perplexity": mid["perplexity"], "eval/loss": mid["loss"]})

    loop.run(loader, epochs, total_steps, micro_step, on_step)
    step, first_loss, last_loss = loop.step, loop.extras["first_loss"], loop.extras["last_loss"]

    after = evaluate_perplexity(engine, evals) if data.eval else {}
    if after:
        tracker.log(step, {"eval/perplexity": after["perplexity"], "eval/loss": after["loss"]})
    tracker.close()
    save_hf(engine, tokenizer, stage.output_dir / "model")
    metrics = {
        "perplexity": after.get("perplexity"), "perplexity_before": before.get("perplexity"),
        "eval_loss": after.get("loss"), "eval_loss_before": before.get("loss"),
        "train_loss_first": first_loss, "train_loss_last": last_loss, "steps": step,
        **data.counts, "sources": data.sources,
    }
    if E.is_main():
        write_eval(stage.output_dir, metrics)
        stage.log(f"perplexity {before.get('perplexity', float('nan')):.2f} -> "
                  f"{after.get('perplexity', float('nan')):.2f}; saved {stage.output_dir / 'model'}")
    return metrics


command = stage_command("step1_sft", SFTConfig, run, help="Stage 1: supervised fine-tuning (SPEC section 2, 8).")

if __name__ == "__main__":
    run_command(command)
