"""``dschat eval``: score a saved model on evaluation data without training it.

``--step 2`` evaluates a reward model (a stage-2 output, or any HF sequence-classification folder with one
label) on every row of pairwise files, with the same scoring loop stage 2 uses (``dschat.reward_eval``).
``--judge`` evaluates a generative judge (RM-R1) on every row of judge-pairwise files (``dschat.judge_cmd``).
Registered on the ``dschat`` group by ``dschat.cli``; heavy imports (torch, deepspeed, transformers) wait until
the command runs.
"""

from __future__ import annotations

import click

from dschat.devices import DTYPES, resolve_dtype
from dschat.errors import UserError
from dschat.judge import SamplingArgs
from dschat.judge_cmd import evaluate_judge_files, print_judge_metrics, sampling_options
from dschat.utils import write_json


@click.command("eval")
@click.option("--step", type=click.IntRange(1, 3), default=2, show_default=True,
              help="What to evaluate: 2 = a reward model on pairwise data.")
@click.option("--judge", is_flag=True, help="Evaluate a generative judge (RM-R1) on judge-pairwise rows instead: "
                                            "accuracy, unparseable rate, position bias.")
@click.option("--model", required=True, help="Saved model folder (for --step 2: a stage-2 output or its model/; "
                                             "with --judge: a causal LM, or a stage output holding actor/ or model/).")
@click.option("--data", "data_", multiple=True, required=True,
              help="Pairwise or conversational-pairwise file (repeatable; judge-pairwise with --judge); every row "
                   "is scored.")
@click.option("--output", type=click.Path(dir_okay=False), default=None, help="Write the metrics here as JSON.")
@click.option("--max-seq-len", "--max_seq_len", "max_seq_len", type=int, default=256, show_default=True,
              help="Longer pairs are dropped and counted.")
@click.option("--batch-size", "--batch_size", "batch_size", type=int, default=16, show_default=True,
              help="Pairs per forward pass.")
@click.option("--dtype", type=click.Choice(DTYPES), default="auto", show_default=True,
              help="auto = fp32 on CPU, bf16 (else fp16) on CUDA.")
@click.option("--trust-remote-code/--no-trust-remote-code", default=False, show_default=True)
@sampling_options
@click.option("--judge-system-prompt", "--judge_system_prompt", "judge_system_prompt", default="",
              help="With --judge: a rubric file injected as the system message of rows that have none.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show a progress bar (--judge).")
def eval_command(step: int, judge: bool, model: str, data_: tuple[str, ...], output: str | None, max_seq_len: int,
                 batch_size: int, dtype: str, trust_remote_code: bool, votes: int, max_new_tokens: int,
                 temperature: float, top_p: float, seed: int, judge_system_prompt: str, progress: bool) -> None:
    """Evaluate a saved model: dschat eval --step 2 --model DIR --data pairs.jsonl [--output metrics.json], or a
    judge: dschat eval --judge --model DIR --data judge.jsonl [--votes k]."""
    if judge:
        s = SamplingArgs(max_new_tokens=max_new_tokens, votes=votes, temperature=temperature, top_p=top_p,
                         batch_size=batch_size, seed=seed)
        metrics = evaluate_judge_files(model, list(data_), s, judge_system_prompt, dtype, trust_remote_code,
                                       progress=progress, log=lambda text: click.echo(text, err=True))
        print_judge_metrics(metrics)
        if output:
            write_json(output, metrics)
            click.echo(f"wrote {output}", err=True)
        return
    if step != 2:
        raise UserError(f"dschat eval --step {step} is not yet supported; --step 2 evaluates a reward model")
    if batch_size < 1:
        raise UserError("--batch-size must be at least 1")

    # torch, deepspeed and transformers: imported when the command runs (see the module docstring)
    from dschat import engine as E
    from dschat.data import DataCollatorReward
    from dschat.models import create_reward_model, load_tokenizer, resolve_saved_model
    from dschat.reward_eval import evaluate_reward, is_reward_checkpoint, load_all_pairs
    from dschat.stage import eval_loader

    path = resolve_saved_model(model, inside=("model",))  # a stage-2 output folder stands for its model/
    if not is_reward_checkpoint(path, trust_remote_code):
        raise UserError(f"{path}: not a reward model (its config names no *ForSequenceClassification "
                        "architecture); a causal LM would be scored by a random head")
    from transformers import AutoConfig

    num_labels = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).num_labels
    if num_labels != 1:
        raise UserError(f"{path}: a reward model has one output label, this one has {num_labels}")

    def log(text: str) -> None:
        click.echo(text, err=True)

    tokenizer = load_tokenizer(path, trust_remote_code)
    pairs = load_all_pairs(list(data_), tokenizer, max_seq_len, log=log)
    rm = create_reward_model(path, resolve_dtype(dtype, E.device()), pad_token_id=tokenizer.pad_token_id,
                             trust_remote_code=trust_remote_code)
    rm.to(E.device())
    pad = tokenizer.pad_token_id
    loader = eval_loader(pairs.train, batch_size, DataCollatorReward(pad))
    result = evaluate_reward(rm, loader)

    metrics = {"model": path, "data": list(data_), "accuracy": result.accuracy,
               "chosen_score": result.chosen_score, "rejected_score": result.rejected_score,
               "margin": result.margin, "score_mean": result.score_mean, "score_std": result.score_std,
               "pairs": result.pairs, "ties": result.ties, **pairs.counts, "sources": pairs.sources}
    dropped = ", ".join(f"{k.removeprefix('dropped_')}={v}" for k, v in sorted(pairs.counts.items())
                        if k.startswith("dropped_"))
    click.echo(f"reward model: {path}")
    click.echo(f"pairs: {result.pairs}" + (f" (dropped: {dropped})" if dropped else ""))
    click.echo(f"accuracy: {result.accuracy:.4f}")
    click.echo(f"chosen_score: {result.chosen_score:.4f}")
    click.echo(f"rejected_score: {result.rejected_score:.4f}")
    click.echo(f"margin: {result.margin:.4f}")
    if output:
        write_json(output, metrics)
        click.echo(f"wrote {output}", err=True)
