"""Pipelines of stages: 1 -> 2 -> 3 (PPO), 1 -> 2 -> DPO, 1 -> GRPO, a judge (1 -> GRPO on judge rows), or tools
(1 on tool traces -> GRPO with the tools), each
stage consuming the previous stage's checkpoint, and the report of the results (``dschat pipeline``).

Each stage runs in its own process (``dschat train --step N``), so memory is returned between stages and
``--num-gpus``/``--hostfile`` work as for ``train``. A stage whose output folder already holds a finished run
(``eval.json``) is skipped unless ``force``.
"""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dschat.errors import UserError
from dschat.training.report import write_report
from dschat.utils import write_json

DemoFiles = Mapping[str, Path]  # the embedded demo's files by name (``dschat.demo.demo_files()``)
DSCHAT = [sys.executable, "-c", "from dschat.cli.main import cli; cli()"]  # the console script, in a child process

STAGES = {"sft": 1, "rm": 2, "ppo": 3, "dpo": 3, "grpo": 3, "judge": 3, "tools": 3}
FOLDERS = {"sft": "step1_sft", "rm": "step2_reward", "ppo": "step3_rlhf", "dpo": "step3_dpo", "grpo": "step3_grpo",
           "judge": "step3_judge", "tools": "step3_tools"}
ORDER = ["sft", "rm", "ppo", "dpo", "grpo", "judge", "tools"]
ALL = ["sft", "rm", "ppo"]
# The DPO pipeline: the PPO pipeline's SFT and reward model (the same folders and recipe, so a finished `dschat
# pipeline all` is reused), then DPO (`--rl-args "--algo online_dpo"`: online DPO, folder step3_online_dpo). The
# reward model only scores: online DPO's samples, and both algorithms' held-out answers before and after.
DPO = ["sft", "rm", "dpo"]
DPO_ALGOS = ("dpo", "online_dpo")
# The GRPO pipeline: SFT (its own folder: in the demo it trains on other data than the PPO pipeline's SFT) -> GRPO.
GRPO = ["sft", "grpo"]
GRPO_SFT_FOLDER = "step1_sft_grpo"
# The generative-judge pipeline (RM-R1): cold-start SFT on judge completions -> GRPO with judge_match on judge rows,
# then `dschat eval --judge` of both models on held-out judge rows.
JUDGE = ["sft", "judge"]
JUDGE_SFT_FOLDER = "step1_sft_judge"
# The tools pipeline: SFT on tool traces -> GRPO with the tools (--rl-args "--tools ..."; the demo: the calculator),
# then, in the demo, `dschat eval --step 3` of both models with the tool against themselves without it.
TOOLS = ["sft", "tools"]
TOOLS_SFT_FOLDER = "step1_sft_tools"

