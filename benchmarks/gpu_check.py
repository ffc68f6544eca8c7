"""The GPU check: one command on a bare CUDA host (torch and the project's requirements; vLLM and TRL optional, no
network) that measures what docs/speed.md and docs/planning.md report for GPUs, and writes it as one JSON.

Model: a random 0.99B Llama (TinyLlama-1.1B's body: hidden 2048, 22 layers, 32 heads, 4 KV heads, MLP 5632) with
the tiny preset's tokenizer, bf16, built on the GPU (no download). Parts, in order, each bounded by what is left
of ``--budget`` (default 450 s, so the whole check stays under 8 minutes on one H100/H200):

* ``decode``: the same 64 rows (8 prompts x 8) and 256 new tokens through every backend: dschat's eager loop
  (constant-shape step; and the growing one), ``graph`` (its capture time too), ``compiled``, HF ``generate`` on
  dschat's loading and on a plain ``from_pretrained``, with SDPA's cuDNN backend on and off, HF's static cache with
  its compiled forward, ``torch.compile(mode="reduce-overhead")`` on the lean step, and vLLM where it is
  installed. Per backend: wall and CPU ms per token step, greedy parity with HF ``generate`` (the share of equal
  rows; bf16 kernels differ, so a near-tie may part a row), and the largest sampled-token log-prob difference to
  the eager loop from the same seed.
* ``grpo``: ``dschat train --step 3 --algo grpo``, 8 prompts x 8 answers x 256 tokens, the default backend, one
  warm-up and two timed steps: seconds per step and per phase (``time/*`` of metrics.jsonl), memory (``memory/*``).
  TRL's GRPOTrainer on the same model, prompts and reward in the same run when ``trl`` is importable.
* ``ppo``: PPO at the same sizes (64 prompts of 256-token answers per step), actor and critic at ZeRO 0.
* ``stages``: stages 1, 2 and 3 (PPO, actor and critic at ZeRO-3) for a few steps: exit codes, wall, the peak of
  the device's used memory (nvidia-smi, sampled every 0.5 s) and the run's own ``memory/*`` figures beside
  ``dschat plan --json`` with the same flags.
* ``big`` (``--big`` only; not in the default run): ``dschat train --step 2`` on a Llama-2-7B-shaped random model,
  with LoRA and with full ZeRO-3, a few steps each, peak memory and step time against the plan.

    python benchmarks/gpu_check.py --out gpu_check.json            # one H100/H200: under 8 minutes
    python benchmarks/gpu_check.py --parts decode,grpo --budget 300
    python benchmarks/gpu_check.py --smoke                          # the plumbing on a CPU, tiny shapes

A host without network brings the requirements as wheels: docs/speed.md (GPU section) says how.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {"1b": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                     intermediate_size=5632),
          "7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                     intermediate_size=11008),
          "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128)}
PROMPTS, GROUP = 8, 8
REWARD = '''def length(prompts, completions, **kwargs):
    """An uncapped length reward: random weights give every group a spread, so every row trains."""
    return [0.001 * len(c) for c in completions]
'''


class Check:
    """The report, written after every part, and the clock every part is bounded by."""

    def __init__(self, out: Path, budget: float, smoke: bool):
        self.out, self.budget, self.smoke, self.t0 = out, budget, smoke, time.time()
        self.report: dict[str, Any] = {"smoke": smoke}
        self.work = Path(tempfile.mkdtemp(prefix="dschat-gpu-check-"))
        self.report["work"] = str(self.work)
        import torch

        self.cuda = torch.cuda.is_available()
        self.dtype = "bf16" if self.cuda else "fp32"

    def left(self) -> float:
        return self.budget - (time.time() - self.t0)

    def save(self) -> None:
        self.report["elapsed_s"] = round(time.time() - self.t0, 1)
        self.out.write_text(json.dumps(self.report, indent=1, default=str))

    def run(self, name: str, argv: list[str], timeout: float) -> dict[str, Any]:
        """A command; its exit code, wall time, peak device memory in use (MiB) and the tail of its output."""
        timeout = max(10.0, min(timeout, self.left() - 5))
        peak, done = [0], threading.Event()

        def watch() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], device_used_mib())
                time.sleep(0.5)

        th = threading.Thread(target=watch, daemon=True)
        if self.cuda:
            th.start()
        t = time.time()
        log = self.work / f"{name}.log"
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
        with open(log, "w") as f:
            try:
                rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env=env,
                                    cwd=ROOT).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        done.set()
        if self.cuda:
            th.join()
        tail = log.read_text(errors="replace").splitlines()[-12:]
        return {"rc": rc, "wall_s": round(time.time() - t, 1), "peak_device_mib": peak[0], "tail": tail}


def device_used_mib() -> int:
    try:
        o = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=5).stdout
        return max(int(x) for x in o.split())
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0


def dschat_cmd(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from dschat.cli.main import cli; sys.argv[0] = 'dschat'; cli()", *args]


def metrics(out: Path) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def phases(rows: list[dict[str, Any]], warm: int) -> dict[str, Any]:
    """Seconds per step (wall between logged steps after ``warm`` warm-ups) and the median of every ``time/*``;
    the largest of every ``memory/*``."""
    steps = [r for r in rows if "time/training_s" in r]
    walls = [steps[i]["time"] - steps[i - 1]["time"] for i in range(max(warm, 1), len(steps))
             if "time" in steps[i] and "time" in steps[i - 1]]
    timed = steps[warm:] or steps
    out: dict[str, Any] = {"steps": len(steps), "step_s": statistics.median(walls) if walls else None,
                           "walls": walls}
    for key in sorted({k for r in timed for k in r if k.startswith("time/") or k == "train/answer_length"}):
        out[key] = statistics.median(r[key] for r in timed if key in r)
    for key in sorted({k for r in rows for k in r if k.startswith("memory/")}):
        out[key] = max(r[key] for r in rows if key in r)
    return out


def gpu_name() -> str:
    import torch

    if not torch.cuda.is_available():
        return "CPU"
    name = torch.cuda.get_device_name(0).upper()
    return "H200" if "H200" in name else "H100" if "H100" in name else "A100-80GB" if "A100" in name else "H100"


# ---------------------------------------------------------------------------------------------------- parts
def build(check: Check, shape: str, name: str) -> str:
    import torch
    import transformers as T

    from dschat.models.tiny import save_tiny_tokenizer

    path = check.work / name
    save_tiny_tokenizer(str(path))
    vocab = len(T.AutoTokenizer.from_pretrained(str(path)))
    cfg = T.LlamaConfig(vocab_size=vocab, max_position_embeddings=2048, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device("cuda" if check.cuda else "cpu"):
        model = T.LlamaForCausalLM(cfg)
    model.to(torch.bfloat16 if check.cuda else torch.float32).save_pretrained(str(path))
    check.report[f"{name}_params"] = sum(p.numel() for p in model.parameters())
    del model
    return str(path)


def prompts_file() -> str:
    from dschat.demo import demo_files

    return str(demo_files()["prompts"])


def decode(check: Check, pol: str, new_tokens: int) -> dict[str, Any]:
    import torch
    import transformers as T

    from dschat import devices
    from dschat.generation import decode as D
    from dschat.generation.backends import generate_with
    from dschat.generation.decode import DschatBackend, GenerationConfig, HFBackend
    from dschat.generation.lean_llama import LeanLlama
    from dschat.models.loading import create_causal_lm, load_tokenizer

    dev = "cuda" if check.cuda else "cpu"
    dtype = torch.bfloat16 if check.cuda else torch.float32
    tok = load_tokenizer(pol)
    model = create_causal_lm(pol, dtype).to(dev).eval()
    texts = [json.loads(x)["prompt"] for x in open(prompts_file())][:PROMPTS]
    enc = [e for e in (tok(t)["input_ids"] for t in texts) for _ in range(GROUP)]
    width = max(map(len, enc))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(e)) + e for e in enc], device=dev)
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(e) for e in enc])[:, None]).long().to(dev)
    res: dict[str, Any] = {"rows": len(enc), "prompt_width": width, "new_tokens": new_tokens}

    def sync() -> None:
        if check.cuda:
            torch.cuda.synchronize()

    def generate(backend: Any, m: Any, n: int, greedy: bool = False, seed: int = 0, logprobs: bool = False) -> Any:
        cfg = GenerationConfig(max_new_tokens=n, do_sample=not greedy, logprobs=logprobs)
        torch.manual_seed(seed)
        with torch.no_grad():
            return generate_with(backend, m, ids, mask, cfg, tok.eos_token_id, tok.pad_token_id)

    def timed(backend: Any, m: Any) -> dict[str, Any]:
        generate(backend, m, 8)  # warm-up: kernels chosen, graphs captured, code compiled
        sync()
        wall, cpu = time.perf_counter(), time.process_time()
        out = generate(backend, m, new_tokens)
        sync()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        steps = max(out.sequences.shape[1] - width, 1)
        return {"ms_per_step": round(1000 * wall / steps, 3), "cpu_ms_per_step": round(1000 * cpu / steps, 3),
                "steps": steps, "s": round(wall, 3)}

    with torch.no_grad():
        reference = generate(HFBackend(), model, 32, greedy=True).sequences
    eager = DschatBackend()
    base = generate(eager, model, 32, seed=7, logprobs=True)

    def parity(backend: Any, m: Any) -> dict[str, Any]:
        got = generate(backend, m, 32, greedy=True).sequences
        rows = [a == b for a, b in zip(got.tolist(), reference.tolist(), strict=True)]
        out: dict[str, Any] = {"greedy_rows_equal": round(sum(rows) / len(rows), 4)}
        if isinstance(backend, DschatBackend):
            sampled = generate(backend, m, 32, seed=7, logprobs=True)
            if sampled.logprobs is not None and torch.equal(sampled.sequences, base.sequences):
                out["logprob_max_diff_to_eager"] = float((sampled.logprobs - base.logprobs).abs().max())
            else:
                out["sampled_equal_to_eager"] = bool(torch.equal(sampled.sequences, base.sequences))
        return out

    def plain_model() -> Any:
        return T.AutoModelForCausalLM.from_pretrained(pol, dtype=dtype).to(dev).eval()

    def reduce_overhead() -> Any:
        D._compiled_step = torch.compile(LeanLlama.step, mode="reduce-overhead")
        return DschatBackend(compiled=True)

    def default_compile() -> Any:
        D._compiled_step = None
        return DschatBackend(compiled=True)

    class HFStatic(HFBackend):
        """HF generate with its static cache, whose forward transformers compiles."""

        name = "hf_static"

        def generate(self, module: Any, prompt: Any, prompt_mask: Any, config: Any, eos: Any, pad: Any) -> Any:
            out = module.generate(prompt, attention_mask=prompt_mask, max_new_tokens=config.max_new_tokens,
                                  do_sample=config.do_sample, pad_token_id=pad, eos_token_id=eos, top_k=0,
                                  temperature=1.0, top_p=1.0, cache_implementation="static")
            return D.Generated(out)

    variants: list[tuple[str, Any, Any]] = []
    if check.cuda:  # torch's own SDPA choice first: the process default until dschat's policy is set below
        torch.backends.cuda.enable_cudnn_sdp(True)
        variants += [("hf_sdpa_default", HFBackend, lambda: model),
                     ("hf_plain_sdpa_default", HFBackend, plain_model)]
    variants += [("after_policy", None, None),
                 ("dschat", DschatBackend, lambda: model),
                 ("dschat_growing", lambda: DschatBackend(constant_shapes=False), lambda: model),
                 ("hf", HFBackend, lambda: model),
                 ("hf_plain", HFBackend, plain_model)]
    if check.cuda:
        variants += [("graph", lambda: DschatBackend(graph=True), lambda: model),
                     ("compiled", default_compile, lambda: model),
                     ("lean_reduce_overhead", reduce_overhead, lambda: model),
                     ("hf_static_compiled", HFStatic, lambda: model)]
        from dschat.generation.vllm_engine import VLLMBackend, vllm_installed

        if vllm_installed():
            variants.append(("vllm", VLLMBackend, lambda: model))
    for name, make, which in variants:
        if make is None:
            devices.prefer_attention_kernels()
            continue
        if check.left() < 40:
            res.setdefault("skipped", []).append(name)
            continue
        try:
            backend, m = make(), which()
            t = time.time()
            row = timed(backend, m)
            row["first_call_s"] = round(time.time() - t - row["s"], 2)
            row.update(parity(backend, m))
            if isinstance(backend, DschatBackend) and backend.graphs is not None:
                row.update(captures=backend.graphs.captures, capture_s=round(backend.graphs.capture_seconds, 3))
            backend.close()
            res[name] = row
        except Exception as e:  # one backend's failure is a row of the report, not the end of the check
            res[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
        print(f"decode {name}: {res[name]}", flush=True)
        check.save()
    return res


def grpo_args(check: Check, pol: str, out: Path, answer: int, steps: int, backend: str) -> list[str]:
    reward = check.work / "len_reward.py"
    reward.write_text(REWARD)
    return dschat_cmd("train", "--step", "3", "--algo", "grpo", "--actor-model", pol, "--data", prompts_file(),
                      "--data-split", "0,0,1", "--eval-fraction", "0", "--max-steps", str(steps),
                      "--max-answer-seq-len", str(answer), "--max-prompt-seq-len", "128", "--dtype", check.dtype,
                      "--generation-backend", backend, "--actor-learning-rate", "1e-5", "--lr-scheduler-type",
                      "constant", "--log-interval", "1", "--save-interval", "0", "--no-save-final-state",
                      "--no-progress", "--force", "--seed", "1234", "--output-dir", str(out), "--reward-funcs",
                      f"{reward}:length", "--beta", "0", "--num-generations", str(GROUP),
                      "--per-device-generation-batch-size", str(PROMPTS), "--per-device-train-batch-size",
                      str(PROMPTS * GROUP), "--no-actor-gradient-checkpointing")


TRL_SCRIPT = '''
import json, statistics, sys, time
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

model_dir, prompts_file, out, warm, steps, P, G, L = sys.argv[1:4] + [int(x) for x in sys.argv[4:9]]
cuda = torch.cuda.is_available()
rows = [json.loads(x) for x in open(prompts_file)]
ds = Dataset.from_list([{"prompt": r["prompt"]} for r in rows[: P * (warm + steps) * 4]])
tok = AutoTokenizer.from_pretrained(model_dir)
tok.padding_side = "left"
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if cuda else torch.float32)

def length(prompts, completions, **kw):
    return [0.001 * len(c) for c in completions]

class Clock(TrainerCallback):
    def __init__(self):
        self.t = []
    def on_step_end(self, args, state, control, **kw):
        if cuda:
            torch.cuda.synchronize()
        self.t.append(time.time())

clock = Clock()
cfg = GRPOConfig(output_dir=out, per_device_train_batch_size=P * G, num_generations=G, max_completion_length=L,
                 learning_rate=1e-5, beta=0.0, max_steps=warm + steps, logging_steps=1, save_strategy="no",
                 report_to=[], bf16=cuda, gradient_checkpointing=False, temperature=1.0, top_p=1.0,
                 lr_scheduler_type="constant", use_vllm=False, seed=1234, disable_tqdm=True, use_cpu=not cuda,
                 shuffle_dataset=False)
GRPOTrainer(model=model, reward_funcs=length, args=cfg, train_dataset=ds, processing_class=tok,
            callbacks=[clock]).train()
walls = [b - a for a, b in zip(clock.t[warm - 1:], clock.t[warm:])]
print("TRLRESULT " + json.dumps({"step_s": statistics.median(walls), "walls": walls,
                                 "peak_alloc_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else 0}))
'''


def grpo(check: Check, pol: str, answer: int) -> dict[str, Any]:
    warm, steps = 1, 2
    res: dict[str, Any] = {}
    import importlib.util

    if importlib.util.find_spec("trl") is not None and not check.smoke:
        script = check.work / "trl_grpo.py"
        script.write_text(TRL_SCRIPT)
        row = check.run("grpo-trl", [sys.executable, str(script), pol, prompts_file(), str(check.work / "trl"),
                                     str(warm), str(steps), str(PROMPTS), str(GROUP), str(answer)], 300)
        log = (check.work / "grpo-trl.log").read_text(errors="replace")
        for line in log.splitlines():
            if line.startswith("TRLRESULT "):
                row.update(json.loads(line[10:]))
        res["trl"] = row
        check.save()
    out = check.work / "grpo-dschat"
    row = check.run("grpo-dschat", grpo_args(check, pol, out, answer, warm + steps, "auto"), 300)
    row.update(phases(metrics(out), warm))
    res["dschat"] = row
    if res.get("trl", {}).get("step_s") and row.get("step_s"):
        res["dschat_over_trl"] = round(row["step_s"] / res["trl"]["step_s"], 3)
    return res


def plan(check: Check, step: int, flags: list[str]) -> dict[str, Any]:
    p = subprocess.run(dschat_cmd("plan", "--step", str(step), "--gpu", gpu_name(), "--json", *flags),
                       capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        return {"rc": p.returncode, "plan": json.loads(p.stdout[p.stdout.index("{"):p.stdout.rindex("}") + 1])}
    except ValueError:
        return {"rc": p.returncode, "error": (p.stdout + p.stderr)[-400:]}


def stages(check: Check, pol: str, answer: int) -> dict[str, Any]:
    res: dict[str, Any] = {}
    steps = "2" if check.smoke else "4"
    common = ["--dtype", check.dtype, "--max-steps", steps, "--no-progress", "--force"]
    s1 = ["--step", "1", "--model", pol, "--output-dir", str(check.work / "s1"), "--zero-stage", "3", *common]
    s2 = ["--step", "2", "--model", str(check.work / "s1" / "model"), "--output-dir", str(check.work / "s2"),
          "--zero-stage", "3", *common]
    s3 = ["--step", "3", "--algo", "ppo", "--actor-model", str(check.work / "s1" / "model"), "--reward-model",
          str(check.work / "s2" / "model"), "--output-dir", str(check.work / "s3"), "--actor-zero-stage", "3",
          "--critic-zero-stage", "3", "--max-answer-seq-len", str(answer), "--per-device-generation-batch-size", "8",
          "--per-device-train-batch-size", "8", "--max-eval-rows", "16", "--log-interval", "1", "--dtype",
          check.dtype, "--max-steps", "2", "--no-progress", "--force"]
    for name, argv, out in (("stage1", s1, "s1"), ("stage2", s2, "s2"), ("stage3_ppo", s3, "s3")):
        row = check.run(name, dschat_cmd("train", *argv), 240)
        row.update(phases(metrics(check.work / out), 0))
        row["plan"] = plan(check, int(argv[1]), argv[2:])
        res[name] = row
        check.save()
        if row["rc"] != 0:
            break
    return res


def ppo(check: Check, answer: int) -> dict[str, Any]:
    """PPO at the GRPO row's sizes: 64 prompts, one answer each, per step (needs stage 2's reward model)."""
    actor, rm = check.work / "s1" / "model", check.work / "s2" / "model"
    if not (actor.exists() and rm.exists()):
        return {"skipped": "stages 1-2 did not run"}
    out = check.work / "ppo"
    argv = dschat_cmd("train", "--step", "3", "--algo", "ppo", "--actor-model", str(actor), "--reward-model", str(rm),
                      "--data", prompts_file(), "--data-split", "0,0,1", "--eval-fraction", "0", "--max-steps", "3",
                      "--max-answer-seq-len", str(answer), "--max-prompt-seq-len", "128", "--dtype", check.dtype,
                      "--per-device-generation-batch-size", str(PROMPTS * GROUP), "--per-device-train-batch-size",
                      str(PROMPTS * GROUP), "--log-interval", "1", "--save-interval", "0", "--no-save-final-state",
                      "--no-progress", "--force", "--seed", "1234", "--output-dir", str(out))
    row = check.run("ppo", argv, 300)
    row.update(phases(metrics(out), 1))
    return row


def big(check: Check) -> dict[str, Any]:
    """Stage 2 on a Llama-2-7B-shaped random model: LoRA, and full ZeRO-3."""
    pol = build(check, "7b" if not check.smoke else "tiny", "base7b")
    res: dict[str, Any] = {}
    common = ["--step", "2", "--model", pol, "--dtype", check.dtype, "--max-steps", "3", "--no-progress", "--force",
              "--log-interval", "1"]
    for name, flags in (("lora", ["--lora-dim", "64", "--zero-stage", "2"]), ("zero3", ["--zero-stage", "3"])):
        argv = [*common, "--output-dir", str(check.work / f"big-{name}"), *flags]
        row = check.run(f"big-{name}", dschat_cmd("train", *argv), 400)
        row.update(phases(metrics(check.work / f"big-{name}"), 1))
        row["plan"] = plan(check, 2, argv[2:])
        res[name] = row
        check.save()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--parts", default="decode,grpo,stages,ppo")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for the whole check")
    ap.add_argument("--big", action="store_true", help="add stage 2 on a Llama-2-7B-shaped model (minutes more)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and few tokens: the plumbing, on any machine")
    args = ap.parse_args()
    import torch

    check = Check(Path(args.out), args.budget, args.smoke)
    if not check.cuda and not args.smoke:
        sys.exit("gpu_check: no CUDA device here (use --smoke to check the script itself on a CPU)")
    import deepspeed
    import transformers

    from dschat.generation.vllm_engine import vllm_installed, vllm_version

    check.report.update(gpu=torch.cuda.get_device_name(0) if check.cuda else "cpu", torch=torch.__version__,
                        cuda=torch.version.cuda, transformers=transformers.__version__,
                        deepspeed=deepspeed.__version__, vllm=vllm_version() if vllm_installed() else None,
                        commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                              text=True).stdout.strip() or None)
    answer, tokens = (16, 16) if args.smoke else (256, 256)
    pol = build(check, "tiny" if args.smoke else "1b", "policy")
    check.save()
    parts = args.parts.split(",") + (["big"] if args.big else [])
    for part in parts:
        if check.left() < 30:
            check.report.setdefault("skipped", []).append(part)
            continue
        t = time.time()
        try:
            if part == "decode":
                check.report["decode"] = decode(check, pol, tokens)
            elif part == "grpo":
                check.report["grpo"] = grpo(check, pol, answer)
            elif part == "stages":
                check.report["stages"] = stages(check, pol, 16 if args.smoke else 128)
            elif part == "ppo":
                check.report["ppo"] = ppo(check, answer)
            elif part == "big":
                check.report["big"] = big(check)
            else:
                sys.exit(f"gpu_check: unknown part {part!r}")
        except Exception as e:  # the report keeps what the other parts measured
            check.report[f"error_{part}"] = f"{type(e).__name__}: {str(e)[:500]}"
        check.report.setdefault("part_s", {})[part] = round(time.time() - t, 1)
        check.save()
    print(json.dumps(check.report, indent=1, default=str)[:8000])
    print(f"report: {args.out}; logs under {check.work}")


if __name__ == "__main__":
    main()
