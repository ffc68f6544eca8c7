"""Stage 2: a reward model (LM backbone + v_head) trained on chosen/rejected pairs.

    python step2_reward/main.py --model output/step1_sft/model --output-dir out/step2 --max-steps 50
    deepspeed --num_gpus 2 step2_reward/main.py --model chinese-llama-2-1.3b --zero-stage 3 ...
    dschat train --step 2 ...        (the same flags)

Reads top to bottom: the model, the loss of one micro-batch, the shared one-model loop (``dschat.training.one_model``),
then save and report. The saved ``model/`` folder loads with ``AutoModelForSequenceClassification`` and carries
``reward_mean``/``reward_std`` (of all eval end scores after training; without eval pairs, of an evenly spaced
64-pair sample of the training pairs) in its config for reward normalisation in stage 3.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dschat.cli.options import run_command, stage_command
from dschat.config import RewardConfig

if TYPE_CHECKING:
    import torch

EVAL_KEYS = ("accuracy", "chosen_score", "rejected_score", "margin")


def make_model(cfg: RewardConfig, path: str, dtype: torch.dtype, tokenizer: Any) -> torch.nn.Module:
    import torch

    from dschat.models.loading import create_reward_model
    from dschat.models.reward_model import is_reward_checkpoint

    model = create_reward_model(path, dtype, cfg.model.dropout, cfg.model.gradient_checkpointing,
                                pad_token_id=tokenizer.pad_token_id, trust_remote_code=cfg.model.trust_remote_code,
                                lora=cfg.lora)
    if not is_reward_checkpoint(path, cfg.model.trust_remote_code):
        # A fresh v_head starts at zero: every score is 0, so the untrained model has no preference (accuracy
        # exactly 0.5, ties counting half). A random head projects end states that already differ in style and
        # can score 0.95 or 0.05 by chance, which hides what training did.
        torch.nn.init.zeros_(model.v_head.weight)
    return model


def run(cfg: RewardConfig) -> dict[str, Any]:
    # The training stack (torch, DeepSpeed, transformers) is imported by the run, not by the module: declaring the
    # flags (``--help``, ``dschat plan``, ``dschat doctor``) needs none of it.
    from dschat import engine as E
    from dschat.data import DataCollatorReward
    from dschat.demo import demo_data
    from dschat.evaluation.reward_model import evaluate_reward, stats_sample
    from dschat.losses import pairwise_metrics
    from dschat.training.checkpoint import save_hf
    from dschat.training.one_model import OneModelStage, train_one_model
    from dschat.training.reward import reward_loss, reward_values
    from dschat.training.run_tracker import write_eval
    from dschat.training.stage import eval_loader

    def micro_step(engine: Any, batch: dict[str, Any]) -> dict[str, float]:
        values = reward_values(engine, batch)  # (2B, T), packed (--packing) or not
        out = reward_loss(values, batch, cfg.reward.rm_loss, cfg.reward.rm_center_coef)
        engine.backward(out.loss)
        E.optimizer_step(engine)
        m = pairwise_metrics(out.chosen_scores, out.rejected_scores)
        return {"loss": out.loss.item(), "accuracy": m.accuracy.item(), "chosen_score": m.chosen_mean.item(),
                "rejected_score": m.rejected_mean.item()}

    spec = OneModelStage(
        name="step2_reward", phase=2, collator=DataCollatorReward, logged=EVAL_KEYS, micro_step=micro_step,
        default_data=demo_data,
        evaluate=lambda engine, loader: evaluate_reward(engine, loader).as_dict(),
        make_model=lambda path, dtype, tok: make_model(cfg, path, dtype, tok), describe=f" | loss {cfg.reward.rm_loss}",
        check_data=lambda data, log: log("note: rows carry a 'margin'; only --rm-loss last-token uses it")
        if cfg.reward.rm_loss == "pairwise" and any("margin" in r for r in data.train) else None)
    t = train_one_model(cfg, spec)
    before, after = t.before, t.after
    # Stage 3 normalises rewards by these: the eval pairs' scores just computed; without held-out pairs, a small
    # evenly spaced sample of training pairs (reward_eval.STATS_PAIRS), not a second pass over the data.
    stats = after or evaluate_reward(t.engine, eval_loader(stats_sample(t.data.train),
                                                           cfg.optim.per_device_eval_batch_size, t.collator)).as_dict()
    save_hf(t.engine, t.tokenizer, t.stage.output_dir / "model",
            config_updates={"reward_mean": stats["score_mean"], "reward_std": stats["score_std"]})
    metrics: dict[str, Any] = {}
    for key in EVAL_KEYS:
        metrics[key], metrics[f"{key}_before"] = after.get(key), before.get(key)
    metrics.update({
        "reward_mean": stats["score_mean"], "reward_std": stats["score_std"], "reward_stats_pairs": stats["pairs"],
        "eval_pairs": after.get("pairs", 0),
        "eval_ties": after.get("ties", 0), "train_loss_first": t.first_loss, "train_loss_last": t.last_loss,
        "steps": t.steps, "alarms": t.alarms, "learning_rate": t.lr, "rm_loss": cfg.reward.rm_loss,
        "seconds": round(t.seconds, 1),
        **t.data.counts, "sources": t.data.sources,
    })
    if E.is_main():
        write_eval(t.stage.output_dir, metrics)
        if before and after:
            t.stage.log(f"accuracy {before['accuracy']:.4f} -> {after['accuracy']:.4f} | margin "
                        f"{before['margin']:.3f} -> {after['margin']:.3f} on {after['pairs']} eval pairs")
        t.stage.log(f"reward mean {stats['score_mean']:.4f} std {stats['score_std']:.4f}; saved "
                    f"{t.stage.output_dir / 'model'}")
    return metrics


command = stage_command("step2_reward", RewardConfig, run,
                        help="Stage 2: reward model on chosen/rejected pairs.")

if __name__ == "__main__":
    run_command(command)