# The embedded demo's recipe: sized so `dschat pipeline all` finishes in minutes on a 2-core CPU and the PPO
# reward rises well beyond its standard error. Its evaluation answers each held-out prompt 4 times: with one answer
# the sampling noise of the estimate swamps the spread that a CPU's kernels put on the trained policy. Real runs
# override any of it with --sft-args/--rm-args/--rl-args.
DEMO_ARGS = {
    "sft": ["--num-train-epochs", "3", "--per-device-train-batch-size", "8"],
    "rm": ["--num-train-epochs", "1", "--per-device-train-batch-size", "8"],
    "ppo": ["--max-steps", "100", "--num-train-epochs", "2", "--max-answer-seq-len", "64",
            "--per-device-generation-batch-size", "16",
            "--per-device-train-batch-size", "16", "--eval-fraction", "0.2", "--max-eval-rows", "256",
            "--eval-samples", "4", "--kl-ctl", "0.05"],
}
# `dschat pipeline dpo` on the demo: the phase-3 pairs of the PPO demo's data (offline DPO trains on them, online DPO
# on their prompts), 256 of them held out for the implicit-reward accuracy and the reward-model score of sampled
# answers before and after, 8 answers per held-out prompt (--eval-samples: one answer per prompt leaves a standard
# error as large as the gain). Beta 0.5 for both, and RPO's chosen-answer NLL (weight 1) for offline DPO, 200 updates
# (about 3 epochs of the 1,024 training pairs): at beta 0.1 both drifted far from the SFT policy and offline DPO's
# answers scored lower (the recipes compared: docs/algorithms.md, Demo results).
DPO_DEMO_ARGS = {
    "dpo": ["--max-steps", "200", "--per-device-train-batch-size", "16",
            "--max-answer-seq-len", "64", "--eval-fraction", "0.2", "--max-eval-rows", "256", "--eval-samples", "8",
            "--dpo-beta", "0.5", "--rpo-alpha", "1.0"],
    "online_dpo": ["--max-steps", "100", "--num-generations", "4", "--per-device-generation-batch-size", "16",
                   "--per-device-train-batch-size", "16", "--max-answer-seq-len", "64", "--eval-fraction", "0.2",
                   "--max-eval-rows", "256", "--eval-samples", "8", "--dpo-beta", "0.5"],
}
# `dschat pipeline grpo` on the demo: a task the 1.4M-parameter model can learn, small sums ("I ordered X x3 and Y x5.
# How many items is that?", addends 1..5). One epoch of SFT on worked solutions of other such prompts (demo file
# sums_sft) leaves the <think>..</think><answer>..</answer> format in some samples and the right sum in few, then
# GRPO with the format and accuracy rules on the demo's sums prompts raises both on 200 held-out prompts, each by
# many paired standard errors, in minutes on a 2-core CPU (docs/algorithms.md, Demo results). (Word problems, demo
# file prompts, are beyond the tiny model: it learns their format, not their answers.) The recipe holds no flag of
# one algorithm, so the critic-free estimators run it as it is: --rl-args "--algo rloo".
GRPO_DEMO_ARGS = {
    "sft": ["--data-split", "1,0,0", "--num-train-epochs", "1", "--per-device-train-batch-size", "8"],
    "grpo": ["--algo", "grpo", "--reward-funcs", "format", "--reward-funcs", "accuracy", "--data-split", "0,0,1",
             "--max-steps", "100", "--num-generations", "4",
             "--per-device-generation-batch-size", "16", "--per-device-train-batch-size", "16",
             "--max-answer-seq-len", "32", "--actor-learning-rate", "2e-4", "--eval-fraction", "0.2",
             "--max-eval-rows", "200", "--per-device-eval-batch-size", "50"],
}
# `dschat pipeline judge` on the demo (RM-R1's recipe, scaled down): one SFT epoch on 1000 cold-start judge
# completions ending in the true verdict (demo file judge_sft; RM-R1's distillation step), then GRPO with the
# judge_match reward and the format rule, weighted 1 and 1, on 900 other judge rows; both judges are evaluated
# greedily on 300 held-out rows (judge_eval). With judge_match alone GRPO wore the reasoning down (it rewards only
# the verdict), so the format rule is weighed in (docs/judge.md). (A cold start with random verdicts teaches the
# format alone, and GRPO from that chance-level judge only swings between always-A and always-B, so the demo distils
# first, as RM-R1 does.)
JUDGE_DEMO_ARGS = {
    "sft": ["--data-split", "1,0,0", "--num-train-epochs", "1", "--per-device-train-batch-size", "8",
            "--max-seq-len", "320"],
    "judge": ["--data-split", "0,0,1", "--max-steps", "100", "--num-generations", "4",
              "--per-device-generation-batch-size", "16", "--per-device-train-batch-size", "16",
              "--max-answer-seq-len", "40", "--max-prompt-seq-len", "256", "--actor-learning-rate", "1e-4",
              "--beta", "0.001", "--eval-fraction", "0.1", "--max-eval-rows", "100",
              "--per-device-eval-batch-size", "50", "--reward-funcs", "format", "--reward-weights", "1",
              "--reward-weights", "1"],
}
# The judges' evaluation: greedy, with the completion budget GRPO trained with.
JUDGE_EVAL_ARGS = ["--max-new-tokens", "40", "--batch-size", "50"]
# `dschat pipeline tools` on the demo: order totals ("I ordered X x13 at $17 each. How many dollars is that?"), which
# the 1.4M-parameter model cannot multiply. Three SFT epochs on calculator traces of other such prompts (demo file
# tools_sft: the call, the tool's result, the answer) teach it to call the calculator and, in some samples, to copy
# the result into <answer>; GRPO with the calculator and the accuracy rule then raises the share it copies right.
# Both models are evaluated on GRPO's 200 held-out prompts with the calculator and without it, paired prompt by
# prompt (docs/tools.md, The demo).
TOOLS_SAMPLING = ["--max-turns", "2", "--reward-funcs", "accuracy", "--data-split", "0,0,1", "--eval-fraction",
                  "0.2", "--max-eval-rows", "200"]
