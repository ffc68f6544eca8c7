"""``dschat eval``: score a saved model without training it, with the code the stages evaluate with.

``--step 1`` gives a causal LM's loss and perplexity on the held-out SFT rows (``dschat.evaluation.lm``, stage 1's
own evaluation). ``--step 2`` evaluates a reward model (a stage-2 output, or any HF sequence-classification
folder with one label) on every row of pairwise files (``dschat.evaluation.reward_model``, stage 2's loop). ``--step 3``
samples a policy's answers to the held-out prompts and scores them with any of stage 3's reward sources, alone or
against a ``--baseline`` (``dschat.apps.saved_policy``). ``--judge`` evaluates a generative judge (RM-R1) on every
row of judge-pairwise files (``dschat.cli.judge``).

Steps 1 and 3 choose their rows as the stages do (``--data-split``, ``--eval-fraction``, ``--max-eval-rows``,
``--seed``; without ``--data``, the demo corpus, the stages' own default), so a stage's held-out figures can be
reproduced. The flags the command shares with the stages are generated from the stages' declarations
(``eval_flags``); a flag that does nothing in the chosen mode stops with one line. Registered on the ``dschat``
group by ``dschat.cli.main``; heavy imports (torch, deepspeed, transformers) wait until the command runs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import click

from dschat.cli.judge import print_judge_metrics, sampling_options
from dschat.cli.options import DeclaredFlagsCommand, given_flags, refuse_given
from dschat.config import (
    VLLM_FLAGS,
    AgentArgs,
    DataArgs,
    ModelArgs,
    SFTConfig,
    VLLMArgs,
    backend_help,
    build_config,
    piece,
)
from dschat.demo import demo_data
from dschat.errors import UserError
from dschat.evaluation.judge import evaluate_judge_files
from dschat.rewards.judge import SamplingArgs
from dschat.utils import write_json


@functools.cache
def eval_flags() -> type:
    """``EvalFlags``: the flags ``dschat eval`` shares with the stages, from the stages' own declarations (made when
    the command runs: stage 3's pieces import deepspeed)."""
    from dschat.rlhf.config import RewardArgs, RLArgs

    return dataclasses.make_dataclass("EvalFlags", [
        ("model", ModelArgs, piece(ModelArgs, only=("dtype", "trust_remote_code"))),
        ("data", DataArgs, piece(DataArgs, help={
            "data": "Evaluation data (repeatable, path[:weight]). --step 2: pairwise files, --judge: judge-pairwise "
                    "files, every row scored. --step 1 and 3: the held-out rows of train phase 1 or 3, chosen as "
                    "the stage chooses them (default: the demo corpus, as for the stages)."})),
        ("rewards", RewardArgs, piece(RewardArgs, help={
            "reward_model": "--step 3: reward model (a step-2 output) of the reward source 'rm', the default "
                            "source when --reward-funcs is not given.",
            "reward_funcs": "--step 3: reward source (repeatable): rm (the reward model's end score), format, "
                            "accuracy, judge_match, overlong, judge (a generative judge, --judge-model), or "
                            "path/to/file.py:function. Default: rm with --reward-model, else none.",
            "judge_max_new_tokens": "--step 3: longest completion of the judge (--judge-model).",
            "judge_model": "--step 3: a generative judge (RM-R1). With --baseline it compares the policy's answer "
                           "with the baseline's to each prompt in both orders (the judge's win rate); with "
                           "--reward-funcs judge it is also that reward source (each answer against the row's "
                           "reference answer)."})),
        ("rl", RLArgs, piece(RLArgs, only=("top_k", "generation_backend"),
                             help={"generation_backend": backend_help("dschat (--judge: hf)")})),
        ("vllm", VLLMArgs, dataclasses.field(default_factory=VLLMArgs)),
        ("agent", AgentArgs, dataclasses.field(default_factory=AgentArgs)),
    ])


