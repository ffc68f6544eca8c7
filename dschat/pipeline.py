"""``dschat pipeline``: run stages 1 -> 2 -> 3 (or 1 -> GRPO), each consuming the previous stage's checkpoint.

Each stage runs in its own process (``dschat train --step N``), so memory is returned between stages and
``--num-gpus``/``--hostfile`` work as for ``train``. A stage whose output folder already holds a finished run
(``eval.json``) is skipped unless ``--force``.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click

from dschat.cli import main
from dschat.errors import UserError
from dschat.utils import write_json

STAGES = {"sft": 1, "rm": 2, "ppo": 3, "grpo": 3}
FOLDERS = {"sft": "step1_sft", "rm": "step2_reward", "ppo": "step3_rlhf", "grpo": "step3_grpo"}
ORDER = ["sft", "rm", "ppo", "grpo"]
ALL = ["sft", "rm", "ppo"]
# The GRPO pipeline: SFT (its own folder: in the demo it trains on other data than the PPO pipeline's SFT) -> GRPO.
GRPO = ["sft", "grpo"]
GRPO_SFT_FOLDER = "step1_sft_grpo"

# The embedded demo's recipe: sized so `dschat pipeline all` finishes in minutes on a 2-core CPU and the PPO
# reward rises well beyond its standard error. Real runs override any of it with --sft-args/--rm-args/--rl-args.
DEMO_ARGS = {
    "sft": ["--num-train-epochs", "3", "--per-device-train-batch-size", "8"],
    "rm": ["--num-train-epochs", "1", "--per-device-train-batch-size", "8"],
    "ppo": ["--max-steps", "100", "--num-train-epochs", "2", "--max-answer-seq-len", "64",
            "--per-device-generation-batch-size", "16",
            "--per-device-training-batch-size", "16", "--eval-fraction", "0.2", "--max-eval-rows", "256",
            "--kl-ctl", "0.05"],
}
# `dschat pipeline grpo` on the demo: one epoch of SFT on worked solutions of other arithmetic prompts (demo file
# prompts_sft) learns the <think>..</think><answer>..</answer> format only partly (~15% of samples), then GRPO with
# the format and accuracy rules on the demo prompts raises the mean rule reward on 200 held-out prompts many
# standard errors for every --loss-type, in a few minutes on a 2-core CPU. (The 1.4M-parameter model learns the
# format, not the arithmetic: the accuracy part stays near 0.)
GRPO_DEMO_ARGS = {
    "sft": ["--data-split", "1,0,0", "--num-train-epochs", "1", "--per-device-train-batch-size", "8"],
    "grpo": ["--algo", "grpo", "--reward-funcs", "format", "--reward-funcs", "accuracy", "--data-split", "0,0,1",
             "--max-steps", "100", "--num-generations", "4",
             "--per-device-generation-batch-size", "16", "--per-device-training-batch-size", "16",
             "--max-answer-seq-len", "32", "--actor-learning-rate", "2e-4", "--eval-fraction", "0.2",
             "--max-eval-rows", "200", "--per-device-eval-batch-size", "50"],
}


def parse_stages(text: str) -> list[str]:
    """``all`` = sft,rm,ppo; ``grpo`` = sft,grpo (the GRPO pipeline); else a comma list of stages, run in order.
    GRPO does not combine with rm/ppo in one call: its SFT stage is its own (folder ``step1_sft_grpo``)."""
    if text == "all":
        return list(ALL)
    names = list(GRPO) if text == "grpo" else [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in STAGES]
    if unknown or not names:
        raise UserError(f"unknown pipeline stage(s) {', '.join(unknown) or text!r}; use all (sft,rm,ppo), grpo "
                        f"(sft,grpo) or a list of {', '.join(ORDER)}")
    if "grpo" in names and {"rm", "ppo"} & set(names):
        raise UserError("the GRPO pipeline (sft,grpo) and the PPO pipeline (sft,rm,ppo) are separate runs; "
                        "run `dschat pipeline grpo` and `dschat pipeline all` one after the other")
    return sorted(set(names), key=ORDER.index)


def folder_of(name: str, names: list[str]) -> str:
    """A stage's output folder; the SFT of the GRPO pipeline has its own."""
    return GRPO_SFT_FOLDER if name == "sft" and "grpo" in names else FOLDERS[name]