TOOLS_DEMO_ARGS = {
    "sft": ["--data-split", "1,0,0", "--num-train-epochs", "3", "--per-device-train-batch-size", "8"],
    "tools": ["--tools", "calculator", *TOOLS_SAMPLING, "--max-steps", "200", "--num-generations", "4",
              "--per-device-generation-batch-size", "16", "--per-device-train-batch-size", "16",
              "--max-answer-seq-len", "80", "--actor-learning-rate", "2e-4", "--per-device-eval-batch-size", "50"],
}
# Their evaluation: the stage's held-out prompts and sampling (seed, budget, batch), the tool on and off.
TOOLS_EVAL_ARGS = ["--tools", "calculator", *TOOLS_SAMPLING, "--max-new-tokens", "80", "--batch-size", "50"]


def parse_stages(text: str) -> list[str]:
    """``all`` = sft,rm,ppo; ``dpo`` = sft,rm,dpo (the DPO pipeline); ``grpo`` = sft,grpo (the GRPO pipeline);
    ``judge`` = sft,judge (the generative judge pipeline); else a comma list of stages, run in order. The PPO and
    DPO pipelines share their SFT and reward model; the GRPO and judge pipelines have SFT stages of their own
    (folders ``step1_sft_grpo``, ``step1_sft_judge``), so no two pipelines mix in one call."""
    if text == "all":
        return list(ALL)
    presets = {"dpo": DPO, "grpo": GRPO, "judge": JUDGE, "tools": TOOLS}
    names = list(presets[text]) if text in presets else [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in STAGES]
    if unknown or not names:
        raise UserError(f"unknown pipeline stage(s) {', '.join(unknown) or text!r}; use all (sft,rm,ppo), dpo "
                        f"(sft,rm,dpo), grpo (sft,grpo), judge (sft,judge), tools (sft,tools) or a list of "
                        f"{', '.join(ORDER)}")
    pipelines = [p for p in ("ppo", "dpo", "grpo", "judge", "tools") if p in names]
    if len(pipelines) > 1 or ("rm" in names and set(pipelines) & {"grpo", "judge", "tools"}):
        raise UserError("the PPO pipeline (sft,rm,ppo), the DPO pipeline (sft,rm,dpo), the GRPO pipeline "
                        "(sft,grpo), the judge pipeline (sft,judge) and the tools pipeline (sft,tools) are separate "
                        "runs; run `dschat pipeline all`, `dschat pipeline dpo`, `dschat pipeline grpo`, `dschat "
                        "pipeline judge` and `dschat pipeline tools` one after the other")
    return sorted(set(names), key=ORDER.index)


def dpo_algo(rl_args: list[str]) -> str:
    """The DPO stage's ``--algo`` from ``--rl-args`` (default dpo): dpo or online_dpo."""
    algo = "dpo"
    for i, a in enumerate(rl_args):
        if a == "--algo" and i + 1 < len(rl_args):
            algo = rl_args[i + 1]
        elif a.startswith("--algo="):
            algo = a.split("=", 1)[1]
    if algo not in DPO_ALGOS:
        raise UserError(f"the DPO pipeline runs --algo dpo or online_dpo, not {algo!r}")
    return algo


def folder_of(name: str, names: list[str], algo: str = "dpo") -> str:
    """A stage's output folder; the SFT of the GRPO and judge pipelines has its own, and the DPO stage's is its
    algorithm's (``step3_dpo``, ``step3_online_dpo``)."""
    if name == "dpo":
        return f"step3_{algo}"
    if name == "sft" and "grpo" in names:
        return GRPO_SFT_FOLDER
    if name == "sft" and "judge" in names:
        return JUDGE_SFT_FOLDER
    if name == "sft" and "tools" in names:
        return TOOLS_SFT_FOLDER
    return FOLDERS[name]