# Which flags act in which mode (click parameter names); any other flag given on the command line is refused.
MODE_FLAGS: dict[str, frozenset[str]] = {
    "--step 1": frozenset({"step", "data", "data_split", "data_cache_dir", "max_seq_len", "eval_fraction",
                           "max_eval_rows", "mask_prompt", "seed", "progress"}),
    "--step 2": frozenset({"step", "data", "max_seq_len"}),
    "--step 3": frozenset({"step", "data", "data_split", "data_cache_dir", "max_prompt_seq_len", "eval_fraction",
                           "max_eval_rows", "seed", "progress", "baseline", "num_samples", "reward_model",
                           "reward_funcs", "reward_weights", "judge_model", "judge_max_new_tokens",
                           "judge_system_prompt", "overlong_buffer", "overlong_factor", "reward_timeout",
                           "reward_retries", "reward_backoff", "reward_request_rows", "reward_token_file",
                           "max_new_tokens", "temperature", "top_p", "top_k", "generation_backend", *VLLM_FLAGS,
                           "tools", "env", "env_column", "max_turns", "tool_timeout", "tool_max_output",
                           "baseline_without_tools"}),
    "--judge": frozenset({"judge", "data", "votes", "max_new_tokens", "temperature", "top_p", "seed",
                          "judge_system_prompt", "progress", "generation_backend"}),
}
EVERY_MODE = frozenset({"model", "output", "batch_size", "dtype", "trust_remote_code"})


def refuse(given: dict[str, str], mode: str) -> None:
    """Stop on the first flag given that does nothing in ``mode`` (one line, exit code 2)."""
    for name, flag in sorted(given.items()):
        if name not in MODE_FLAGS[mode] | EVERY_MODE:
            raise UserError(f"{flag} has no effect with {mode}")


def refuse_step3(given: dict[str, str], cfg: Any, baseline: str) -> None:
    """--step 3's settings that do nothing with the chosen reward sources and models."""
    from dschat.apps.saved_policy import reward_sources  # torch: imported when the command runs
    from dschat.rewards.names import reward_sources as sources_of
    from dschat.rewards.remote import is_remote
    from dschat.rlhf.config import REMOTE_FLAGS, check_agent, vllm_inert

    names, r = sources_of(reward_sources(cfg.rewards, cfg.agent)), cfg.rewards
    inert = {}
    if not r.judge_model:
        inert.update({n: "without --judge-model" for n in ("judge_max_new_tokens", "judge_system_prompt")})
    elif not baseline and "judge" not in names:
        inert["judge_model"] = "without --baseline (the judge's win rate) or --reward-funcs judge"
    if "overlong" not in names:
        inert.update({n: "without the reward source 'overlong'" for n in ("overlong_buffer", "overlong_factor")})
    if not any(is_remote(n) for n in names):
        inert.update({n: "without a remote reward source (--reward-funcs http://...)" for n in REMOTE_FLAGS})
    if r.reward_model and "rm" not in names:
        inert["reward_model"] = "without the reward source 'rm' in --reward-funcs"
    if not names:
        inert["reward_weights"] = "without a reward source"
    inert.update(vllm_inert(cfg.rl.generation_backend))
    inert.update(cfg.agent.inert_fields())
    if not (cfg.agent.tools or cfg.agent.env) or not baseline:
        inert["baseline_without_tools"] = "without --baseline and --tools or --env"
    refuse_given(given, inert)
    check_agent(cfg.agent, names)


def log(text: str) -> None:
    click.echo(text, err=True)


@click.command("eval", cls=DeclaredFlagsCommand, flags=eval_flags, context_settings={"max_content_width": 110})
@click.option("--step", type=click.IntRange(1, 3), default=2, show_default=True,
              help="What to evaluate: 1 = a causal LM's perplexity on held-out SFT rows; 2 = a reward model on "
                   "pairwise data; 3 = a policy's sampled answers to held-out prompts, scored by reward sources "
                   "(and against --baseline).")
@click.option("--judge", is_flag=True, help="Evaluate a generative judge (RM-R1) on judge-pairwise rows instead: "
                                            "accuracy, unparseable rate, position bias.")
@click.option("--model", required=True, help="Saved model folder: a stage output stands for its actor/ or model/ "
                                             "(--step 2: model/), or an HF folder, id in the cache, alias or 'tiny'.")
@click.option("--baseline", default="", help="--step 3: the model to compare the policy with (e.g. its step-1 "
                                             "model): same prompts, same sampling seeds; paired gain, win rate, "
                                             "KL of the policy to it.")
@click.option("--baseline-without-tools", "--baseline_without_tools", "baseline_without_tools", is_flag=True,
              help="--step 3 with --tools or --env: the baseline answers without them (the same model as the policy "
                   "measures what the tools add).")
@click.option("--num-samples", "--num_samples", "num_samples", type=click.IntRange(min=1), default=1,
              show_default=True, help="--step 3: answers per prompt (rewards averaged per prompt; pass@k of the "
                                      "pass/fail sources for k = 1, 2, 4, ..., n).")
