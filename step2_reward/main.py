"""Stage 2: a reward model (LM backbone + v_head) trained on chosen/rejected pairs.

    python step2_reward/main.py --model output/step1_sft/model --output-dir out/step2 --max-steps 50
    deepspeed --num_gpus 2 step2_reward/main.py --model chinese-llama-2-1.3b --zero-stage 3 ...
    dschat train --step 2 ...        (the same flags)

Reads top to bottom: set up, evaluate, train, evaluate, save. The saved ``model/`` folder loads with
``AutoModelForSequenceClassification`` and carries ``reward_mean``/``reward_std`` (of all eval end scores after
training) in its config for reward normalisation in stage 3.
"""

from __future__ import annotations

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
from dschat.config import DataArgs, EngineArgs, LoraArgs, ModelArgs, OptimArgs, RunArgs, arg
from dschat.data import DataCollatorReward, load_phase
from dschat.errors import UserError
from dschat.lora import lora_param_groups
from dschat.losses import PairwiseLossOutput, last_token_pairwise_loss, pairwise_loss, pairwise_metrics
from dschat.models import RewardModel, create_reward_model, load_tokenizer, resolve_model
from dschat.reward_eval import RewardEval, evaluate_reward, is_reward_checkpoint, split_pairs
from dschat.stage import (
    ResumableLoop,
    begin_stage,
    check_finite,
    eval_loader,
    learning_rate,
    plan_steps,
    train_loader,
)
from dschat.tracking import RunTracker, write_eval


@dataclass
class RewardArgs:
    rm_loss: str = arg("pairwise", "Reward loss: 'pairwise' compares the diverging tails token by token "
                                   "(DeepSpeed-Chat, pad-safe; SPEC 4); 'last-token' compares end scores, minus "
                                   "each row's optional 'margin'.", choices=("pairwise", "last-token"))
    rm_center_coef: float = arg(0.0, "Weight of the centring term coef * (score_c + score_x)^2 that keeps scores "
                                     "near zero (--rm-loss last-token only).")


@dataclass
class RewardConfig:
    model: ModelArgs = field(default_factory=ModelArgs)
    data: DataArgs = field(default_factory=DataArgs)
    optim: OptimArgs = field(default_factory=OptimArgs)
    engine: EngineArgs = field(default_factory=EngineArgs)
    lora: LoraArgs = field(default_factory=LoraArgs)
    run: RunArgs = field(default_factory=RunArgs)
    reward: RewardArgs = field(default_factory=RewardArgs)


def reward_loss(values: torch.Tensor, batch: dict[str, torch.Tensor], args: RewardArgs) -> PairwiseLossOutput:
    """The stage-2 loss of one ``DataCollatorReward`` batch from the per-token values ``(2B, T)``."""
    chosen, rejected = split_pairs(batch)
    b = chosen["input_ids"].size(0)
    if args.rm_loss == "last-token":
        scores = RewardModel.end_scores(values, batch["attention_mask"])  # (2B,)
        return last_token_pairwise_loss(scores[:b], scores[b:], batch.get("margin"), args.rm_center_coef)
    return pairwise_loss(values[:b], values[b:], chosen["input_ids"], rejected["input_ids"],
                         chosen["attention_mask"], rejected["attention_mask"])


def eval_metrics(ev: RewardEval) -> dict[str, float]:
    return {"accuracy": ev.accuracy, "chosen_score": ev.chosen_score, "rejected_score": ev.rejected_score,
            "margin": ev.margin}