def stage_argv(name: str, out: Path, model: str, reward_base: str, data: list[str], demo: DemoFiles | None,
               extra: dict[str, list[str]], names: list[str] | None = None) -> list[str]:
    """The ``dschat train`` arguments of one stage. ``demo``: the embedded demo's files (the demo's recipe and
    data), or None for a user's run."""
    names = names or ALL
    grpo, judge, tools = "grpo" in names, "judge" in names, "tools" in names
    algo = dpo_algo(extra.get("dpo", [])) if name == "dpo" else ""
    argv = ["--step", str(STAGES[name])]
    if name == "sft":
        argv += ["--model", model]
    elif name == "rm":
        argv += ["--model", reward_base if reward_base else str(out / FOLDERS["sft"] / "model")]
    elif name in ("grpo", "judge", "dpo", "tools"):
        argv += ["--actor-model", str(out / folder_of("sft", names) / "model")]
    else:
        argv += ["--actor-model", str(out / FOLDERS["sft"] / "model"),
                 "--reward-model", str(out / FOLDERS["rm"] / "model")]
    if demo is not None and (grpo or judge or tools):  # warm-up rows for SFT, rows with a ground truth for GRPO
        files = {"sft": "judge_sft", "judge": "judge"} if judge else {"sft": "tools_sft", "tools": "tools"} \
            if tools else {"sft": "sums_sft", "grpo": "sums"}
        data = [str(demo[files[name]])]
    if demo is not None and name == "dpo":  # the demo's pairs (online DPO's own default is GRPO's arithmetic prompts)
        data = [str(demo["pairwise"])]
    for d in data:
        argv += ["--data", d]
    argv += ["--output-dir", str(out / folder_of(name, names, algo))]
    if name == "judge":  # a judge learns from its verdicts, whatever the data
        argv += ["--algo", "grpo", "--reward-funcs", "judge_match"]
    if name == "tools":  # GRPO with the tools of --rl-args (the demo: the calculator)
        argv += ["--algo", "grpo"]
    if name == "dpo":  # the reward model scores (online DPO's samples; held-out answers), it is not trained on
        argv += ["--reward-model", str(out / FOLDERS["rm"] / "model"), "--algo", algo]
    if demo is not None:
        argv += DPO_DEMO_ARGS[algo] if name == "dpo" else \
            (JUDGE_DEMO_ARGS if judge else GRPO_DEMO_ARGS if grpo else TOOLS_DEMO_ARGS if tools else DEMO_ARGS)[name]
    rest = extra.get(name, [])
    if name == "dpo":  # --algo is placed above, once
        rest = [a for i, a in enumerate(rest) if a != "--algo" and not a.startswith("--algo=")
                and not (i and rest[i - 1] == "--algo")]
    return argv + rest