@click.option("--output", type=click.Path(dir_okay=False), default=None, help="Write the metrics here as JSON.")
@click.option("--batch-size", "--batch_size", "batch_size", type=int, default=16, show_default=True,
              help="Rows per forward pass or generation batch (--step 3: the stage's --per-device-eval-batch-size; "
                   "the same value gives the stage's exact samples).")
@sampling_options(policy=True)
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show a progress bar.")
def eval_command(step: int, judge: bool, model: str, baseline: str, baseline_without_tools: bool,
                 num_samples: int, output: str | None,
                 batch_size: int, votes: int, max_new_tokens: int, temperature: float, top_p: float, seed: int,
                 progress: bool, **shared: Any) -> None:
    """Evaluate a saved model: --step 1 (perplexity), --step 2 (reward model), --step 3 (policy, optionally
    against --baseline), or --judge (a generative judge)."""
    mode = "--judge" if judge else f"--step {step}"
    given = given_flags()
    refuse(given, mode)
    if batch_size < 1:
        raise UserError("--batch-size must be at least 1")
    if judge:
        s = SamplingArgs(max_new_tokens=max_new_tokens, votes=votes, temperature=temperature, top_p=top_p,
                         batch_size=batch_size, seed=seed, backend=shared["generation_backend"])
        metrics = evaluate_judge_files(model, _need_data(shared, mode), s, shared["judge_system_prompt"],
                                       shared["dtype"], shared["trust_remote_code"], progress=progress, log=log)
        print_judge_metrics(metrics)
    elif step == 1:
        metrics = _eval_sft(model, batch_size, seed, progress, shared)
    elif step == 2:
        metrics = _eval_reward_model(model, batch_size, shared)
    else:
        if max_new_tokens < 1:
            raise UserError("--max-new-tokens must be at least 1")
        from dschat.rlhf.config import RLHFConfig  # deepspeed: imported when the command runs

        values = {**shared, "actor_model": model, "max_answer_seq_len": max_new_tokens, "temperature": temperature,
                  "top_p": top_p, "per_device_eval_batch_size": batch_size, "seed": seed, "progress": progress}
        cfg = build_config(RLHFConfig, {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()})
        refuse_step3(given, cfg, baseline)
        from dschat.apps.saved_policy import evaluate_policy  # torch: imported when the command runs

        metrics = evaluate_policy(cfg, baseline, num_samples, default_data=demo_data, progress=progress, log=log,
                                  baseline_tools=not baseline_without_tools)
        print_policy_metrics(metrics)
    if output:
        write_json(output, metrics)
        click.echo(f"wrote {output}", err=True)


def _need_data(shared: dict[str, Any], mode: str) -> list[str]:
    if not shared["data"]:
        raise UserError(f"dschat eval {mode} needs --data (every row of the files is scored)")
    return list(shared["data"])


def _eval_sft(model: str, batch_size: int, seed: int, progress: bool, shared: dict[str, Any]) -> dict[str, Any]:
    from dschat.evaluation.lm import evaluate_saved_lm  # torch: imported when the command runs

    names = {"data", "data_split", "data_cache_dir", "max_seq_len", "eval_fraction", "max_eval_rows", "mask_prompt",
             "dtype", "trust_remote_code"}
    values = {k: list(v) if isinstance(v, tuple) else v for k, v in shared.items() if k in names}
    cfg = build_config(SFTConfig, {**values, "model": model, "per_device_eval_batch_size": batch_size,
                                   "seed": seed})
    m = evaluate_saved_lm(cfg, default_data=demo_data, progress=progress, log=log)
    click.echo(f"model: {m['model']}")
    dropped = ", ".join(f"{k.removeprefix('dropped_')}={v}" for k, v in sorted(m.items())
                        if k.startswith("dropped_") and v)
    click.echo(f"held-out rows: {m['eval_rows']}" + (f" (dropped: {dropped})" if dropped else ""))
    click.echo(f"loss: {m['loss']:.4f}")
    click.echo(f"perplexity: {m['perplexity']:.4f}")
    return m


