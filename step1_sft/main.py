"""Stage 1: supervised fine-tuning of a causal LM on prompt + chosen answer.

    python step1_sft/main.py --model tiny --output-dir out/step1 --max-steps 50
    deepspeed --num_gpus 2 step1_sft/main.py --model chinese-llama-2-7b --zero-stage 3 ...
    dschat train --step 1 ...        (the same flags)

    dschat train --step 1 --model tiny --teacher-model out/big/model --kd-coef 0.5     (distillation)

Reads top to bottom: what one micro-batch does (cross-entropy, mixed with the KL to a teacher under
``--teacher-model``: ``dschat.training.distill``) and how the model is evaluated (the answer tokens' perplexity,
``dschat.evaluation.lm``, which ``dschat eval --step 1`` shares; with a teacher also the distillation term); the
shared one-model loop (``dschat.training.one_model``: set up, evaluate, train, evaluate) runs it; then save and report.
"""

from __future__ import annotations

import os
import sys
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dschat.cli.options import run_command, stage_command
from dschat.config import SFTConfig


def run(cfg: SFTConfig) -> dict[str, Any]:
    # The training stack (torch, DeepSpeed, transformers) is imported by the run, not by the module: declaring the
    # flags (``--help``, ``dschat plan``, ``dschat doctor``) needs none of it.
    from dschat import engine as E
    from dschat.data import DataCollatorSFT
    from dschat.data.packing import real_tokens, sft_inputs
    from dschat.demo import demo_data
    from dschat.evaluation.lm import evaluate_perplexity
    from dschat.models.loading import create_causal_lm
    from dschat.models.logits import causal_lm_loss
    from dschat.training.checkpoint import save_hf
    from dschat.training.distill import Distiller
    from dschat.training.one_model import OneModelStage, train_one_model
    from dschat.training.run_tracker import write_eval

    distiller = Distiller(cfg.kd, cfg.engine, cfg.model.trust_remote_code) if cfg.kd.teacher_model else None

    def micro_step(engine: Any, batch: dict[str, Any]) -> dict[str, float]:
        stats: dict[str, float] = {}
        if distiller is None:
            loss = causal_lm_loss(engine, **sft_inputs(engine, batch))  # packed (--packing) or padded rows
        else:  # (1 - a) * CE + a * T^2 * KL(teacher || student) over the answer tokens
            out = distiller.loss(engine, batch)
            loss = out.loss
            stats = {"ce": out.ce.item(), "kd": out.kd.item(), "top1_agreement": out.top1_agreement.item()}
        engine.backward(loss)
        E.optimizer_step(engine)
        return {"loss": loss.item(), **stats, "tokens": float(real_tokens(batch))}

    spec = OneModelStage(
        name="step1_sft", phase=1, collator=DataCollatorSFT, default_data=demo_data, micro_step=micro_step,
        evaluate=lambda engine, loader: evaluate_perplexity(engine, loader, distiller=distiller),
        logged=("perplexity", "loss") + (("kd", "top1_agreement") if distiller else ()),
        prepare=distiller.load if distiller else None, describe=distiller.describe() if distiller else "",
        make_model=lambda path, dtype, tok: create_causal_lm(path, dtype, cfg.model.dropout,
                                                             cfg.model.gradient_checkpointing,
                                                             cfg.model.trust_remote_code, lora=cfg.lora))
    t = train_one_model(cfg, spec)
    save_hf(t.engine, t.tokenizer, t.stage.output_dir / "model")
    metrics = {
        "perplexity": t.after.get("perplexity"), "perplexity_before": t.before.get("perplexity"),
        "eval_loss": t.after.get("loss"), "eval_loss_before": t.before.get("loss"),
        "train_loss_first": t.first_loss, "train_loss_last": t.last_loss, "steps": t.steps, "alarms": t.alarms,
        **t.data.counts, "sources": t.data.sources,
    }
    if distiller is not None:
        metrics.update({"teacher_model": distiller.path, "kd_coef": cfg.kd.kd_coef,
                        "kd_temperature": cfg.kd.kd_temperature, "kd": t.after.get("kd"),
                        "kd_before": t.before.get("kd"), "top1_agreement": t.after.get("top1_agreement"),
                        "top1_agreement_before": t.before.get("top1_agreement")})
    if E.is_main():
        write_eval(t.stage.output_dir, metrics)
        kd = f" | KL to teacher {t.before['kd']:.4f} -> {t.after['kd']:.4f}" if distiller and t.after else ""
        t.stage.log(f"perplexity {t.before.get('perplexity', float('nan')):.2f} -> "
                    f"{t.after.get('perplexity', float('nan')):.2f}{kd}; saved {t.stage.output_dir / 'model'}")
    return metrics


command = stage_command("step1_sft", SFTConfig, run, help="Stage 1: supervised fine-tuning.")

if __name__ == "__main__":
    run_command(command)