def summarize(out: Path, timings: dict[str, float], names: list[str] | None = None,
              algo: str = "dpo") -> dict[str, Any]:
    def load(name: str) -> dict[str, Any]:  # a stage folder's eval.json, or a .json file in the output folder
        path = out / name if name.endswith(".json") else out / name / "eval.json"
        return json.loads(path.read_text()) if path.exists() else {}

    names = names or ALL
    if "judge" in names:
        sft, rl = load(JUDGE_SFT_FOLDER), load(FOLDERS["judge"])
        funcs = rl.get("reward_funcs") or []
        report: dict[str, Any] = {
            "sft_perplexity_before": sft.get("perplexity_before"), "sft_perplexity": sft.get("perplexity"),
            "judge_reward_funcs": funcs, "judge_reward_before": rl.get("reward_before"),
            "judge_reward_after": rl.get("reward_after"), "judge_reward_gain_se": rl.get("reward_gain_se"),
            # each source (judge_match, and format where the recipe weighs it in), sampled on GRPO's held-out rows
            **{f"judge_reward_{f}_{when}": rl.get(f"reward_{f}_{when}") for f in funcs
               for when in ("before", "after", "gain_se")},
            "judge_kl_after": rl.get("kl_after"),
        }
        # judge_match alone, as earlier reports gave it (the total when it is the only source)
        for when in ("before", "after", "gain_se"):
            only = funcs == ["judge_match"] or not funcs
            report[f"judge_match_reward_{when}"] = rl.get(f"reward_{when}") if only else \
                report.get(f"judge_reward_judge_match_{when}")
        evals = {when: load(f"judge_eval_{when}.json") for when in ("before", "after")}
        for when, m in evals.items():
            for key in ("accuracy", "accuracy_se", "unparseable_rate", "accuracy_when_a", "accuracy_when_b",
                        "position_bias", "format_rate", "n"):
                # a standard error's name ends in _se after its when (judge_accuracy_before_se), as in eval.json
                name = f"judge_{key.removesuffix('_se')}_{when}" + ("_se" if key.endswith("_se") else "")
                report[name] = m.get(key)
        b, a = evals["before"], evals["after"]
        if b.get("accuracy") is not None and a.get("accuracy") is not None:
            from dschat.stats import paired_se  # torch: imported only when there is a report to write

            report["judge_accuracy_gain"] = a["accuracy"] - b["accuracy"]
            se = paired_se(b["correct"], a["correct"]) if len(b["correct"]) == len(a["correct"]) else math.nan
            report["judge_accuracy_gain_se"] = None if math.isnan(se) else se
        return {**report, "seconds": timings}
    if "tools" in names:
        sft, rl = load(TOOLS_SFT_FOLDER), load(FOLDERS["tools"])
        report = {"sft_perplexity_before": sft.get("perplexity_before"), "sft_perplexity": sft.get("perplexity"),
                  **{f"tools_{k}": rl.get(k) for k in ("reward_funcs", "reward_before", "reward_after",
                                                       "reward_before_se", "reward_after_se", "reward_gain",
                                                       "reward_gain_se", "kl_after")}}
        for when in ("before", "after"):
            m = load(f"tools_eval_{when}.json")
            policy, base, paired = m.get("policy") or {}, m.get("baseline") or {}, m.get("paired") or {}
            report.update({f"tools_with_{when}": policy.get("reward"), f"tools_with_{when}_se": policy.get("reward_se"),
                           f"tools_without_{when}": base.get("reward"),
                           f"tools_without_{when}_se": base.get("reward_se"),
                           f"tools_tool_gain_{when}": paired.get("reward_gain"),
                           f"tools_tool_gain_{when}_se": paired.get("reward_gain_se"),
                           f"tools_eval_prompts_{when}": m.get("prompts")})
        return {**report, "seconds": timings}
    if "grpo" in names:
        sft, rl = load(GRPO_SFT_FOLDER), load(FOLDERS["grpo"])
        funcs = rl.get("reward_funcs") or []
        return {
            "sft_perplexity_before": sft.get("perplexity_before"), "sft_perplexity": sft.get("perplexity"),
            "grpo_loss_type": rl.get("loss_type"), "grpo_reward_funcs": funcs,
            "grpo_reward_before": rl.get("reward_before"), "grpo_reward_after": rl.get("reward_after"),
            "grpo_reward_before_se": rl.get("reward_before_se"), "grpo_reward_after_se": rl.get("reward_after_se"),
            "grpo_reward_gain": rl.get("reward_gain"), "grpo_reward_gain_se": rl.get("reward_gain_se"),
            **{f"grpo_reward_{f}_{when}": rl.get(f"reward_{f}_{when}") for f in funcs
               for when in ("before", "after", "gain_se")},
            "grpo_kl_after": rl.get("kl_after"), "seconds": timings,
        }
    sft, rm = load(FOLDERS["sft"]), load(FOLDERS["rm"])
    common = {"sft_perplexity_before": sft.get("perplexity_before"), "sft_perplexity": sft.get("perplexity"),
              "rm_accuracy_before": rm.get("accuracy_before"), "rm_accuracy": rm.get("accuracy")}
    if "dpo" in names:
        rl = load(folder_of("dpo", names, algo))
        return {**common, "dpo_algo": algo, "dpo_loss_type": rl.get("loss_type"), "dpo_beta": rl.get("beta"),
                **{f"dpo_{k}": rl.get(k) for k in (
                    "implicit_accuracy_before", "implicit_accuracy_after", "implicit_margin_before",
                    "implicit_margin_after", "eval_pairs_after", "reward_before", "reward_after", "reward_before_se",
                    "reward_after_se", "reward_gain", "reward_gain_se", "eval_prompts", "eval_samples", "kl_after",
                    "pairs",
                    "tie_groups", "sampled_implicit_accuracy_before", "sampled_implicit_accuracy_after",
                    "sampled_pairs_after", "onpolicy_implicit_accuracy_before", "onpolicy_implicit_accuracy_after",
                    "onpolicy_pairs_after")},
                "seconds": timings}
    rl = load(FOLDERS["ppo"])
    return {
        **common,
        "ppo_reward_before": rl.get("reward_before"), "ppo_reward_after": rl.get("reward_after"),
        "ppo_reward_gain": rl.get("reward_gain"), "ppo_reward_gain_se": rl.get("reward_gain_se"),
        "ppo_kl_after": rl.get("kl_after"), "seconds": timings,
    }