def _eval_reward_model(model: str, batch_size: int, shared: dict[str, Any]) -> dict[str, Any]:
    from dschat.evaluation.reward_model import evaluate_saved_reward_model  # torch: imported when the command runs

    metrics = evaluate_saved_reward_model(model, _need_data(shared, "--step 2"), batch_size, shared["max_seq_len"],
                                          shared["dtype"], shared["trust_remote_code"], log=log)
    dropped = ", ".join(f"{k.removeprefix('dropped_')}={v}" for k, v in sorted(metrics.items())
                        if k.startswith("dropped_"))
    click.echo(f"reward model: {metrics['model']}")
    click.echo(f"pairs: {metrics['pairs']}" + (f" (dropped: {dropped})" if dropped else ""))
    for key in ("accuracy", "chosen_score", "rejected_score", "margin"):
        click.echo(f"{key}: {metrics[key]:.4f}")
    return metrics


def print_policy_metrics(m: dict[str, Any]) -> None:
    """``dschat eval --step 3``'s figures as one screen: a row per metric, a column per model, and the paired
    difference."""

    def f(v: Any, digits: int = 3, sign: bool = False) -> str:
        if v is None:
            return "-"
        return f"{v:+.{digits}f}" if sign else f"{v:.{digits}f}"

    def pm(v: Any, se: Any, sign: bool = False) -> str:
        return f(v, sign=sign) + (f" ± {f(se)}" if se is not None and v is not None else "")

    pol, base, pair = m["policy"], m.get("baseline"), m.get("paired", {})
    rewards = " + ".join(f"{w:g}*{n}" for n, w in zip(m["reward_funcs"], m["reward_weights"], strict=True))
    click.echo(f"policy:   {m['policy_model']}")
    if base is not None:
        click.echo(f"baseline: {m['baseline_model']}")
    click.echo(f"prompts:  {m['prompts']} held-out, {m['num_samples']} sample(s) each, max {m['max_new_tokens']} "
               f"new tokens, temperature {m['temperature']:g}, top_p {m['top_p']:g}, top_k {m['top_k']}, "
               f"seed {m['seed']}")
    click.echo(f"rewards:  {rewards or '-'}" + (f"; judge {m['judge_model']}" if m.get("judge_model") else ""))
    if m.get("tools") or m.get("envs"):
        acting = ", ".join([*(f"tool {t}" for t in m["tools"]), *(f"env {e}" for e in m["envs"])])
        click.echo(f"acting:   {acting}" + ("" if m.get("baseline_tools", True) or base is None
                                             else " (the baseline without)"))
    rows: list[tuple[str, str, str, str]] = []
    if "reward" in pol:
        rows.append(("reward", pm(pol["reward"], pol["reward_se"]),
                     pm(base["reward"], base["reward_se"]) if base else "",
                     pm(pair.get("reward_gain"), pair.get("reward_gain_se"), sign=True) if base else ""))
        for n in m["reward_funcs"] if m["reward_funcs"] != ["rm"] else []:
            rows.append((f"  {n}", f(pol[f"reward/{n}"]), f(base[f"reward/{n}"]) if base else "",
                         pm(pair.get(f"reward/{n}_gain"), pair.get(f"reward/{n}_gain_se"), sign=True)
                         if base else ""))
    for n, table in pol.get("pass_at_k", {}).items():
        for k, v in table.items():
            b = base["pass_at_k"][n][k] if base else None
            rows.append((f"{k} {n}", pm(v["value"], v["se"]), pm(b["value"], b["se"]) if b else "",
                         f(v["value"] - b["value"], sign=True) if b else ""))
    if pol.get("kl") is not None:
        rows.append(("KL to baseline", pm(pol["kl"], pol.get("kl_se")), "", ""))
    rows.append(("answer length", f(pol["answer_length"], 1), f(base["answer_length"], 1) if base else "",
                 f(pol["answer_length"] - base["answer_length"], 1, sign=True) if base else ""))
    rows.append(("EOS rate", f(pol["eos_rate"]), f(base["eos_rate"]) if base else "",
                 f(pol["eos_rate"] - base["eos_rate"], sign=True) if base else ""))
    if "win_rate" in pair:
        rows.append(("win rate (reward)", pm(pair["win_rate"], pair["win_rate_se"]), "",
                     f"W {pair['wins']} / T {pair['ties']} / L {pair['losses']}"))
    if "judge_win_rate" in pair:
        rows.append(("win rate (judge)", pm(pair["judge_win_rate"], pair["judge_win_rate_se"]), "",
                     f"W {pair['judge_wins']} / T {pair['judge_ties']} / L {pair['judge_losses']}"))
    header = ("", "policy", "baseline" if base else "", "policy - baseline" if base else "")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    for r in [header, *rows]:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
