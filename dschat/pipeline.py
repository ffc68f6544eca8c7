"""``dschat pipeline``: run stages 1 -> 2 -> 3, each consuming the previous stage's checkpoint.

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

STAGES = {"sft": 1, "rm": 2, "ppo": 3}
FOLDERS = {"sft": "step1_sft", "rm": "step2_reward", "ppo": "step3_rlhf"}
ALL = ["sft", "rm", "ppo"]

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


def parse_stages(text: str) -> list[str]:
    names = ALL if text == "all" else [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in STAGES]
    if unknown or not names:
        raise UserError(f"unknown pipeline stage(s) {', '.join(unknown) or text!r}; use all or a list of "
                        f"{', '.join(ALL)}")
    return sorted(set(names), key=ALL.index)


def stage_argv(name: str, out: Path, model: str, reward_base: str, data: list[str], demo: bool,
               extra: dict[str, list[str]]) -> list[str]:
    argv = ["--step", str(STAGES[name])]
    if name == "sft":
        argv += ["--model", model]
    elif name == "rm":
        argv += ["--model", reward_base if reward_base else str(out / FOLDERS["sft"] / "model")]
    else:
        argv += ["--actor-model", str(out / FOLDERS["sft"] / "model"),
                 "--reward-model", str(out / FOLDERS["rm"] / "model")]
    for d in data:
        argv += ["--data", d]
    argv += ["--output-dir", str(out / FOLDERS[name])]
    if demo:
        argv += DEMO_ARGS[name]
    return argv + extra.get(name, [])


def summarize(out: Path, timings: dict[str, float]) -> dict[str, Any]:
    def load(name: str) -> dict[str, Any]:
        path = out / name / "eval.json"
        return json.loads(path.read_text()) if path.exists() else {}

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
    """Run stages (all = sft,rm,ppo), each consuming the previous checkpoint; report the results.

    With no arguments this is the embedded tiny demo, which runs on a CPU.
    """
    names = parse_stages(stages)
    out = Path(output_dir)
    demo = model == "tiny" and not data
    extra = {"sft": shlex.split(sft_args), "rm": shlex.split(rm_args), "ppo": shlex.split(rl_args)}
    timings: dict[str, float] = {}
    for name in names:
        argv = stage_argv(name, out, model, reward_base, list(data), demo, extra)
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
    report = summarize(out, timings)
    write_json(out / "pipeline.json", report)
    click.echo("\n=== dschat pipeline report ===")
    click.echo(f"SFT   perplexity        {_fmt(report['sft_perplexity_before'], '.2f')} -> "
               f"{_fmt(report['sft_perplexity'], '.2f')}")
    click.echo(f"RM    accuracy          {_fmt(report['rm_accuracy_before'])} -> {_fmt(report['rm_accuracy'])}")
    click.echo(f"PPO   reward            {_fmt(report['ppo_reward_before'])} -> {_fmt(report['ppo_reward_after'])} "
               f"(gain {_fmt(report['ppo_reward_gain'])} ± {_fmt(report['ppo_reward_gain_se'])} s.e.), "
               f"KL {_fmt(report['ppo_kl_after'])}")
    click.echo("time  " + ", ".join(f"{k} {v:.0f}s" for k, v in timings.items()))
    click.echo(f"report: {out / 'pipeline.json'}")