def tool_evals(out: Path, names: list[str], eval_data: list[str], eval_args: list[str], timings: dict[str, float],
               log: Callable[[str], None]) -> None:
    """``dschat eval --step 3`` of the SFT model (before) and the GRPO actor (after) on the tools stage's held-out
    prompts, each with the calculator against itself without it (``--baseline-without-tools``), each in its own
    process, into ``O/tools_eval_{before,after}.json``."""
    models = {"before": out / folder_of("sft", names) / "model", "after": out / FOLDERS["tools"] / "actor"}
    for when, model in models.items():
        if not (model / "config.json").exists():
            log(f"[pipeline] tools eval {when}: no model at {model}; skipped")
            continue
        argv = ["eval", "--step", "3", "--model", str(model), "--baseline", str(model), "--baseline-without-tools",
                *[a for d in eval_data for a in ("--data", d)], "--output", str(out / f"tools_eval_{when}.json"),
                "--no-progress", *TOOLS_EVAL_ARGS, *eval_args]
        log(f"[pipeline] tools eval {when}: dschat {' '.join(shlex.quote(a) for a in argv)}")
        t0 = time.time()
        rc = subprocess.call([*DSCHAT, *argv], stdout=subprocess.DEVNULL)
        timings[f"eval_{when}"] = round(time.time() - t0, 1)
        if rc != 0:
            raise UserError(f"tools evaluation ({when}) failed (exit code {rc})")


def judge_evals(out: Path, names: list[str], eval_data: list[str], eval_args: list[str],
                timings: dict[str, float], log: Callable[[str], None]) -> None:
    """``dschat eval --judge`` of the SFT judge (before) and the GRPO judge (after) on the same held-out rows, each
    in its own process, into ``O/judge_eval_{before,after}.json``."""
    models = {"before": out / folder_of("sft", names) / "model", "after": out / FOLDERS["judge"] / "actor"}
    for when, model in models.items():
        if not (model / "config.json").exists():
            log(f"[pipeline] judge eval {when}: no model at {model}; skipped")
            continue
        argv = ["eval", "--judge", "--model", str(model), *[a for d in eval_data for a in ("--data", d)],
                "--output", str(out / f"judge_eval_{when}.json"), "--no-progress", *JUDGE_EVAL_ARGS, *eval_args]
        log(f"[pipeline] judge eval {when}: dschat {' '.join(shlex.quote(a) for a in argv)}")
        t0 = time.time()
        rc = subprocess.call([*DSCHAT, *argv],
                             stdout=subprocess.DEVNULL)
        timings[f"eval_{when}"] = round(time.time() - t0, 1)
        if rc != 0:
            raise UserError(f"judge evaluation ({when}) failed (exit code {rc})")




@dataclass
class PipelineRun:
    """What ``dschat pipeline`` was asked for: the stages, the models and data they start from, per-stage extra
    flags (``extra["sft"|"rm"|"ppo"|"dpo"|"grpo"|"judge"]``) and the launcher."""

    names: list[str]
    out: Path
    model: str = "tiny"
    reward_base: str = ""
    data: list[str] = field(default_factory=list)
    demo: DemoFiles | None = None
    extra: dict[str, list[str]] = field(default_factory=dict)
    force: bool = False
    num_gpus: int | None = None
    hostfile: str | None = None
    eval_data: list[str] = field(default_factory=list)  # judge: held-out judge rows (none: no judge evaluation)
    eval_args: list[str] = field(default_factory=list)  # judge, tools: extra flags of their `dschat eval`
    pictures: Path | None = field(default=None, init=False)  # set by run_pipeline: the report's page, if drawn

    @property
    def algo(self) -> str:
        return dpo_algo(self.extra.get("dpo", [])) if "dpo" in self.names else "dpo"


def run_pipeline(run: PipelineRun, log: Callable[[str], None]) -> dict[str, Any]:
    """Run each stage of ``run`` in its own process (finished ones skipped unless ``run.force``), then the judges'
    evaluations, and write and return the report (``O/pipeline.json``). The pictures of the stages that ran
    (``write_plots``) are drawn at the end, and also when a stage failed."""
    try:
        report = _run_stages(run, log)
    except UserError:
        run.pictures = write_plots(run.out, log)
        raise
    run.pictures = write_plots(run.out, log)
    return report


def write_plots(out: Path, log: Callable[[str], None]) -> Path | None:
    """``dschat report`` of the pipeline folder into ``O/report/`` (PNGs and ``report.html``); returns the page.
    Plotting never fails the pipeline: any error is one logged line, and None."""
    try:
        page = write_report([out])
    except Exception as e:  # a pipeline's results matter more than its pictures
        log(f"[pipeline] report not written: {type(e).__name__}: {e}")
        return None
    log(f"[pipeline] pictures: {page}")
    return page


