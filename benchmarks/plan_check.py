"""The memory plan (``dschat plan --gpu CPU``) against the measured peak memory of real runs on this machine's CPU
(fp32).

For each model (the ``tiny`` preset, and a random ~110M Llama: hidden 768, 12 layers, 12 heads / 4 KV heads, MLP
3072, the tiny tokenizer; ``benchmarks/bench_rl.py``'s ``107m`` shape), each stage (1, 2, 3 with PPO) and each
ZeRO stage (0 on one rank; 1-3 on two ranks under the deepspeed launcher), a couple of optimizer steps run in a
fresh process wrapped by this script: after the imports (python, torch, transformers, datasets, deepspeed, the
stage) it resets the process's peak RSS (``/proc/self/clear_refs``) and reads its RSS, the baseline; at the end it
reads the peak RSS (``VmHWM``), and the peak before the first model folder is written. Measured = peak - baseline
per rank (the largest rank): model states, activations, and the fixed cost of a CPU rank (data and tokenizer,
DeepSpeed's and gloo's setup, thread arenas), which the ``CPU`` device's reserve stands for. The plan is
``make_plan`` for the same flags on the ``CPU`` device (its reserve, fp32, only the written part of DeepSpeed's
gradient bucket). Rows are packed to ``--max-seq-len`` in stages 1 and 2, so the runs see the token counts the plan
assumes.

``--mmap-threshold BYTES`` fixes glibc's mmap threshold in the runs (``MALLOC_MMAP_THRESHOLD_``): by default glibc
raises it after freeing a large block, up to 32 MiB, and blocks below it then come from heaps that keep their freed
pages; ZeRO-3's gather and release of every layer at every step grows the resident set that way (docs/planning.md).

    python benchmarks/plan_check.py                 # all cases, about half an hour on 2 cores
    python benchmarks/plan_check.py --models tiny 107m --zero 0 3 --steps 1 2   # a shorter check
    python benchmarks/plan_check.py --zero 3 --mmap-threshold 1048576

Prints a markdown table (docs/planning.md, Checks).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = "PLAN_CHECK_CHILD"  # "step:folder": this process is a measured run
STAGES = {1: "step1_sft.main", 2: "step2_reward.main", 3: "step3_rlhf.main"}


def _status(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{key}:\s+(\d+)", text).group(1)) * 1024  # type: ignore[union-attr]


def child(step: int, folder: Path, argv: list[str]) -> None:
    """Run one stage in this process, measuring its peak RSS above the post-import baseline."""
    import importlib

    import datasets  # noqa: F401 - part of the baseline
    import deepspeed  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    module = importlib.import_module(STAGES[step])
    before_save: list[int] = []
    save = module.save_hf

    def save_after_reading_peak(*args: Any, **kwargs: Any) -> Any:  # training's peak, before the first folder
        if not before_save:
            before_save.append(_status("VmHWM"))
        return save(*args, **kwargs)

    module.save_hf = save_after_reading_peak
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    baseline = _status("VmRSS")
    error = ""
    try:
        module.command.main(args=argv, standalone_mode=False)
    except BaseException as e:  # noqa: BLE001 - recorded; the parent reports it
        error = f"{type(e).__name__}: {e}"[:300]
    rank = os.environ.get("RANK", "0")
    out = {"rank": int(rank), "baseline": baseline, "peak": _status("VmHWM"), "error": error,
           "peak_before_save": before_save[0] if before_save else None}
    (folder / f"rank{rank}.json").write_text(json.dumps(out))


def flags(step: int, model: str, zero: int, out: Path, reward: str | None) -> dict[str, Any]:
    """The stage flags of one measured run (and of its plan)."""
    common: dict[str, Any] = {"dtype": "fp32", "max_steps": 2, "max_eval_rows": 4, "per_device_eval_batch_size": 4,
                              "per_device_train_batch_size": 4, "output_dir": str(out), "force": True,
                              "progress": False, "report_to": "jsonl", "save_final_state": False, "seed": 1}
    if step in (1, 2):
        return {**common, "model": model, "zero_stage": zero, "max_seq_len": 128, "packing": True}
    return {**common, "actor_model": model, "reward_model": reward, "actor_zero_stage": zero,
            "critic_zero_stage": zero, "per_device_generation_batch_size": 4, "max_prompt_seq_len": 32,
            "max_answer_seq_len": 32}


def argv_of(values: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for k, v in values.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            out.append(flag if v else f"--no-{k.replace('_', '-')}")
        else:
            out += [flag, str(v)]
    return out


def measure(step: int, values: dict[str, Any], ranks: int, work: Path, mmap_threshold: int = 0) -> dict[str, Any]:
    """Run the stage (1 rank in-process under this wrapper, or N ranks under the launcher); per-rank figures."""
    from dschat.cli.train import launcher_argv

    folder = Path(tempfile.mkdtemp(dir=work, prefix=f"s{step}-"))
    env = {**os.environ, CHILD: f"{step}:{folder}", "HF_HUB_OFFLINE": "1"}
    if mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    if ranks > 1:
        env["OMP_NUM_THREADS"] = "1"
        cmd = launcher_argv(os.path.abspath(__file__), argv_of(values), ranks, None, None)
    else:
        cmd = [sys.executable, os.path.abspath(__file__)] + argv_of(values)
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    results = [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]
    if proc.returncode != 0 or not results or any(r["error"] for r in results):
        tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-5:])
        errors = "; ".join(r["error"] for r in results if r["error"])
        raise RuntimeError(f"step {step} failed: {errors or tail}")
    return {"ranks": results, "seconds": time.time() - start}


def planned(step: int, values: dict[str, Any], ranks: int) -> Any:
    from dschat.planning import make_plan

    # the CPU device: its fixed cost per rank, and only the written part of DeepSpeed's gradient bucket
    return make_plan(step, values, num_gpus=ranks, gpu="CPU", gpu_memory=1 << 50, suggest=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["tiny", "107m"], choices=["tiny", "107m"])
    p.add_argument("--steps", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--zero", nargs="+", type=int, default=[0, 1, 2, 3])
    p.add_argument("--mmap-threshold", type=int, default=0,
                   help="Fix glibc's mmap threshold in the runs (bytes; 0: glibc's dynamic default).")
    p.add_argument("--work", default="", help="Folder for models and outputs (default: a temporary one).")
    p.add_argument("--json", default="", help="Also write the rows as JSON here.")
    a = p.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="plan_check-"))
    work.mkdir(parents=True, exist_ok=True)
    from dschat.planning.gpus import MiB

    rows: list[dict[str, Any]] = []
    print("| model | step | ZeRO | ranks | baseline (imports) | measured | measured before saving | plan | "
          "plan / measured | seconds |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in a.models:
        if name == "tiny":
            model = "tiny"
        else:
            from bench_rl import build  # benchmarks/bench_rl.py: the same random ~110M Llama

            model = build("107m", work / "m107")[0]
        for zero in a.zero:
            ranks = 1 if zero == 0 else 2
            reward = None
            for step in sorted(a.steps):
                out = work / f"{name}-z{zero}-s{step}"
                if step == 3 and reward is None:  # this ZeRO stage's reward model, else another's
                    found = sorted(work.glob(f"{name}-z*-s2/model/config.json"))
                    own = work / f"{name}-z{zero}-s2" / "model"
                    reward = str(own if (own / "config.json").is_file() or not found else found[0].parent)
                values = flags(step, model, zero, out, reward)
                try:
                    m = measure(step, values, ranks, work, a.mmap_threshold)
                except RuntimeError as e:
                    print(f"| {name} | {step} | {zero} | {ranks} | failed: {str(e)[:200]} ||||||", flush=True)
                    continue
                plan = planned(step, values, ranks)
                used = max(r["peak"] - r["baseline"] for r in m["ranks"])
                before = max((r.get("peak_before_save") or r["peak"]) - r["baseline"] for r in m["ranks"])
                base = max(r["baseline"] for r in m["ranks"])
                rows.append({"model": name, "step": step, "zero": zero, "ranks": ranks, "baseline": base,
                             "measured": used, "measured_before_save": before, "plan": plan.peak_bytes,
                             "reserve": plan.reserve, "mmap_threshold": a.mmap_threshold, "seconds": m["seconds"]})
                print(f"| {name} | {step} | {zero} | {ranks} | {base / MiB:.0f} MiB | {used / MiB:.0f} MiB | "
                      f"{before / MiB:.0f} MiB | {plan.peak_bytes / MiB:.0f} MiB | {plan.peak_bytes / used:.2f} | "
                      f"{m['seconds']:.0f} |", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    spec = os.environ.get(CHILD)
    if spec:
        step_text, folder_text = spec.split(":", 1)
        child(int(step_text), Path(folder_text), sys.argv[1:])
    else:
        main()
