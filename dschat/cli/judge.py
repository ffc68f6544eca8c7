"""``dschat eval --judge`` and ``dschat judge``: a generative judge (RM-R1) on held-out rows, or on one pair.

    dschat eval --judge --model out/judge/step3_judge --data held_out.jsonl --votes 5 --output judge.json
    dschat judge --model out/judge/step3_judge --question "..." --answer-a "..." --answer-b "..."

Both use ``dschat.rewards.judge``: the same prompt, the same batched generation and the verdict rule
``judge_match`` trains with (the evaluation itself: ``dschat.evaluation.judge``). torch and transformers are
imported when a command runs."""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any

import click

from dschat.cli.options import DeclaredFlagsCommand, declared_config, given_flags, refuse_given
from dschat.config import ModelArgs, backend_help, piece
from dschat.errors import UserError
from dschat.prompts import read_system_prompt
from dschat.rewards.judge import SamplingArgs, judge_messages, judge_prompts, load_judge, prompt_budget


def sampling_options(fn: Any = None, *, policy: bool = False) -> Any:
    """The sampling flags ``eval --judge`` and ``judge`` share; ``policy=True`` (``dschat eval``) says in their
    help that they also drive the policy's sampling under ``--step 3``."""
    if fn is None:
        return lambda f: sampling_options(f, policy=policy)
    also = {"max_new_tokens": " (--step 3: longest policy answer, the stage's --max-answer-seq-len)",
            "temperature": " (--step 3: the policy's sampling temperature)",
            "top_p": " (--step 3: the policy's)",
            "seed": " (--step 3: also the data split, as the stage's --seed)"} if policy else {}
    options = [
        click.option("--votes", type=int, default=1, show_default=True,
                     help="Completions per row: 1 is greedy; k > 1 samples k and takes the majority of the "
                          "parseable verdicts (a tie or none is unparseable)."),
        click.option("--max-new-tokens", "--max_new_tokens", "max_new_tokens", type=int, default=128,
                     show_default=True, help="Longest judge completion in tokens" + also.get("max_new_tokens", "")
                     + "."),
        click.option("--temperature", type=float, default=1.0, show_default=True,
                     help="Sampling temperature with --votes > 1" + also.get("temperature", "") + "."),
        click.option("--top-p", "--top_p", "top_p", type=float, default=1.0, show_default=True,
                     help="Nucleus sampling threshold with --votes > 1" + also.get("top_p", "") + "."),
        click.option("--seed", type=int, default=1234, show_default=True,
                     help="Seed of the sampling" + also.get("seed", "") + "."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def print_judge_metrics(m: dict[str, Any]) -> None:
    def f(v: Any) -> str:
        return f"{v:.4f}" if isinstance(v, float) else "-"

    click.echo(f"judge: {m['model']}")
    click.echo(f"rows: {m['n']} (winner A {m['rows_winner_a']}, B {m['rows_winner_b']}), votes {m['votes']}")
    dropped = {k.removeprefix("dropped_"): v for k, v in sorted(m.items()) if k.startswith("dropped_") and v}
    if dropped:
        click.echo("dropped: " + ", ".join(f"{k} {v}" for k, v in dropped.items()))
    click.echo(f"accuracy: {f(m['accuracy'])} ± {f(m['accuracy_se'])}")
    click.echo(f"unparseable_rate: {f(m['unparseable_rate'])}")
    click.echo(f"accuracy_when_a: {f(m['accuracy_when_a'])}")
    click.echo(f"accuracy_when_b: {f(m['accuracy_when_b'])}")
    click.echo(f"position_bias: {f(m['position_bias'])}")
    click.echo(f"format_rate: {f(m['format_rate'])} (one <think>...</think> then one <answer>...</answer>)")


@functools.cache
def judge_flags() -> type:
    """``JudgeFlags``: the flags ``dschat judge`` shares with the commands that sample, from their declarations
    (made when the command parses its arguments or shows its help: stage 3's pieces are imported then); the
    judge's ``auto`` falls back to HF generate."""
    from dschat.rlhf.config import RLArgs

    return dataclasses.make_dataclass("JudgeFlags", [
        ("model", ModelArgs, piece(ModelArgs, only=("dtype", "trust_remote_code"))),
        ("rl", RLArgs, piece(RLArgs, only=("generation_backend",), help={"generation_backend": backend_help("hf")})),
    ])


# What one vote leaves without effect: it is greedy.
ONE_VOTE_INERT = {n: "without --votes > 1 (one vote is greedy)" for n in ("temperature", "top_p", "seed")}


@click.command("judge", cls=DeclaredFlagsCommand, flags=judge_flags, context_settings={"max_content_width": 110})
@click.option("--model", required=True, help="Judge model: a folder (a stage output stands for its actor/ or "
                                             "model/), an HF id in the cache, an alias or 'tiny'.")
@click.option("--question", required=True, help="The question both answers reply to.")
@click.option("--answer-a", "--answer_a", "answer_a", required=True, help="Answer A.")
@click.option("--answer-b", "--answer_b", "answer_b", required=True, help="Answer B.")
@click.option("--system-prompt", "--system_prompt", "system_prompt", default="",
              help="File holding the rubric system message (default: the demo rubric in the question's language).")
@sampling_options
def judge_command(model: str, question: str, answer_a: str, answer_b: str, system_prompt: str, votes: int,
                  max_new_tokens: int, temperature: float, top_p: float, seed: int, **declared: Any) -> None:
    """Ask a judge which of two answers is better: prints its reasoning, then `verdict: A|B|unparseable`."""
    given = given_flags()
    cfg = declared_config(judge_flags(), declared, given)
    if votes == 1:
        refuse_given(given, ONE_VOTE_INERT)
    for name, text in (("--question", question), ("--answer-a", answer_a), ("--answer-b", answer_b)):
        if not text.strip():
            raise UserError(f"{name} is empty")
    s = SamplingArgs(max_new_tokens=max_new_tokens, votes=votes, temperature=temperature, top_p=top_p, seed=seed,
                     batch_size=1, backend=cfg.rl.generation_backend)
    s.check()
    system = read_system_prompt(system_prompt) if system_prompt else None
    lm, tok, limit = load_judge(model, cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code)
    messages = judge_messages(question, answer_a, answer_b, system)
    [j], cut = judge_prompts(lm, tok, [messages], s, prompt_budget(limit, max_new_tokens))
    if cut:
        click.echo("(prompt cut to fit the judge's positions)", err=True)
    for i, (text, verdict) in enumerate(zip(j.completions, j.verdicts, strict=True)):
        if votes > 1:
            click.echo(f"--- sample {i + 1}/{votes}: {verdict or 'unparseable'}")
        click.echo(text.strip())
    if votes > 1:
        click.echo(f"votes: A {j.verdicts.count('A')}, B {j.verdicts.count('B')}, "
                   f"unparseable {j.verdicts.count(None)}")
    click.echo(f"verdict: {j.verdict or 'unparseable'}")
    sys.stdout.flush()