def _run_stages(run: PipelineRun, log: Callable[[str], None]) -> dict[str, Any]:
    timings: dict[str, float] = {}
    for name in run.names:
        argv = stage_argv(name, run.out, run.model, run.reward_base, run.data, run.demo, run.extra, run.names)
        folder = Path(argv[argv.index("--output-dir") + 1])
        if (folder / "eval.json").exists() and not run.force:
            log(f"[pipeline] {name}: {folder} already finished; skipped (--force re-runs it)")
            continue
        if run.force:
            argv.append("--force")
        launch: list[str] = []
        if run.num_gpus:
            launch += ["--num-gpus", str(run.num_gpus)]
        if run.hostfile:
            launch += ["--hostfile", run.hostfile]
        log(f"[pipeline] {name}: dschat train {' '.join(shlex.quote(a) for a in launch + argv)}")
        t0 = time.time()
        rc = subprocess.call([*DSCHAT, "train", *launch, *argv])
        timings[name] = round(time.time() - t0, 1)
        if rc != 0:
            raise UserError(f"pipeline stage {name} failed (exit code {rc}); later stages were not run")
    if "judge" in run.names and run.eval_data:
        judge_evals(run.out, run.names, run.eval_data, run.eval_args, timings, log)
    if "tools" in run.names and run.demo is not None:
        tool_evals(run.out, run.names, [str(run.demo["tools"])], run.eval_args, timings, log)
    report = summarize(run.out, timings, run.names, run.algo)
    write_json(run.out / "pipeline.json", report)
    return report


# ------------------------------------------------------------------------------------------------- the report
def _fmt(v: Any, spec: str = ".3f") -> str:
    return format(v, spec) if isinstance(v, int | float) else "-"


class _Figures(dict):
    """The report's values for ``str.format_map``: ``{key}`` is the value to 3 decimals ("-" when missing),
    ``{key:.2f}`` another format, ``{key!s}`` the value as it is ("-" when missing, zero or empty)."""

    def __missing__(self, key: str) -> Any:
        return _Value(None)


class _Value:
    def __init__(self, v: Any):
        self.v = v

    def __format__(self, spec: str) -> str:
        return _fmt(self.v, spec or ".3f")

    def __str__(self) -> str:
        return str(self.v) if self.v else "-"


def _gain(report: dict[str, Any], key: str) -> float | None:
    b, a = report.get(f"{key}_before"), report.get(f"{key}_after")
    return a - b if isinstance(a, int | float) and isinstance(b, int | float) else None


