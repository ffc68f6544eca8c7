"""A stage-3 step where generation matters, per phase, for each sampling backend: GRPO and PPO on a ~100M model with
256-token answers.

Each (algorithm, backend) runs ``dschat train --step 3`` in a fresh process on the same random weights and prompts,
the backends interleaved round by round; the table gives the median seconds per step over the timed steps (after
``--warmup`` untimed ones) and each phase's share: sampling (with vLLM: of which the weight sync and its probe),
scoring (old, reference and critic log-probs, rewards) and training. The weights are random, so nearly every answer
runs to the cap. The reward of GRPO is ``dschat/demo/gamed_reward.py:verbosity`` (it varies, so every group has a
gradient); PPO's reward model and critic are a random ``LlamaForSequenceClassification`` of the same shape.

    python benchmarks/bench_rl.py --algo grpo ppo --backends vllm dschat hf --rounds 1
    python benchmarks/bench_rl.py --shape tiny --answer-len 32 --steps 2      # a smoke run

Shapes (Llama layout, vocab of the tiny preset's tokenizer): 107m (hidden 768, 12 layers, 12 heads, 4 KV heads,
intermediate 3072), tiny (hidden 128, 2 layers).
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {
    "107m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                 intermediate_size=3072),
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=256),
}


def build(shape: str, folder: Path) -> tuple[str, str]:
    """A policy folder and a reward-model folder of ``shape`` (random weights, seeds 0 and 1), with the tiny
    preset's tokenizer."""
    import torch
    import transformers as T

    from dschat.models.tiny import save_tiny_tokenizer

    policy, reward = folder / "policy", folder / "reward"
    save_tiny_tokenizer(str(policy))
    vocab = len(T.AutoTokenizer.from_pretrained(str(policy)))
    cfg = dict(vocab_size=vocab, max_position_embeddings=2048, **SHAPES[shape])
    torch.manual_seed(0)
    T.LlamaForCausalLM(T.LlamaConfig(**cfg)).save_pretrained(str(policy))
    torch.manual_seed(1)
    T.LlamaForSequenceClassification(T.LlamaConfig(num_labels=1, **cfg)).save_pretrained(str(reward))
    save_tiny_tokenizer(str(reward))
    return str(policy), str(reward)


def command(algo: str, backend: str, policy: str, reward: str, out: Path, a: argparse.Namespace) -> list[str]:
    from dschat.demo import demo_files

    common = ["dschat", "train", "--step", "3", "--actor-model", policy, "--data", str(demo_files()["prompts"]),
              "--data-split", "0,0,1", "--eval-fraction", "0", "--max-steps", str(a.warmup + a.steps),
              "--max-answer-seq-len", str(a.answer_len), "--max-prompt-seq-len", "128", "--dtype", "fp32",
              "--generation-backend", backend, "--actor-learning-rate", "1e-5", "--lr-scheduler-type", "constant",
              "--log-interval", "1", "--save-interval", "0", "--no-save-final-state", "--no-progress", "--force",
              "--seed", "1234", "--output-dir", str(out)]
    if algo == "grpo":
        return common + ["--algo", "grpo", "--reward-funcs", f"{ROOT / 'dschat/demo/gamed_reward.py'}:verbosity",
                         "--beta", "0", "--num-generations", str(a.generations),
                         "--per-device-generation-batch-size", str(a.prompts),
                         "--per-device-train-batch-size", str(a.prompts * a.generations),
                         "--no-actor-gradient-checkpointing"]
    return common + ["--algo", "ppo", "--reward-model", reward, "--critic-model", reward,
                     "--per-device-generation-batch-size", str(a.prompts), "--per-device-train-batch-size",
                     str(a.prompts), "--ppo-epochs", "4", "--no-actor-gradient-checkpointing",
                     "--no-critic-gradient-checkpointing"]


def phases(metrics: Path, warmup: int) -> dict[str, float]:
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    rows = [r for r in rows if "time/training_s" in r]
    timed = [r for r in rows if r["step"] > warmup]
    steps = sorted(timed, key=lambda r: r["step"])
    walls = [b["time"] - a["time"] for a, b in zip([r for r in rows if r["step"] >= warmup], steps, strict=False)]

    def med(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in timed)

    return {"step_s": statistics.median(walls), "sample_s": med("time/generation_s"),
            "sync_s": med("time/sync_s"), "probe_s": med("time/probe_s"), "score_s": med("time/experience_s"),
            "train_s": med("time/training_s"), "answer_len": med("train/answer_length")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="107m", choices=sorted(SHAPES))
    p.add_argument("--algo", nargs="+", default=["grpo", "ppo"], choices=["grpo", "ppo"])
    p.add_argument("--backends", nargs="+", default=["vllm", "dschat", "hf"])
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--generations", type=int, default=8, help="GRPO: answers per prompt")
    p.add_argument("--answer-len", type=int, default=256)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2, help="timed steps")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--json", default="", help="also write the results here")
    a = p.parse_args()
    if a.warmup < 1:
        p.error("--warmup must be at least 1 (a step's time is measured from the end of the one before)")
    work = Path(tempfile.mkdtemp(prefix="dschat-bench-rl-"))
    policy, reward = build(a.shape, work)
    results: dict[str, list[dict[str, float]]] = {}
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    for r in range(a.rounds):
        for algo in a.algo:
            for backend in (a.backends if r % 2 == 0 else a.backends[::-1]):
                out = work / f"{algo}-{backend}-{r}"
                proc = subprocess.run(command(algo, backend, policy, reward, out, a), env=env, capture_output=True,
                                      text=True)
                if proc.returncode != 0:
                    sys.exit(f"{algo} on {backend} failed:\n{proc.stderr[-2000:]}")
                results.setdefault(f"{algo} {backend}", []).append(phases(out / "metrics.jsonl", a.warmup))
                print(f"round {r + 1}: {algo} on {backend}: {results[f'{algo} {backend}'][-1]}", flush=True)
    print(f"\n{a.shape}, {a.prompts} prompts" + (f" x {a.generations} (GRPO)" if "grpo" in a.algo else "") +
          f", {a.answer_len}-token answers; medians over {a.rounds} round(s) x {a.steps} timed step(s)\n")
    print("| run | s / step | sampling (sync + probe) | scoring | training | answer length |")
    print("|---|---|---|---|---|---|")
    for name, runs in results.items():
        m = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
        sync = f" ({m['sync_s']:.2f} + {m['probe_s']:.2f})" if m["sync_s"] else ""
        print(f"| {name} | {m['step_s']:.2f} | {m['sample_s']:.2f}{sync} | {m['score_s']:.2f} | {m['train_s']:.2f} | "
              f"{m['answer_len']:.0f} |")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
