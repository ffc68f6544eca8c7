"""Stage 1: supervised fine-tuning of a causal LM on prompt + chosen answer.

    python step1_sft/main.py --model tiny --output-dir out/step1 --max-steps 50
    deepspeed --num_gpus 2 step1_sft/main.py --model chinese-llama-2-7b --zero-stage 3 ...
    dschat train --step 1 ...        (the same flags)

Reads top to bottom: what one micro-batch does and how the model is evaluated; the shared one-model loop
(``dschat.supervised``: set up, evaluate, train, evaluate) runs it; then save and report.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from dschat import engine as E
from dschat.checkpoint import save_hf
from dschat.cli import run_command, stage_command
from dschat.config import SFTConfig
from dschat.data import DataCollatorSFT
from dschat.data.packing import real_tokens, sft_inputs
from dschat.demo import demo_data
from dschat.models import create_causal_lm
from dschat.stage import lockstep_batches, to_device
from dschat.supervised import OneModelStage, train_one_model
from dschat.tracking import write_eval


@torch.no_grad()
def evaluate_perplexity(model: Any, loader: Any) -> dict[str, float]:
    """Token-level perplexity over the answer tokens (labels != -100), summed exactly across ranks."""
    was_training = model.training
    model.eval()
    nll, count = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for batch, real in lockstep_batches(loader):
        batch = to_device(batch, E.device())
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
    def micro_step(engine: Any, batch: dict[str, Any]) -> dict[str, float]:
        loss = engine(**sft_inputs(engine, batch), use_cache=False).loss  # packed (--packing) or padded rows
        engine.backward(loss)
        engine.step()
        return {"loss": loss.item(), "tokens": float(real_tokens(batch))}

    spec = OneModelStage(
        name="step1_sft", phase=1, collator=DataCollatorSFT, default_data=demo_data, evaluate=evaluate_perplexity,
        logged=("perplexity", "loss"), micro_step=micro_step,
        make_model=lambda path, dtype, tok: create_causal_lm(path, dtype, cfg.model.dropout,
                                                             cfg.model.gradient_checkpointing,
                                                             cfg.model.trust_remote_code, lora=cfg.lora))
    t = train_one_model(cfg, spec)
    save_hf(t.engine, t.tokenizer, t.stage.output_dir / "model")
    metrics = {
        "perplexity": t.after.get("perplexity"), "perplexity_before": t.before.get("perplexity"),
        "eval_loss": t.after.get("loss"), "eval_loss_before": t.before.get("loss"),
        "train_loss_first": t.first_loss, "train_loss_last": t.last_loss, "steps": t.steps,
        **t.data.counts, "sources": t.data.sources,
    }
    if E.is_main():
        write_eval(t.stage.output_dir, metrics)
        t.stage.log(f"perplexity {t.before.get('perplexity', float('nan')):.2f} -> "
                    f"{t.after.get('perplexity', float('nan')):.2f}; saved {t.stage.output_dir / 'model'}")
    return metrics


command = stage_command("step1_sft", SFTConfig, run, help="Stage 1: supervised fine-tuning (SPEC section 2, 8).")

if __name__ == "__main__":
    run_command(command)