# Each pipeline's report: its lines as templates over the report's keys (``_Figures``); "{f}" in a per-function
# line stands for each reward function's name. A line whose template is a tuple repeats once per function.
_SFT = "SFT   perplexity        {sft_perplexity_before:.2f} -> {sft_perplexity:.2f}"
_RM = "RM    accuracy          {rm_accuracy_before} -> {rm_accuracy}"
REPORT_LINES: dict[str, list[str | tuple[str, str]]] = {
    "ppo": [_SFT, _RM, "PPO   reward            {ppo_reward_before} -> {ppo_reward_after} (gain {ppo_reward_gain} ± "
                       "{ppo_reward_gain_se} s.e.), KL {ppo_kl_after}"],
    "dpo": [_SFT, _RM,
            "{dpo_label} implicit acc.     {dpo_implicit_accuracy_before} -> {dpo_implicit_accuracy_after} "
            "({dpo_eval_pairs_after!s} held-out pairs), {dpo_algo!s} loss {dpo_loss_type!s}, beta {dpo_beta:g}",
            "      RM reward         {dpo_reward_before} -> {dpo_reward_after} (gain {dpo_reward_gain} ± "
            "{dpo_reward_gain_se} s.e., {dpo_eval_prompts!s} held-out prompts x {dpo_eval_samples_or_1!s} answers), "
            "KL {dpo_kl_after}"],
    "online_dpo": [
        "      sampled pairs     implicit acc. {dpo_sampled_implicit_accuracy_before} -> "
        "{dpo_sampled_implicit_accuracy_after} ({dpo_sampled_pairs_after!s} held-out pairs of the SFT policy's "
        "answers, best vs worst by reward)",
        "      on-policy pairs   implicit acc. {dpo_onpolicy_implicit_accuracy_before} -> "
        "{dpo_onpolicy_implicit_accuracy_after} ({dpo_onpolicy_pairs_after!s} held-out pairs of the evaluated "
        "policy's own answers)",
        "      pairs trained     {dpo_pairs_raw}, tied groups skipped {dpo_tie_groups_raw}"],
    "grpo": [_SFT,
             "GRPO  reward            {grpo_reward_before} -> {grpo_reward_after} (gain {grpo_reward_gain} ± "
             "{grpo_reward_gain_se} s.e.), loss {grpo_loss_type!s}",
             ("grpo_reward_funcs", "      {f:<17} {grpo_reward_{f}_before} -> {grpo_reward_{f}_after} (gain "
                                   "{grpo_reward_{f}_gain} ± {grpo_reward_{f}_gain_se} s.e.)")],
    "tools": [_SFT,
              "GRPO  accuracy          {tools_reward_before} -> {tools_reward_after} (gain {tools_reward_gain} ± "
              "{tools_reward_gain_se} s.e., with the calculator, on GRPO's held-out prompts)",
              "TOOLS with the tool     {tools_with_before} ± {tools_with_before_se} -> {tools_with_after} ± "
              "{tools_with_after_se} (before -> after GRPO, {tools_eval_prompts_after!s} held-out prompts)",
              "      without it        {tools_without_before} ± {tools_without_before_se} -> {tools_without_after} ± "
              "{tools_without_after_se}",
              "      the tool's gain   {tools_tool_gain_before} ± {tools_tool_gain_before_se} -> "
              "{tools_tool_gain_after} ± {tools_tool_gain_after_se} (paired by prompt, s.e.)"],
    "judge": [_SFT,
              "GRPO  judge_match       {judge_match_reward_before} -> {judge_match_reward_after} (sampled, on GRPO's "
              "own held-out rows)",
              ("judge_reward_funcs", "      {f:<17} {judge_reward_{f}_before} -> {judge_reward_{f}_after} (sampled)"),
              "JUDGE accuracy          {judge_accuracy_before} ± {judge_accuracy_before_se} -> "
              "{judge_accuracy_after} ± {judge_accuracy_after_se} (gain {judge_accuracy_gain} ± "
              "{judge_accuracy_gain_se} s.e., {judge_n_after!s} held-out rows, greedy)",
              "      unparseable       {judge_unparseable_rate_before} -> {judge_unparseable_rate_after}",
              "      position bias     {judge_position_bias_before} -> {judge_position_bias_after} (accuracy when A "
              "wins minus when B wins)",
              "      well-formed       {judge_format_rate_before} -> {judge_format_rate_after} (share of completions "
              "with <think>..</think> then <answer>..</answer>)"],
}


def report_kind(names: list[str], algo: str = "dpo") -> list[str]:
    """Which blocks of ``REPORT_LINES`` a pipeline's report prints."""
    for kind in ("judge", "grpo", "tools"):
        if kind in names:
            return [kind]
    if "dpo" in names:
        return ["dpo", "online_dpo"] if algo == "online_dpo" else ["dpo"]
    return ["ppo"]


def report_lines(report: dict[str, Any], names: list[str], algo: str = "dpo") -> list[str]:
    """The report as printed by ``dschat pipeline``: the figures, then the time per stage."""
    values = _Figures({k: v if isinstance(v, list) else _Value(v) for k, v in report.items()})
    values["dpo_label"] = "DPO  " if algo == "dpo" else "ODPO "
    values["dpo_eval_samples_or_1"] = _Value(report.get("dpo_eval_samples") or 1)
    for key in ("dpo_pairs", "dpo_tie_groups"):
        values[f"{key}_raw"] = report.get(key)
    for f in report.get("grpo_reward_funcs") or []:
        values[f"grpo_reward_{f}_gain"] = _Value(_gain(report, f"grpo_reward_{f}"))
    lines: list[str] = []
    for kind in report_kind(names, algo):
        for line in REPORT_LINES[kind]:
            if isinstance(line, tuple):
                key, template = line
                funcs = report.get(key) or []
                if key == "judge_reward_funcs":
                    funcs = [f for f in funcs if f != "judge_match"]
                lines += [_per_function(template, f).format_map(values) for f in funcs]
            else:
                lines.append(line.format_map(values))
    timings = report.get("seconds") or {}
    lines.append("time  " + ", ".join(f"{k} {v:.0f}s" for k, v in timings.items()))
    return lines


def _per_function(template: str, f: str) -> str:
    """A per-function line's template for function ``f``: ``{f:<17}`` becomes the padded name, and the keys that
    name ``{f}`` become that function's keys."""
    return template.replace("{f:<17}", f"{f:<17}").replace("_{f}_", f"_{f}_")
