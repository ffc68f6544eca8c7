"""The GPU path in one command: stages 1-3 (PPO and GRPO) sampling on vLLM, bf16, ZeRO-3, on a ~0.5B random model.

For a CUDA machine with the CUDA ``vllm`` installed (``pip install vllm==0.32.0``, which brings its own CUDA torch,
then ``pip install -e .``). It checks, and writes one JSON report (``--out``, default gpu_check.json) of:

* greedy parity: vLLM's greedy answers equal HF ``generate``'s on the same bf16 weights (the share of equal rows:
  bf16 kernels differ, so a few rows may part after a near-tie), and the sync probe's log-prob gap;
* stages 1 and 2 (a few steps each), then stage 3 with ``--algo ppo`` and ``--algo grpo``, each with
  ``--generation-backend vllm --dtype bf16 --actor-zero-stage 3``: exit codes, the per-phase times from
  ``metrics.jsonl`` (``time/generation_s``, ``time/experience_s``, ``time/training_s``, ``time/sync_s``,
  ``time/probe_s``), ``sync/max_logprob_diff`` and ``vllm/logprob_diff_max`` per step, and each stage's peak GPU
  memory (``nvidia-smi``, sampled every second);
* DeepSpeed's own hybrid engine: stage 3 PPO with ``--enable-hybrid-engine`` (CUDA inference kernels).

    python benchmarks/gpu_check.py                  # ~5-8 minutes on one H100/H200-class GPU
    python benchmarks/gpu_check.py --shape 87m      # smaller and faster

Nothing here runs on a CPU machine: it stops at once without CUDA.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def gpu_memory_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True)
    return max((int(x) for x in out.stdout.split() if x.strip().isdigit()), default=0)


def dschat(args: list[str], log: Path, timeout: int) -> dict:
    """``dschat ARGS``; its exit code, wall time and peak GPU memory (MiB)."""
    peak, done = [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], gpu_memory_mib())
            time.sleep(1.0)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    t0 = time.time()
    with open(log, "w") as f:
        try:
            rc = subprocess.run([sys.executable, "-c", "from dschat.cli.main import cli; cli()", *args], cwd=ROOT,
                                stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    done.set()
    t.join()
    return {"rc": rc, "wall_s": round(time.time() - t0, 1), "peak_gpu_mib": peak[0], "log": str(log)}


def phases(out: Path) -> dict:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()] \
        if (out / "metrics.jsonl").exists() else []
    steps = [r for r in rows if "train/actor_loss" in r]
    keys = ("time/generation_s", "time/experience_s", "time/training_s", "time/sync_s", "time/probe_s",
            "sync/max_logprob_diff", "vllm/logprob_diff_max", "vllm/is_weight_mean")
    return {"steps": len(steps), **{k: [round(r[k], 5) for r in steps if k in r] for k in keys}}


def greedy_parity(path: str) -> dict:
    import torch

    from dschat.generation.decode import GenerationConfig, HFBackend
    from dschat.generation.vllm_engine import VLLMBackend
    from dschat.models.loading import create_causal_lm, load_tokenizer

    tok = load_tokenizer(path)
    model = create_causal_lm(path, torch.bfloat16).cuda().eval()
    texts = ["\n\nHuman: 我的订单什么时候发货？\n\nAssistant:", "\n\nHuman: Where is my refund?\n\nAssistant:"] * 8
    enc = [tok(t)["input_ids"] for t in texts]
    width = max(map(len, enc))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(e)) + e for e in enc]).cuda()
    mask = (ids != tok.pad_token_id).long()
    gen = GenerationConfig(max_new_tokens=32, do_sample=False)
    hf = HFBackend().generate(model, ids, mask, gen, tok.eos_token_id, tok.pad_token_id).sequences
    backend = VLLMBackend()
    try:
        ours = backend.generate(model, ids, mask, gen, tok.eos_token_id, tok.pad_token_id).sequences
        probe = backend.last.get("sync/max_logprob_diff")
    finally:
        backend.close()
    same = [a == b for a, b in zip(ours.tolist(), hf.tolist(), strict=True)]
    return {"rows_equal": sum(same) / len(same), "probe_max_logprob_diff": probe}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=["0.5b", "87m"], default="0.5b")
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device here; this check is for a GPU machine with the CUDA vllm installed")
    from benchmarks.bench_vllm import build
    from dschat.generation.vllm_engine import vllm_installed, vllm_version

    if not vllm_installed():
        sys.exit("gpu_check: vLLM is not installed (pip install vllm==0.32.0)")
    work = Path(tempfile.mkdtemp(prefix="dschat-gpu-check-"))
    model = build(args.shape, str(work / "base"))
    report: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "vllm": vllm_version(),
                    "shape": args.shape, "work": str(work)}
    t0 = time.time()
    report["greedy"] = greedy_parity(model)
    n = str(args.steps)
    common = ["--dtype", "bf16", "--max-steps", n, "--no-progress", "--force"]
    report["step1"] = dschat(["train", "--step", "1", "--model", model, "--output-dir", str(work / "s1"),
                              "--zero-stage", "3", *common], work / "s1.log", 900)
    report["step2"] = dschat(["train", "--step", "2", "--model", str(work / "s1" / "model"), "--output-dir",
                              str(work / "s2"), "--zero-stage", "3", *common], work / "s2.log", 900)
    rl = ["--actor-zero-stage", "3", "--max-answer-seq-len", "128", "--per-device-generation-batch-size", "8",
          "--per-device-training-batch-size", "8", "--max-eval-rows", "16", *common]
    for algo, extra in (("ppo", ["--reward-model", str(work / "s2" / "model"), "--critic-zero-stage", "3"]),
                        ("grpo", ["--reward-funcs", "format", "--num-generations", "4"])):
        out = work / f"s3-{algo}"
        report[f"step3_{algo}"] = dschat(["train", "--step", "3", "--algo", algo, "--actor-model",
                                          str(work / "s1" / "model"), "--output-dir", str(out),
                                          "--generation-backend", "vllm", *extra, *rl], work / f"s3-{algo}.log", 1200)
        report[f"step3_{algo}"]["phases"] = phases(out)
    out = work / "s3-hybrid"
    report["step3_ppo_deepspeed_hybrid_engine"] = dschat(
        ["train", "--step", "3", "--actor-model", str(work / "s1" / "model"), "--reward-model",
         str(work / "s2" / "model"), "--output-dir", str(out), "--enable-hybrid-engine", "--generation-backend",
         "dschat", "--actor-zero-stage", "2", *rl[2:]], work / "s3-hybrid.log", 1200)
    report["step3_ppo_deepspeed_hybrid_engine"]["phases"] = phases(out)
    report["total_s"] = round(time.time() - t0, 1)
    ok = all(report[k]["rc"] == 0 for k in report if k.startswith("step"))
    probes = [d for k in ("step3_ppo", "step3_grpo") for d in report[k]["phases"]["sync/max_logprob_diff"]]
    report["passed"] = ok and report["greedy"]["rows_equal"] >= 0.75 and bool(probes) and max(probes) < 0.5
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("passed", "total_s", "greedy")}, indent=1))
    print(f"report: {args.out}; logs under {work}")
    sys.exit(0 if report["passed"] else 1)


if __name__ == "__main__":
    main()