def stage_argv(name: str, out: Path, model: str, reward_base: str, data: list[str], demo: bool,
               extra: dict[str, list[str]], names: list[str] | None = None) -> list[str]:
    names = names or ALL
    grpo = "grpo" in names
    argv = ["--step", str(STAGES[name])]
    if name == "sft":
        argv += ["--model", model]
    elif name == "rm":
        argv += ["--model", reward_base if reward_base else str(out / FOLDERS["sft"] / "model")]
    elif name == "grpo":
        argv += ["--actor-model", str(out / GRPO_SFT_FOLDER / "model")]
    else:
        argv += ["--actor-model", str(out / FOLDERS["sft"] / "model"),
                 "--reward-model", str(out / FOLDERS["rm"] / "model")]
    if demo and grpo:  # the GRPO demo's data: worked solutions for SFT, prompt-only rows for GRPO
        from dschat.data.phases import demo_files

        data = [str(demo_files()["prompts_sft" if name == "sft" else "prompts"])]
    for d in data:
        argv += ["--data", d]
    argv += ["--output-dir", str(out / folder_of(name, names))]
    if demo:
        argv += (GRPO_DEMO_ARGS if grpo else DEMO_ARGS)[name]
    return argv + extra.get(name, [])


def summarize(out: Path, timings: dict[str, float], names: list[str] | None = None) -> dict[str, Any]:
    def load(name: str) -> dict[str, Any]:
        path = out / name / "eval.json"
        return json.loads(path.read_text()) if path.exists() else {}

    names = names or ALL
    if "grpo" in names:
        sft, rl = load(GRPO_SFT_FOLDER), load(FOLDERS["grpo"])
        funcs = rl.get("reward_funcs") or []
        return {
            "sft_perplexity_before": sft.get("perplexity_before"), "sft_perplexity": sft.get("perplexity"),
            "grpo_loss_type": rl.get("loss_type"), "grpo_reward_funcs": funcs,
            "grpo_reward_before": rl.get("reward_before"), "grpo_reward_after": rl.get("reward_after"),
            "grpo_reward_before_se": rl.get("reward_before_se"), "grpo_reward_after_se": rl.get("reward_after_se"),
            "grpo_reward_gain": rl.get("reward_gain"), "grpo_reward_gain_se": rl.get("reward_gain_se"),
            **{f"grpo_reward_{f}_{when}": rl.get(f"reward_{f}_{when}") for f in funcs for when in ("before", "after")},
            "grpo_kl_after": rl.get("kl_after"), "seconds": timings,
        }
    sft, rm, rl = load("step1_sft"), load("step2_reward"), load("step3_rlhf")
    return {
        "sft_perplexity_before": sft.get("perplexity_before"), "sft_perplexity": sft.get("perplexity"),
        "rm_accuracy_before": rm.get("accuracy_before"), "rm_accuracy": rm.get("accuracy"),
        "ppo_reward_before": rl.get("reward_before"), "ppo_reward_after": rl.get("reward_after"),
        "ppo_reward_gain": rl.get("reward_gain"), "ppo_reward_gain_se": rl.get("reward_gain_se"),
        "ppo_kl_after": rl.get("kl_after"), "seconds": timings,
    }


def _fmt(v: Any, spec: str = ".3f") -> str:
    return format(v, spec) if isinstance(v, int | float) else "-"


@main.command("pipeline")
@click.argument("stages", default="all")
@click.option("--model", "--actor-model", "model", default="tiny", show_default=True,
              help="Base model of stage 1 (and of the reward model unless --reward-model).")
@click.option("--reward-model", "reward_base", default="",
              help="Base model of stage 2 (default: the stage-1 output, as DeepSpeed-Chat's examples do).")