def run(cfg: RewardConfig) -> dict[str, Any]:
    if cfg.reward.rm_center_coef and cfg.reward.rm_loss != "last-token":
        raise UserError("--rm-center-coef applies to --rm-loss last-token only")
    stage = begin_stage(cfg, "step2_reward", "output/step2_reward")
    started = time.time()
    with E.main_process_first():  # rank 0 materialises the tiny preset and the data cache; the rest read them
        model_path = resolve_model(cfg.model.model)
        tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code)
        data = load_phase(cfg.data, 2, tokenizer, cfg.run.seed, log=stage.log if E.is_main() else lambda _: None)
    if cfg.reward.rm_loss == "pairwise" and any("margin" in r for r in data.train):
        stage.log("note: rows carry a 'margin'; only --rm-loss last-token uses it")
    pad = tokenizer.pad_token_id
    collator = DataCollatorReward(pad)
    loader = train_loader(data.train, cfg.optim.per_device_train_batch_size, collator, cfg.run.seed)
    evals = eval_loader(data.eval, cfg.optim.per_device_eval_batch_size, collator)
    total_steps, epochs = plan_steps(len(loader), cfg.optim)

    dtype = E.resolve_dtype(cfg.model.dtype)
    model = create_reward_model(model_path, dtype, cfg.model.dropout, cfg.model.gradient_checkpointing,
                                pad_token_id=pad, trust_remote_code=cfg.model.trust_remote_code, lora=cfg.lora)
    if not is_reward_checkpoint(model_path, cfg.model.trust_remote_code):
        # A fresh v_head starts at zero: every score is 0, so the untrained model has no preference (accuracy
        # exactly 0.5, ties counting half). A random head projects end states that already differ in style and
        # can score 0.95 or 0.05 by chance, which hides what training did.
        torch.nn.init.zeros_(model.v_head.weight)
    n_params = sum(p.numel() for p in model.parameters())
    lr = learning_rate(cfg.optim, cfg.model.model, n_params)
    engine = E.build_train_engine(model, engine=cfg.engine, optim=cfg.optim, dtype=dtype, total_steps=total_steps,
                                  lr=lr, param_groups=lora_param_groups(model, cfg.optim.weight_decay, lr,
                                                                        cfg.lora.lora_learning_rate))
    stage.log(f"model {model_path} | {n_params / 1e6:.2f}M params | loss {cfg.reward.rm_loss} | "
              f"train pairs {len(data.train)} eval pairs {len(data.eval)} | {total_steps} optimizer steps | "
              f"lr {lr:g} | ZeRO {cfg.engine.zero_stage} | world {E.world_size()}")

    loop = ResumableLoop(stage, engine, tokenizer, cfg.run)
    state = loop.state
    if state.get("before"):
        before: RewardEval | None = RewardEval(**state["before"])
    else:
        before = evaluate_reward(engine, evals) if data.eval else None
    tracker = RunTracker(stage.output_dir, E.is_main(), total_steps, cfg.run.progress, desc="reward")
    if before and loop.resumed_from is None:
        tracker.log(0, eval_metrics(before), prefix="eval/")

    engine.train()
    dev = E.device()
    accum = cfg.optim.gradient_accumulation_steps
    tracker.advance(loop.step)
    loop.extras = {"before": before.as_dict() if before else None,
                   "first_loss": state.get("first_loss", float("nan")),
                   "last_loss": state.get("last_loss", float("nan"))}
    window = torch.zeros(4, dtype=torch.float64)  # summed over micro-batches: loss, accuracy, chosen, rejected

    def micro_step(batch: dict[str, Any]) -> None:
        values = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])  # (2B, T)
        out = reward_loss(values, batch, cfg.reward)
        engine.backward(out.loss)
        engine.step()
        m = pairwise_metrics(out.chosen_scores, out.rejected_scores)
        window.add_(torch.tensor([out.loss.item(), m.accuracy.item(), m.chosen_mean.item(), m.rejected_mean.item()],
                                 dtype=torch.float64))

    def on_step(step: int, epoch: int) -> None:
        loss, acc, chosen, rejected = E.all_reduce_mean((window / accum).to(dev)).tolist()
        check_finite(loss, step)
        if step == 1:
            loop.extras["first_loss"] = loss
        loop.extras["last_loss"] = loss
        if step % cfg.run.log_interval == 0 or step == total_steps:
            tracker.log(step, {"train/loss": loss, "train/accuracy": acc, "train/chosen_score": chosen,
                               "train/rejected_score": rejected, "train/lr": engine.get_lr()[0],
                               "train/epoch": epoch})
        tracker.advance(1, loss=loss, acc=acc)
        window.zero_()
        if cfg.run.eval_interval and step % cfg.run.eval_interval == 0 and step < total_steps and data.eval:
            tracker.log(step, eval_metrics(evaluate_reward(engine, evals)), prefix="eval/")

    loop.run(loader, epochs, total_steps, micro_step, on_step)
    step, first_loss, last_loss = loop.step, loop.extras["first_loss"], loop.extras["last_loss"]

    after = evaluate_reward(engine, evals) if data.eval else None
    if after:
        tracker.log(step, eval_metrics(after), prefix="eval/")
    tracker.close()
    # Stage 3 normalises rewards by these; without held-out pairs, score (up to max_eval_rows) training pairs.
    stats = after or evaluate_reward(
        engine, eval_loader(data.train[: cfg.data.max_eval_rows or None], cfg.optim.per_device_eval_batch_size,
                            collator))
    save_hf(engine, tokenizer, stage.output_dir / "model",
            config_updates={"reward_mean": stats.score_mean, "reward_std": stats.score_std})

    def metric(ev: RewardEval | None, key: str) -> float | None:
        return getattr(ev, key) if ev else None

    metrics: dict[str, Any] = {}
    for key in ("accuracy", "chosen_score", "rejected_score", "margin"):
        metrics[key], metrics[f"{key}_before"] = metric(after, key), metric(before, key)
    metrics.update({
        "reward_mean": stats.score_mean, "reward_std": stats.score_std,
        "eval_pairs": after.pairs if after else 0, "eval_ties": after.ties if after else 0,
        "train_loss_first": first_loss, "train_loss_last": last_loss, "steps": step, "learning_rate": lr,
        "rm_loss": cfg.reward.rm_loss, "seconds": round(time.time() - started, 1),
        **data.counts, "sources": data.sources,
    })
    if E.is_main():
        write_eval(stage.output_dir, metrics)
        if before and after:
            stage.log(f"accuracy {before.accuracy:.4f} -> {after.accuracy:.4f} | margin {before.margin:.3f} -> "
                      f"{after.margin:.3f} on {after.pairs} eval pairs")
        stage.log(f"reward mean {stats.score_mean:.4f} std {stats.score_std:.4f}; saved {stage.output_dir / 'model'}")
    return metrics


command = stage_command("step2_reward", RewardConfig, run,
                        help="Stage 2: reward model on chosen/rejected pairs (SPEC sections 2, 3, 4, 8).")

if __name__ == "__main__":
    run_command(command)
