"""Asynchronous rollouts against lockstep on one fixed GRPO workload: does a step take the larger of its two phases
(sampling, and everything else the trainer does) rather than their sum?

Three runs of ``dschat train --step 3 --algo grpo`` on the same random Llama-layout weights and prompts
(``bench_rl.py``'s workload), interleaved round by round, each in a fresh process:

- ``lockstep``: the trainer alone on core 0 (one thread), sampling and training in turn;
- ``async``: the trainer on core 0 and a sampler on core 1 (``--async-rollouts --sampler-devices cpu:1
  --max-staleness 1``, one thread each);
- ``lockstep-2``: the trainer alone on both cores (two threads): the same hardware as ``async``, used lockstep.

The phases are the lockstep run's: sampling (``time/generation_s``) and the rest of its step (scoring, reference,
training). The table gives each run's median seconds per step over the timed steps and the asynchronous step's ratio
to the larger phase (1.0: perfect overlap; the sum of the phases over the larger: no overlap at all) and to each
lockstep run.

    python benchmarks/bench_async.py --rounds 2
    python benchmarks/bench_async.py --shape tiny --steps 3 --rounds 1     # a smoke run

Linux only (cores are pinned with ``taskset``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_rl import SHAPES, build, command  # noqa: E402

SHAPES.setdefault("small", dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                intermediate_size=1024))

RUNS = {
    "lockstep": (["taskset", "-c", "0"], 1, []),
    "async": (["taskset", "-c", "0"], 1, ["--async-rollouts", "--sampler-devices", "cpu:1", "--max-staleness", "1"]),
    "lockstep-2": ([], 2, []),
}


def measure(metrics: Path, warmup: int) -> dict[str, float]:
    rows = sorted((r for r in map(json.loads, metrics.read_text().splitlines()) if "time/training_s" in r),
                  key=lambda r: r["step"])
    timed = [r for r in rows if r["step"] > warmup]
    walls = [b["time"] - a["time"] for a, b in zip(rows, rows[1:], strict=False) if b["step"] > warmup]

    def med(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in timed)

    step = statistics.median(walls)
    return {"step_s": step, "sample_s": med("time/generation_s"), "rest_s": step - med("time/generation_s"),
            "wait_s": med("async/wait_s"), "sampler_s": med("async/sampler_s"), "sync_s": med("sync/seconds"),
            "lag": med("async/lag_mean"), "answer_len": med("train/answer_length")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="small", choices=sorted(SHAPES))
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--generations", type=int, default=4, help="answers per prompt")
    p.add_argument("--answer-len", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps (the first two are lockstep in async)")
    p.add_argument("--steps", type=int, default=8, help="timed steps")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default="", help="also write every round here")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dschat-bench-async-"))
    policy, reward = build(a.shape, work)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in RUNS}
    for r in range(a.rounds):
        for name in (list(RUNS) if r % 2 == 0 else list(RUNS)[::-1]):
            pin, threads, extra = RUNS[name]
            out = work / f"{name}-{r}"
            env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(threads),
                       MKL_NUM_THREADS=str(threads))
            cmd = pin + command("grpo", "dschat", policy, reward, out, a) + extra
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
            results[name].append(measure(out / "metrics.jsonl", a.warmup))
            print(f"round {r + 1}: {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in results[name][-1].items()),
                  flush=True)
    m = {name: {k: statistics.median(x[k] for x in runs) for k in runs[0]} for name, runs in results.items()}
    lock, asy, two = m["lockstep"], m["async"], m["lockstep-2"]
    larger, total = max(lock["sample_s"], lock["rest_s"]), lock["sample_s"] + lock["rest_s"]
    print(f"\n{a.shape}, GRPO {a.prompts} prompts x {a.generations}, {a.answer_len}-token answers; medians over "
          f"{a.rounds} round(s) x {a.steps} timed step(s)\n")
    print("| run | s / step | sampling | rest of the step | trainer's wait | sampler's time | weight update |")
    print("|---|---|---|---|---|---|---|")
    for name, x in m.items():
        extra = f"{x['wait_s']:.3f} | {x['sampler_s']:.3f} | {x['sync_s']:.3f}" if name == "async" else "- | - | -"
        print(f"| {name} | {x['step_s']:.3f} | {x['sample_s']:.3f} | {x['rest_s']:.3f} | {extra} |")
    print(f"\nasync step / larger lockstep phase: {asy['step_s'] / larger:.2f} (no overlap: {total / larger:.2f}); "
          f"lockstep / async: {lock['step_s'] / asy['step_s']:.2f}; lockstep on both cores / async: "
          f"{two['step_s'] / asy['step_s']:.2f}; mean lag {asy['lag']:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