@click.option("--data", multiple=True, help="Dataset(s) for every stage (default: the embedded demo).")
@click.option("--output-dir", default="output/pipeline", show_default=True)
@click.option("--force", is_flag=True, help="Re-run stages whose output already holds a finished run.")
@click.option("--num-gpus", "--num_gpus", "num_gpus", type=int, default=None, help="Run each stage under the "
              "deepspeed launcher with N local ranks.")
@click.option("--hostfile", default=None, help="Run each stage under the deepspeed launcher on these hosts.")
@click.option("--sft-args", default="", help="Extra stage-1 flags, e.g. \"--max-steps 100 --zero-stage 2\".")
@click.option("--rm-args", default="", help="Extra stage-2 flags.")
@click.option("--rl-args", default="", help="Extra stage-3 flags.")
def pipeline(stages: str, model: str, reward_base: str, data: tuple[str, ...], output_dir: str, force: bool,
             num_gpus: int | None, hostfile: str | None, sft_args: str, rm_args: str, rl_args: str) -> None:
    """Run stages (all = sft,rm,ppo; grpo = sft,grpo), each consuming the previous checkpoint; report the results.

    With no arguments this is the embedded tiny demo, which runs on a CPU. --rl-args go to ppo or grpo.
    """
    names = parse_stages(stages)
    out = Path(output_dir)
    demo = model == "tiny" and not data
    rl = shlex.split(rl_args)
    extra = {"sft": shlex.split(sft_args), "rm": shlex.split(rm_args), "ppo": rl, "grpo": rl}
    timings: dict[str, float] = {}
    for name in names:
        argv = stage_argv(name, out, model, reward_base, list(data), demo, extra, names)
        folder = Path(argv[argv.index("--output-dir") + 1])
        if (folder / "eval.json").exists() and not force:
            click.echo(f"[pipeline] {name}: {folder} already finished; skipped (--force re-runs it)", err=True)
            continue
        if force:
            argv.append("--force")
        launch: list[str] = []
        if num_gpus:
            launch += ["--num-gpus", str(num_gpus)]
        if hostfile:
            launch += ["--hostfile", hostfile]
        cmd = [sys.executable, "-c", "from dschat.cli import cli; cli()", "train", *launch, *argv]
        click.echo(f"[pipeline] {name}: dschat train {' '.join(shlex.quote(a) for a in launch + argv)}", err=True)
        t0 = time.time()
        rc = subprocess.call(cmd)
        timings[name] = round(time.time() - t0, 1)
        if rc != 0:
            raise UserError(f"pipeline stage {name} failed (exit code {rc}); later stages were not run")
    report = summarize(out, timings, names)
    write_json(out / "pipeline.json", report)
    click.echo("\n=== dschat pipeline report ===")
    click.echo(f"SFT   perplexity        {_fmt(report['sft_perplexity_before'], '.2f')} -> "
               f"{_fmt(report['sft_perplexity'], '.2f')}")
    if "grpo" in names:
        click.echo(f"GRPO  reward            {_fmt(report['grpo_reward_before'])} -> "
                   f"{_fmt(report['grpo_reward_after'])} (gain {_fmt(report['grpo_reward_gain'])} ± "
                   f"{_fmt(report['grpo_reward_gain_se'])} s.e.), loss {report['grpo_loss_type'] or '-'}")
        for func in report["grpo_reward_funcs"]:
            click.echo(f"      {func:<17} {_fmt(report.get(f'grpo_reward_{func}_before'))} -> "
                       f"{_fmt(report.get(f'grpo_reward_{func}_after'))}")
    else:
        click.echo(f"RM    accuracy          {_fmt(report['rm_accuracy_before'])} -> {_fmt(report['rm_accuracy'])}")
        click.echo(f"PPO   reward            {_fmt(report['ppo_reward_before'])} -> "
                   f"{_fmt(report['ppo_reward_after'])} (gain {_fmt(report['ppo_reward_gain'])} ± "
                   f"{_fmt(report['ppo_reward_gain_se'])} s.e.), KL {_fmt(report['ppo_kl_after'])}")
    click.echo("time  " + ", ".join(f"{k} {v:.0f}s" for k, v in timings.items()))
    click.echo(f"report: {out / 'pipeline.json'}")
