"""``dschat pipeline``: run stages 1 -> 2 -> 3 (or 1 -> 2 -> DPO, 1 -> GRPO, or a judge: 1 -> GRPO on judge rows),
each consuming the previous stage's checkpoint, and print the report (``dschat.training.pipeline``).

With no arguments this is the embedded demo: the demo's files and recipe.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import click

from dschat.config import BACKENDS
from dschat.demo import demo_files
from dschat.training.pipeline import PipelineRun, parse_stages, report_lines, run_pipeline


@click.command("pipeline")
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
@click.option("--rl-args", default="", help="Extra stage-3 flags (the DPO pipeline: \"--algo online_dpo\" for online "
                                            "DPO).")
@click.option("--eval-data", multiple=True, help="judge: held-out judge rows on which the SFT and the GRPO judges "
                                                  "are evaluated (default: the demo's held-out file in the demo; "
                                                  "none otherwise, and the evaluation is skipped).")
@click.option("--eval-args", default="", help="judge: extra `dschat eval --judge` flags, e.g. \"--votes 5\"; tools "
                                            "(the demo): extra `dschat eval --step 3` flags, e.g. the --max-eval-rows "
                                            "of --rl-args.")
@click.option("--generation-backend", "--generation_backend", "generation_backend", type=click.Choice(BACKENDS),
              default=None, help="What samples in the RL stage (its --generation-backend; default: auto, vLLM on a "
                                 "GPU where installed, else dschat's decoder).")
def pipeline(stages: str, model: str, reward_base: str, data: tuple[str, ...], output_dir: str, force: bool,
             num_gpus: int | None, hostfile: str | None, sft_args: str, rm_args: str, rl_args: str,
             eval_data: tuple[str, ...], eval_args: str, generation_backend: str | None) -> None:
    """Run stages (all = sft,rm,ppo; dpo = sft,rm,dpo; grpo = sft,grpo; judge = sft,judge; tools = sft,tools),
    each consuming the previous checkpoint; report the results.

    With no arguments this is the embedded tiny demo, which runs on a CPU. --rl-args go to ppo, dpo, grpo, judge or
    tools (dpo: --rl-args "--algo online_dpo" runs online DPO; tools: --rl-args "--tools ..." outside the demo).
    """
    names = parse_stages(stages)
    demo = model == "tiny" and not data
    rl = shlex.split(rl_args) + (["--generation-backend", generation_backend] if generation_backend else [])
    run = PipelineRun(
        names=names, out=Path(output_dir), model=model, reward_base=reward_base, data=list(data),
        demo=demo_files() if demo else None,
        extra={"sft": shlex.split(sft_args), "rm": shlex.split(rm_args), "ppo": rl, "dpo": rl, "grpo": rl,
               "judge": rl, "tools": rl},
        force=force, num_gpus=num_gpus, hostfile=hostfile,
        eval_data=list(eval_data) or ([str(demo_files()["judge_eval"])] if demo and "judge" in names else []),
        eval_args=shlex.split(eval_args))
    report = run_pipeline(run, log=lambda text: click.echo(text, err=True))
    click.echo("\n=== dschat pipeline report ===")
    for line in report_lines(report, names, run.algo):
        click.echo(line)
    click.echo(f"report: {run.out / 'pipeline.json'}")
    if run.pictures is not None:
        click.echo(f"pictures: {run.pictures}")
