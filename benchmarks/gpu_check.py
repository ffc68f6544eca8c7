"""The GPU check: one command on a bare CUDA host without network that measures what docs/speed.md and
docs/planning.md report for GPUs, and writes it as one JSON with every process's log beside it.

The host needs python with torch (CUDA), transformers, peft and accelerate; what else dschat runs on (DeepSpeed
and its needs, sentencepiece, protobuf, click) comes in the folder ``benchmarks/gpu_carry.sh`` builds, whose
``run.sh`` installs what the host lacks and starts this script (docs/speed.md, GPU section). vLLM is optional.
TRL's row needs ``trl`` and ``datasets`` (carried) and the host's own pyarrow and pandas (too large to carry):
without them the row reads ``skipped: no pyarrow``.

Model: a random 0.99B Llama (TinyLlama-1.1B's body: hidden 2048, 22 layers, 32 heads, 4 KV heads, MLP 5632) with
the tiny preset's tokenizer, bf16, built on the GPU (no download). The parent process never touches the device:
it runs each part as a process of its own (``--part NAME``, so each part's memory figures are its own), in this
order (by value), each bounded by its cap (``CAPS``) and by what is left of ``--budget`` (default 450 s: the whole
check stays under 8 minutes on one H100/H200); a part is not started with less than ``MIN_PART_S`` left:

* ``setup`` (always first): versions, the commit (the carry's ``COMMIT`` file; git where there is one), what the
  carry installed; builds the model.
* ``grpo``: TRL's GRPOTrainer, then ``dschat train --step 3 --algo grpo``, 8 prompts x 8 answers x 256 tokens, the
  default backend, one warm-up and two timed steps: seconds per step and per phase (``time/*`` of metrics.jsonl),
  memory (``memory/*``), and dschat's step over TRL's; then the same run with asynchronous rollouts
  (``--async-rollouts --max-staleness 1``, the sampler on a second GPU where there is one, else sharing the
  device): its seconds per step and the lockstep step over it.
* ``stages``: stages 1, 2 and 3 (PPO) at ZeRO-3 (stage 3's actor and critic) for two steps each: exit codes, wall,
  the peak of the device's used memory (nvidia-smi, sampled every 0.5 s) and the run's own ``memory/*`` figures
  beside ``dschat plan --json`` with the same flags.
* ``ppo``: PPO at the GRPO row's sizes (64 prompts of 256-token answers per step), actor and critic at ZeRO 0,
  on stage 1's and stage 2's models.
* ``weights``: the weight plane (``dschat.generation.weight_plane``) on the same model, each row measured where
  the device allows and else ``skipped`` with the reason: ``copy``, the device's own copy bandwidth (``copy_`` of
  a buffer of an update's size, CUDA events); ``pack``, the trainer's packing and checksumming of the model into
  staging on its GPU (``Sender.pack``, the probe left out), its GB/s and ``over_copy``; ``update_gloo``, a full
  update from a trainer process on the GPU to a receiver process on the CPU over gloo, and ``update_nccl`` (two
  GPUs: the receiver on ``cuda:1``), each the median of three after a warm-up, from the trainer's first touch of
  its weights to the receiver's verdict (``s``, ``gbps``; ``stream_s``, ``stream_gbps``: the receiver's, from the
  layout to the last bucket loaded; NCCL's also over the copy); ``lora_adapter``, a LoRA r=8 (all-linear) model's
  first update (the base and the adapters) and a later one (the adapters alone), bytes and seconds and
  ``adapter_over_full_*`` (NCCL with two GPUs, else gloo); ``vllm_sampler`` (two GPUs and vLLM), the GRPO run for
  three steps with ``--async-rollouts --sampler-devices cuda:1 --generation-backend vllm``.
* ``decode``: the same 64 rows (8 prompts x 8) and 256 new tokens through each backend while time is left (one is
  not started with less than 1.2 times the slowest so far), in order of value:
  dschat's eager loop (constant-shape step), ``graph`` (its capture time too), HF ``generate`` on dschat's
  loading, the growing eager step, HF on a plain ``from_pretrained``, then both HF rows with SDPA's cuDNN
  backend on, and vLLM where it is installed. Each backend is warmed up at the timed shape (the same rows and the
  same number of new tokens), so no capture or compile falls in the timed run (``captures_in_timed`` says so for
  ``graph``). Per backend: wall and CPU ms per token step, greedy parity with HF ``generate`` (the share of equal
  rows; bf16 kernels differ, so a near-tie may part a row), and the largest sampled-token log-prob difference to
  the eager loop from the same seed. ``--compile-variants`` adds the compile-heavy ones (``compiled``,
  ``lean_reduce_overhead``, ``hf_static_compiled``: tens of seconds to compile each).
* ``big`` (``--big`` only, with its own allowance beyond the budget): ``dschat train --step 2`` on a
  Llama-2-7B-shaped random model, with LoRA and with full ZeRO-3, a few steps each, peak memory and step time
  against the plan.

Output (``--out-dir``): ``gpu_check.json``, rewritten as each part ends and after each decode backend, and
``logs/``: each part's log (``part-NAME.log``), each command's log and its metrics.jsonl. The models and runs go
to a temporary folder, removed at the end. The exit status is 1 when a part's process failed or a row holds an
error or a non-zero exit code (with ``--smoke`` also when a part did not run or a figure is missing), after
everything is written; the problems are listed under ``problems`` in the report.

    python benchmarks/gpu_check.py --out-dir gpu_check_out          # one H100/H200: under 8 minutes
    python benchmarks/gpu_check.py --parts grpo,decode --budget 300
    python benchmarks/gpu_check.py --parts weights                   # the weight plane alone: about a minute
    python benchmarks/gpu_check.py --smoke                          # the plumbing at tiny shapes, on any machine
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
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

PARTS = ("grpo", "stages", "ppo", "weights", "decode")  # the default run, in order of value
#: the most seconds each part's process may take in the full run (what is left of the budget may be less);
#: ``big`` has its own allowance beyond the budget
CAPS = {"setup": 90, "grpo": 330, "stages": 200, "ppo": 120, "weights": 150, "decode": 240, "big": 420}
COMPILE_EXTRA_S = 180  # decode's cap grows by this with --compile-variants (raise --budget to match)
TWO_GPU_EXTRA_S = 150  # weights' cap grows by this with two GPUs (its NCCL pair and vLLM sampler rows)
SMOKE_CAP = 300  # per part in --smoke, whose machine may be a slow CPU
MIN_PART_S = 30  # a part is not started with less left of the budget
GRACE_S = 20  # past its deadline before a part's process is killed
REPORT = "gpu_check.json"

SHAPES = {"1b": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                     intermediate_size=5632),
          "7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                     intermediate_size=11008),
          "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128)}
#: the workload: prompts x group answers per RL step (and decode rows), answer tokens of the RL rows, of stage 3 at
#: ZeRO-3 and of the decode rows, the greedy/sampled tokens compared for parity, RL steps (the first a warm-up),
#: held-out rows of stages 1 and 2
SIZES = {"full": dict(prompts=8, group=8, answer=256, zero3_answer=128, tokens=256, parity=32, rl_steps=3,
                     eval_rows=32),
         "smoke": dict(prompts=2, group=4, answer=16, zero3_answer=16, tokens=16, parity=8, rl_steps=2, eval_rows=8)}
REWARD = '''def length(prompts, completions, **kwargs):
    """An uncapped length reward: random weights give every group a spread, so every row trains."""
    return [0.001 * len(c) for c in completions]
'''


# ---------------------------------------------------------------------------------------------- the report
def read_report(out_dir: Path) -> dict[str, Any]:
    path = out_dir / REPORT
    return json.loads(path.read_text()) if path.exists() else {}


def update_report(out_dir: Path, **items: Any) -> dict[str, Any]:
    """Adds ``items`` to the report on disk (written whole, then renamed: a killed process leaves the last one)."""
    report = read_report(out_dir)
    report.update(items)
    if "started" in report:
        report["elapsed_s"] = round(time.time() - report["started"], 1)
    tmp = out_dir / (REPORT + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    os.replace(tmp, out_dir / REPORT)
    return report


def child_env() -> dict[str, str]:
    """The environment of every process the check starts: the code's folder before the paths already there (the
    carried packages among them), never instead of them."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONPATH=path)


def run_logged(argv: list[str], log: Path, timeout: float) -> int:
    """``argv`` with its output in ``log``; its exit code, 124 when it ran past ``timeout`` (then its whole process
    group is killed, so no grandchild keeps the device)."""
    with open(log, "w") as f:
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT,
                             start_new_session=True)
    try:
        return p.wait(timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    with open(log, "a") as f:
        f.write(f"\ngpu_check: killed after {timeout:.0f} s\n")
    return 124


# ------------------------------------------------------------------------------------------- a part's process
class Check:
    """One part's process: its deadline, the commands it runs (each logged under ``logs/``) and the report."""

    def __init__(self, out_dir: Path, work: Path, deadline: float, smoke: bool, compile_variants: bool):
        self.out_dir, self.work, self.deadline, self.smoke = out_dir, work, deadline, smoke
        self.compile_variants = compile_variants
        self.logs = out_dir / "logs"
        env = read_report(out_dir).get("env") or {}
        self.cuda = env["device"] == "cuda" if "device" in env else cuda_available()
        self.gpu = env.get("gpu_class", "H100")
        self.dtype = "bf16" if self.cuda else "fp32"
        self.size = SIZES["smoke" if smoke else "full"]

    def left(self) -> float:
        return self.deadline - time.time()

    def save(self, key: str, value: Any) -> None:
        update_report(self.out_dir, **{key: value})

    def run(self, name: str, argv: list[str], cap: float, out: Path | None = None, warm: int = 0) -> dict[str, Any]:
        """A command, bounded by ``cap`` and the part's deadline: its exit code, wall time, the device's used
        memory (MiB) before it and at its peak, the tail of its log and, given its output folder, the phases of its
        metrics.jsonl (copied to ``logs/``)."""
        timeout = max(10.0, min(cap, self.left() - 5))
        before = device_used_mib() if self.cuda else 0
        peak, done = [before], threading.Event()

        def watch() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], device_used_mib())
                time.sleep(0.5)

        th = threading.Thread(target=watch, daemon=True)
        if self.cuda:
            th.start()
        t = time.time()
        log = self.logs / f"{name}.log"
        rc = run_logged(argv, log, timeout)
        done.set()
        if self.cuda:
            th.join()
        tail = log.read_text(errors="replace").splitlines()[-12:]
        row: dict[str, Any] = {"rc": rc, "wall_s": round(time.time() - t, 1), "device_mib_before": before,
                               "peak_device_mib": peak[0], "log": f"logs/{name}.log", "tail": tail}
        if out is not None:
            if (out / "metrics.jsonl").exists():
                shutil.copy(out / "metrics.jsonl", self.logs / f"{name}.metrics.jsonl")
            row.update(phases(metrics(out), warm))
        return row


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def cuda_elsewhere() -> bool:
    """Whether torch sees a CUDA device, asked in a process of its own: the parent holds nothing on the device."""
    p = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"], capture_output=True,
                       text=True, env=child_env())
    return p.stdout.strip() == "True"


def device_used_mib() -> int:
    try:
        o = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=5).stdout
        return max(int(x) for x in o.split())
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0


def gpu_count() -> int:
    try:
        o = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=5).stdout
        return sum(line.startswith("GPU ") for line in o.splitlines())
    except (OSError, subprocess.SubprocessError):
        return 0


def dschat_cmd(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from dschat.cli.main import cli; sys.argv[0] = 'dschat'; cli()", *args]


def metrics(out: Path) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def phases(rows: list[dict[str, Any]], warm: int) -> dict[str, Any]:
    """Seconds per step (wall between logged training steps after ``warm`` warm-ups) and the median of every
    ``time/*``; the largest of every ``memory/*``."""
    steps = [r for r in rows if "time/training_s" in r or "train/loss" in r]
    walls = [round(steps[i]["time"] - steps[i - 1]["time"], 3) for i in range(max(warm, 1), len(steps))
             if "time" in steps[i] and "time" in steps[i - 1]]
    timed = steps[warm:] or steps
    out: dict[str, Any] = {"steps": len(steps), "step_s": round(statistics.median(walls), 3) if walls else None,
                           "walls": walls}
    for key in sorted({k for r in timed for k in r if k.startswith("time/") or k == "train/answer_length"}):
        out[key] = statistics.median(r[key] for r in timed if key in r)
    for key in sorted({k for r in rows for k in r if k.startswith("memory/")}):
        out[key] = max(r[key] for r in rows if key in r)
    return out


def gpu_class(name: str) -> str:
    """``dschat plan --gpu``'s name for the device (H100 where it knows none closer)."""
    name = name.upper()
    return "H200" if "H200" in name else "H100" if "H100" in name else "A100-80GB" if "A100" in name else "H100"


def prompts_file() -> str:
    from dschat.demo import demo_files

    return str(demo_files()["prompts"])


def error_text(e: BaseException) -> str:
    first = str(e).splitlines()[0][:300] if str(e) else ""
    return f"{type(e).__name__}: {first}"


# --------------------------------------------------------------------------------------------------- setup
def git(*args: str) -> str | None:
    """A git query's answer; None where git is missing or fails (the GPU host has none)."""
    try:
        p = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (p.stdout.strip() or None) if p.returncode == 0 else None


def commit() -> dict[str, str | None]:
    """The code's commit and ``git describe --dirty``: from the ``COMMIT`` file gpu_carry.sh writes into the
    carried code, else from git."""
    path = ROOT / "COMMIT"
    if path.exists():
        pairs = (line.split(None, 1) for line in path.read_text().splitlines() if line.strip())
        found = {p[0]: p[1].strip() if len(p) > 1 else None for p in pairs}
        return {"commit": found.get("commit"), "describe": found.get("describe")}
    return {"commit": git("rev-parse", "HEAD"), "describe": git("describe", "--always", "--dirty")}


def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in ("torch", "transformers", "peft", "accelerate", "deepspeed", "trl", "datasets", "pyarrow",
                 "pandas", "vllm"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def carried() -> list[str]:
    """The distributions run.sh installed from the carry (the host lacked them): ``name-version``."""
    site = os.environ.get("DSCHAT_CARRY_SITE")
    if not site or not Path(site).is_dir():
        return []
    return sorted(p.name[: -len(".dist-info")] for p in Path(site).glob("*.dist-info"))


def setup(check: Check) -> None:
    import torch

    env: dict[str, Any] = {"device": "cuda" if check.cuda else "cpu", "python": sys.version.split()[0],
                           "cuda": torch.version.cuda, **versions(), **commit(), "carried": carried()}
    if check.cuda:
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_class"] = gpu_class(env["gpu"])
    check.save("env", env)
    policy = build(check, "tiny" if check.smoke else "1b", "policy")
    check.save("setup", {"policy_params": policy[1]})


def build(check: Check, shape: str, name: str) -> tuple[str, int]:
    """A random Llama of ``shape`` with the tiny preset's tokenizer, saved under the work folder."""
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
    return str(path), sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------------- grpo
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


def trl_missing() -> str | None:
    """Why TRL's row cannot run here (None: it can). datasets needs pyarrow and pandas, which are not carried."""
    import importlib.util

    for name in ("pyarrow", "pandas", "datasets", "trl"):
        if importlib.util.find_spec(name) is None:
            return f"no {name}"
    return None


def grpo_trl(check: Check, pol: str, warm: int, steps: int) -> dict[str, Any]:
    why = trl_missing()
    if why is not None:
        return {"skipped": why}
    script = check.work / "trl_grpo.py"
    script.write_text(TRL_SCRIPT)
    argv = [sys.executable, str(script), pol, prompts_file(), str(check.work / "trl"), str(warm), str(steps),
            str(check.size["prompts"]), str(check.size["group"]), str(check.size["answer"])]
    row = check.run("grpo-trl", argv, min(120.0, 0.5 * check.left()))
    for line in (check.logs / "grpo-trl.log").read_text(errors="replace").splitlines():
        if line.startswith("TRLRESULT "):
            row.update(json.loads(line[len("TRLRESULT "):]))
    return row


def grpo_args(check: Check, pol: str, out: Path, steps: int) -> list[str]:
    reward = check.work / "len_reward.py"
    reward.write_text(REWARD)
    prompts, group = check.size["prompts"], check.size["group"]
    return dschat_cmd("train", "--step", "3", "--algo", "grpo", "--actor-model", pol, "--data", prompts_file(),
                      "--data-split", "0,0,1", "--eval-fraction", "0", "--max-steps", str(steps),
                      "--max-answer-seq-len", str(check.size["answer"]), "--max-prompt-seq-len", "128", "--dtype",
                      check.dtype, "--generation-backend", "auto", "--actor-learning-rate", "1e-5",
                      "--lr-scheduler-type", "constant", "--log-interval", "1", "--save-interval", "0",
                      "--no-save-final-state", "--no-progress", "--force", "--seed", "1234", "--output-dir", str(out),
                      "--reward-funcs", f"{reward}:length", "--beta", "0", "--num-generations", str(group),
                      "--per-device-generation-batch-size", str(prompts), "--per-device-train-batch-size",
                      str(prompts * group), "--no-actor-gradient-checkpointing")


def grpo(check: Check) -> None:
    warm, steps = 1, check.size["rl_steps"] - 1
    pol = str(check.work / "policy")
    res: dict[str, Any] = {"trl": grpo_trl(check, pol, warm, steps)}
    check.save("grpo", res)
    out = check.work / "grpo-dschat"
    res["dschat"] = check.run("grpo-dschat", grpo_args(check, pol, out, warm + steps), 150, out, warm)
    if res["trl"].get("step_s") and res["dschat"].get("step_s"):
        res["dschat_over_trl"] = round(res["dschat"]["step_s"] / res["trl"]["step_s"], 3)
    check.save("grpo", res)
    # the same run with asynchronous rollouts: a sampler on a second GPU where there is one, else sharing the
    # device (or the CPU); its first two steps are not overlapped (the pattern is learnt in the first), so they warm
    sampler = "cuda:1" if gpu_count() > 1 else "cuda:0" if check.cuda else "cpu"
    out = check.work / "grpo-async"
    row = check.run("grpo-async", grpo_args(check, pol, out, 2 + steps) + [
        "--async-rollouts", "--sampler-devices", sampler, "--max-staleness", "1"], 150, out, 2)
    res["dschat_async"] = {"sampler_devices": sampler, **row}
    if row.get("step_s") and res["dschat"].get("step_s"):
        res["lockstep_over_async"] = round(res["dschat"]["step_s"] / row["step_s"], 3)
    check.save("grpo", res)


# -------------------------------------------------------------------------------------------- stages, ppo
def plan(check: Check, step: int, flags: list[str]) -> dict[str, Any]:
    """``dschat plan --json`` with a run's flags: its exit code and its JSON (``json``)."""
    log = check.logs / f"plan-step{step}.log"
    argv = dschat_cmd("plan", "--step", str(step), "--gpu", check.gpu, "--json", *flags)
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=max(10.0, min(60.0, check.left())),
                           cwd=ROOT, env=child_env())
    except subprocess.TimeoutExpired:
        return {"rc": 124, "error": "dschat plan timed out"}
    log.write_text(p.stdout + p.stderr)
    try:
        return {"rc": p.returncode, "json": json.loads(p.stdout[p.stdout.index("{"):p.stdout.rindex("}") + 1])}
    except ValueError:
        return {"rc": p.returncode, "error": (p.stdout + p.stderr).strip()[-400:] or "no output"}


def stage_args(check: Check) -> list[tuple[str, list[str], str]]:
    pol, w, rows = str(check.work / "policy"), check.work, str(check.size["eval_rows"])
    common = ["--dtype", check.dtype, "--max-steps", "2", "--log-interval", "1", "--no-save-final-state",
              "--no-progress", "--force"]
    s1 = ["--step", "1", "--model", pol, "--output-dir", str(w / "s1"), "--zero-stage", "3", "--max-eval-rows", rows,
          *common]
    s2 = ["--step", "2", "--model", str(w / "s1" / "model"), "--output-dir", str(w / "s2"), "--zero-stage", "3",
          "--max-eval-rows", rows, *common]
    s3 = ["--step", "3", "--algo", "ppo", "--actor-model", str(w / "s1" / "model"), "--reward-model",
          str(w / "s2" / "model"), "--output-dir", str(w / "s3"), "--actor-zero-stage", "3", "--critic-zero-stage",
          "3", "--max-answer-seq-len", str(check.size["zero3_answer"]), "--per-device-generation-batch-size", "8",
          "--per-device-train-batch-size", "8", "--max-eval-rows", "8", *common]
    return [("stage1", s1, "s1"), ("stage2", s2, "s2"), ("stage3_ppo", s3, "s3")]


def stages(check: Check) -> None:
    res: dict[str, Any] = {}
    caps = {"stage1": 50, "stage2": 50, "stage3_ppo": 110}
    for name, argv, out in stage_args(check):
        row = check.run(name, dschat_cmd("train", *argv), SMOKE_CAP if check.smoke else caps[name], check.work / out)
        row["plan"] = plan(check, int(argv[1]), argv[2:])
        res[name] = row
        check.save("stages", res)
        if row["rc"] != 0:
            break


def ppo(check: Check) -> None:
    """PPO at the GRPO row's sizes: 64 prompts, one answer each, per step (on stage 1's and stage 2's models)."""
    actor, rm = check.work / "s1" / "model", check.work / "s2" / "model"
    if not (actor.exists() and rm.exists()):
        check.save("ppo", {"error": "stages 1-2 left no models (run the stages part first)"})
        return
    out = check.work / "ppo"
    rows = check.size["prompts"] * check.size["group"]
    argv = dschat_cmd("train", "--step", "3", "--algo", "ppo", "--actor-model", str(actor), "--reward-model", str(rm),
                      "--data", prompts_file(), "--data-split", "0,0,1", "--eval-fraction", "0", "--max-steps",
                      str(check.size["rl_steps"]), "--max-answer-seq-len", str(check.size["answer"]),
                      "--max-prompt-seq-len", "128", "--dtype", check.dtype, "--per-device-generation-batch-size",
                      str(rows), "--per-device-train-batch-size", str(rows), "--log-interval", "1", "--save-interval",
                      "0", "--no-save-final-state", "--no-progress", "--force", "--seed", "1234", "--output-dir",
                      str(out))
    check.save("ppo", check.run("ppo", argv, SMOKE_CAP if check.smoke else 110, out, 1))


def big(check: Check) -> None:
    """Stage 2 on a Llama-2-7B-shaped random model: LoRA, and full ZeRO-3."""
    pol, params = build(check, "7b" if not check.smoke else "tiny", "base7b")
    res: dict[str, Any] = {"params": params}
    common = ["--step", "2", "--model", pol, "--dtype", check.dtype, "--max-steps", "3", "--no-progress", "--force",
              "--log-interval", "1", "--max-eval-rows", "32", "--no-save-final-state"]
    for name, flags in (("lora", ["--lora-dim", "64", "--zero-stage", "2"]), ("zero3", ["--zero-stage", "3"])):
        out = check.work / f"big-{name}"
        argv = [*common, "--output-dir", str(out), *flags]
        row = check.run(f"big-{name}", dschat_cmd("train", *argv), 0.5 * check.left(), out, 1)
        row["plan"] = plan(check, 2, argv[2:])
        res[name] = row
        check.save("big", res)


# ------------------------------------------------------------------------------------------------- weights
WEIGHT_ROWS = ("copy", "pack", "update_gloo", "update_nccl", "lora_adapter", "vllm_sampler")
#: updates per measurement: the first a warm-up (a staging made, NCCL's communicator formed), the rest timed
WEIGHT_UPDATES = {"full": 4, "smoke": 2}
WEIGHT_SECRET = "gpu-check-weight-plane-" + "0" * 24  # the control channel's handshake, on loopback
WEIGHT_TIMEOUT_S = 90.0  # the longest a side waits for its peer (each wait of the plane's)
LORA_R = 8
NO_CUDA = "no CUDA device"


def gbps(nbytes: float, seconds: float | None) -> float | None:
    """Bytes per second in GB/s (1e9), four significant digits; None without a positive time."""
    if not seconds or seconds <= 0:
        return None
    return float(f"{nbytes / seconds / 1e9:.4g}")


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b`` to four significant digits; None where either is missing or ``b`` is not positive."""
    if a is None or not b or b <= 0:
        return None
    return float(f"{a / b:.4g}")


def weights_plan(cuda: bool, gpus: int, vllm: bool) -> dict[str, str | None]:
    """Why each row of the weights part cannot be measured on this device (None: it can). ``update_gloo`` and
    ``lora_adapter`` always can (without a GPU, ``--smoke``'s plumbing: a CPU trainer)."""
    gpu = None if cuda else NO_CUDA
    nccl = vllm_row = gpu
    if cuda and gpus < 2:
        nccl = f"NCCL needs two GPUs; this device has {gpus}"
        vllm_row = f"a vLLM sampler on a second GPU needs two GPUs; this device has {gpus}"
    elif cuda and not vllm:
        vllm_row = "vLLM is not installed"
    return {"copy": gpu, "pack": gpu, "update_gloo": None, "update_nccl": nccl, "lora_adapter": None,
            "vllm_sampler": vllm_row}


def timed_updates(updates: list[dict[str, Any]], kind: str, warm: int = 1) -> dict[str, Any]:
    """The updates of ``kind`` after the first ``warm`` (all of them where there are no more): their bytes, the
    median of each timing (``s``: from the trainer's first touch to the receiver's verdict; ``stream_s``: the
    receiver's, from the layout to the last bucket loaded) and the GB/s of each."""
    rows = [u for u in updates if u["kind"] == kind]
    timed = rows[warm:] or rows
    if not timed:
        return {}
    out: dict[str, Any] = {"bytes": timed[-1]["bytes"], "timed": len(timed)}
    for key in ("s", "stream_s", "verdict_s", "pack_s"):
        values = [u[key] for u in timed if u.get(key) is not None]
        if values:
            out[key] = float(f"{statistics.median(values):.6g}")
    out["gbps"] = gbps(out["bytes"], out.get("s"))
    out["stream_gbps"] = gbps(out["bytes"], out.get("stream_s"))
    return out


def lora_row(updates: list[dict[str, Any]]) -> dict[str, Any]:
    """A LoRA run's first (full: base and adapters) and later (adapters alone) updates side by side."""
    full, adapter = timed_updates(updates, "full"), timed_updates(updates, "adapter")
    return {"full_bytes": full.get("bytes"), "full_s": full.get("s"), "full_gbps": full.get("gbps"),
            "adapter_bytes": adapter.get("bytes"), "adapter_s": adapter.get("s"),
            "adapter_over_full_bytes": ratio(adapter.get("bytes"), full.get("bytes")),
            "adapter_over_full_s": ratio(adapter.get("s"), full.get("s"))}


def with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """``argv`` with ``flag``'s value replaced (added where it is absent)."""
    if flag not in argv:
        return [*argv, flag, value]
    i = argv.index(flag)
    return [*argv[:i + 1], value, *argv[i + 2:]]


def copy_rate(nbytes: int, device: Any, reps: int) -> dict[str, Any]:
    """The device's own copy bandwidth at an update's size: ``copy_`` of one ``nbytes`` buffer into another, after
    a warm-up, timed with CUDA events on a GPU (the wall clock elsewhere); the median of ``reps``."""
    import torch

    a = torch.ones(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(reps):
        if a.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            b.copy_(a)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t = time.perf_counter()
            b.copy_(a)
            times.append(time.perf_counter() - t)
    s = statistics.median(times)
    return {"bytes": nbytes, "s": float(f"{s:.6g}"), "gbps": gbps(nbytes, s), "reps": reps}


def pack_rate(model: Any, reps: int, staging: str = "device") -> dict[str, Any]:
    """The sender's packing of ``model`` into its staging (on the weights' GPU with ``staging="device"``): every
    bucket packed and checksummed (``Sender.pack``), with a courier that only gives each staged buffer back (nothing
    sent) and without the probe (a forward, not packing); from the call to the last bucket staged and the device
    idle. One warm-up (the staging made), then the median of ``reps``."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from dschat.generation import weight_plane as W

    def drain(update: Any) -> None:
        while True:
            item = update.packed.get(timeout=WEIGHT_TIMEOUT_S)
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            if item.ready is not None:
                item.ready.synchronize()
            item.stage.give(item.key)

    param = next(model.parameters())
    sender = W.Sender(model, True, streaming=False, staging=staging)
    sender.group_device = param.device  # the staging stays where the weights are when they are on a GPU
    layout = sender.layout("full")
    sync = torch.cuda.synchronize if param.is_cuda else (lambda: None)
    probe, times = W.probe_logprobs, []
    W.probe_logprobs = lambda module: []  # type: ignore[assignment]
    try:
        with ThreadPoolExecutor(1) as courier:
            for v in range(1 + reps):
                update = W.Update(v, layout, str(param.dtype))
                sync()
                t = time.perf_counter()
                drained = courier.submit(drain, update)
                sender.pack(update)
                drained.result(WEIGHT_TIMEOUT_S)
                sync()
                times.append(time.perf_counter() - t)
    finally:
        W.probe_logprobs = probe  # type: ignore[assignment]
    s = statistics.median(times[1:])
    return {"bytes": layout.nbytes, "buckets": len(layout.buckets), "s": float(f"{s:.6g}"),
            "gbps": gbps(layout.nbytes, s), "staging": str(sender.stages["full"].device),
            "staging_bytes": sender.staging_bytes, "reps": reps}


def load_model(path: str, dtype: str, device: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    return AutoModelForCausalLM.from_pretrained(path, dtype=dt).to(device).eval()


def weights_side(spec: dict[str, Any]) -> None:
    """One side of a weight-plane pair, a process of its own (``--side SPEC``): the trainer (``send``) connects
    the control channel, hosts the weight group's store and sends ``kinds`` in turn (as stage 3 does: packed on
    this thread while a courier thread sends what is staged), timing each from its first touch of the weights to
    the receiver's verdict; the receiver (``recv``) loads each into its own model (``ModuleReceiver``) and checks
    it. Each writes what it saw to ``out``."""
    import torch

    from dschat import engine as E
    from dschat.generation import channel as C
    from dschat.generation import weight_plane as W

    role, timeout, device = spec["role"], float(spec["timeout"]), spec["device"]
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    model = load_model(spec["model"], spec["dtype"], device)
    out: dict[str, Any] = {"device": device, "dtype": spec["dtype"]}
    if role == "recv":
        ch = C.accept(C.listen("127.0.0.1", int(spec["port"])), WEIGHT_SECRET, timeout, print)
        host, store_port = ch.recv()[0]["store"]
        receiver = W.ModuleReceiver(model)
        receiver.group = W.join_group({"store": [host, store_port], "prefix": spec["prefix"], "rank": 1, "size": 2,
                                       "nccl": spec["nccl"], "timeout": timeout}, 0)
        got = []
        for _ in spec["kinds"]:
            head, _ = ch.recv()
            layout = W.Layout.from_json(head["layout"])
            t = time.perf_counter()
            sums = receiver.receive(layout, head["version"])
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            stream_s = time.perf_counter() - t
            end, _ = ch.recv()
            t = time.perf_counter()
            problem = W.verdict_of(receiver, layout, sums, end)
            ch.send({"ok": not problem, "message": problem})
            got.append({"version": head["version"], "kind": layout.kind, "stream_s": stream_s,
                        "verdict_s": time.perf_counter() - t, "problem": problem})
            if problem:
                break
        out["updates"] = got
        Path(spec["out"]).write_text(json.dumps(out))
        return
    from concurrent.futures import ThreadPoolExecutor

    if spec.get("lora"):
        from dschat.config import LoraArgs
        from dschat.models.lora import apply_lora

        apply_lora(model, LoraArgs(lora_dim=LORA_R, lora_alpha=2.0 * LORA_R))  # every linear layer of the body
    ch = C.connect("127.0.0.1", int(spec["port"]), WEIGHT_SECRET, timeout)
    store = E.WeightStore("127.0.0.1", timeout)
    ch.send({"store": [store.host, store.port]})
    group = E.WeightGroup(store.store, spec["prefix"], 0, 2, timeout, bool(spec["nccl"]))
    sender = W.Sender(model, True, streaming=False, staging=spec.get("staging", "auto"))
    sender.group_device = group.device
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    dtype = str(next(model.parameters()).dtype)
    sent = []
    with ThreadPoolExecutor(1) as courier:
        for version, kind in enumerate(spec["kinds"]):
            update = W.Update(version, sender.layout(kind), dtype)
            sync()
            t = time.perf_counter()
            done = courier.submit(sender.send, update, [ch], group, timeout)
            sender.pack(update)
            metrics = done.result(timeout)
            sent.append({"version": version, "kind": kind, "bytes": update.layout.nbytes,
                         "s": time.perf_counter() - t, "pack_s": metrics["sync/pack_s"],
                         "staging": str(sender.stages[kind].device)})
    out.update(updates=sent, params=sum(p.numel() for p in model.parameters()), nccl=bool(spec["nccl"]))
    Path(spec["out"]).write_text(json.dumps(out))


def weight_pair(check: Check, name: str, spec: dict[str, Any], cap: float) -> dict[str, Any]:
    """A trainer and a receiver (``weights_side``), each a process of its own with its log under ``logs/``, both
    bounded by ``cap`` and the part's deadline; their updates side by side (``updates``: the trainer's timings with
    the receiver's ``stream_s`` and ``verdict_s``) and their exit codes (``rc``: the first that is not 0)."""
    from dschat.utils import free_port

    timeout = max(10.0, min(cap, check.left() - 5))
    port, rcs = free_port(), {}
    spec = {**spec, "port": port, "prefix": name, "timeout": max(10.0, min(WEIGHT_TIMEOUT_S, timeout - 10))}
    threads = []
    for role in ("recv", "send"):
        side = {**spec, **spec[role], "role": role, "out": str(check.work / f"{name}-{role}.json")}
        Path(side["out"]).unlink(missing_ok=True)
        path = check.work / f"{name}-{role}.spec.json"
        path.write_text(json.dumps(side))
        argv = [sys.executable, str(Path(__file__).resolve()), "--side", str(path)]

        def run(role: str = role, argv: list[str] = argv) -> None:
            rcs[role] = run_logged(argv, check.logs / f"{name}-{role}.log", timeout)

        threads.append(threading.Thread(target=run, daemon=True))
        threads[-1].start()
    for th in threads:
        th.join()
    rc = next((rcs[r] for r in ("send", "recv") if rcs.get(r)), 0)
    row: dict[str, Any] = {"rc": rc, "logs": [f"logs/{name}-recv.log", f"logs/{name}-send.log"]}
    if rc != 0:
        failed = "send" if rcs.get("send") else "recv"
        row["tail"] = (check.logs / f"{name}-{failed}.log").read_text(errors="replace").splitlines()[-12:]
        return row
    sent = json.loads((check.work / f"{name}-send.json").read_text())
    got = json.loads((check.work / f"{name}-recv.json").read_text())
    problems = [u["problem"] for u in got["updates"] if u["problem"]]
    if problems:
        row["error"] = f"the receiver refused an update: {problems[0]}"
    for u, r in zip(sent["updates"], got["updates"], strict=False):
        u.update(stream_s=r["stream_s"], verdict_s=r["verdict_s"])
    row.update(trainer=f"{sent['device']} {sent['dtype']}", receiver=f"{got['device']} {got['dtype']}",
               group="nccl" if sent["nccl"] else "gloo", staging=sent["updates"][-1]["staging"],
               params=sent["params"], updates=sent["updates"])
    return row


def weights(check: Check) -> None:
    """The weight plane (``dschat.generation.weight_plane``) on the setup's model: the device's copy bandwidth and
    the sender's packing into device staging against it; a full update from a trainer to a receiver in another
    process over gloo (GPU trainer, CPU receiver) and over NCCL (two GPUs); a LoRA r=8 model's first (full) and
    later (adapters alone) updates; a vLLM sampler on a second GPU in a short GRPO run. A row the device cannot
    measure reads ``skipped`` with the reason."""
    import torch

    from dschat.generation.vllm_engine import vllm_installed

    pol = str(check.work / "policy")
    gpus = torch.cuda.device_count() if check.cuda else 0
    plan = weights_plan(check.cuda, gpus, vllm_installed())
    res: dict[str, Any] = {"gpus": gpus}
    res.update({row: {"skipped": why} for row, why in plan.items() if why})
    check.save("weights", res)
    n = WEIGHT_UPDATES["smoke" if check.smoke else "full"]
    trainer = {"device": "cuda:0" if check.cuda else "cpu", "dtype": check.dtype}

    def measure(row: str, least: float, fn: Any) -> None:
        if plan[row] is not None:
            return
        if check.left() < least:
            res[row] = {"skipped": f"{check.left():.0f} s left of the part, under the {least:.0f} s it needs"}
        else:
            try:
                res[row] = fn()
            except Exception as e:  # one row's failure is a row of the report, not the end of the part
                res[row] = {"error": error_text(e)}
        print(f"weights {row}: {res[row]}", flush=True)
        check.save("weights", res)

    held: dict[str, Any] = {}  # the trainer's model on the GPU, for the copy's size and the packing

    def copy() -> dict[str, Any]:
        from dschat.generation.weight_plane import plan_layout

        held["model"] = load_model(pol, check.dtype, "cuda:0")
        return copy_rate(plan_layout(held["model"], "full").nbytes, torch.device("cuda:0"), 5)

    def pack() -> dict[str, Any]:
        model = held["model"] if "model" in held else load_model(pol, check.dtype, "cuda:0")
        row = pack_rate(model, n - 1)
        return {**row, "over_copy": ratio(row["gbps"], res.get("copy", {}).get("gbps"))}

    def update(name: str, receiver: dict[str, Any], nccl: bool) -> dict[str, Any]:
        row = weight_pair(check, f"weights-{name}", {"model": pol, "nccl": nccl, "kinds": ["full"] * n,
                                                    "send": trainer, "recv": receiver}, 120)
        if "updates" in row:
            row.update(timed_updates(row["updates"], "full"))
            copy = res.get("copy", {}).get("gbps")
            if nccl:
                row.update(over_copy=ratio(row["gbps"], copy), stream_over_copy=ratio(row["stream_gbps"], copy))
        return row

    def lora() -> dict[str, Any]:
        nccl = plan["update_nccl"] is None
        receiver = {"device": "cuda:1", "dtype": check.dtype} if nccl else {"device": "cpu", "dtype": "fp32"}
        kinds = ["full"] * (n // 2) + ["adapter"] * (n - n // 2 + 1)  # each kind: a warm-up, then timed
        row = weight_pair(check, "weights-lora", {"model": pol, "nccl": nccl, "kinds": kinds, "send": trainer,
                                                  "recv": receiver, "lora": True}, 120)
        if "updates" in row:
            row.update(r=LORA_R, **lora_row(row["updates"]))
        return row

    def vllm() -> dict[str, Any]:
        out = check.work / "weights-vllm"
        argv = with_flag(grpo_args(check, pol, out, 3), "--generation-backend", "vllm") + [
            "--async-rollouts", "--sampler-devices", "cuda:1", "--max-staleness", "1"]
        row = check.run("weights-vllm", argv, 150, out, 2)
        timed = metrics(out)[2:]
        for key in sorted({k for r in timed for k in r if k.startswith(("sync/", "async/"))}):
            row[key] = statistics.median(r[key] for r in timed if key in r)
        return {"sampler_devices": "cuda:1", "generation_backend": "vllm", **row}

    measure("copy", 30, copy)
    measure("pack", 30, pack)
    held.clear()
    if check.cuda:
        torch.cuda.empty_cache()
    measure("update_gloo", 40, lambda: update("gloo", {"device": "cpu", "dtype": "fp32"}, False))
    measure("update_nccl", 40, lambda: update("nccl", {"device": "cuda:1", "dtype": check.dtype}, True))
    measure("lora_adapter", 40, lora)
    measure("vllm_sampler", 90, vllm)


def weights_lines(res: dict[str, Any]) -> list[str]:
    """The weights part's headline figures, one line per row."""
    out = []
    for name in WEIGHT_ROWS:
        row = res.get(name)
        if not isinstance(row, dict):
            continue
        if "skipped" in row or "error" in row:
            figure = f"skipped: {row['skipped']}" if "skipped" in row else f"error: {row['error']}"
        elif name in ("copy", "pack"):
            figure = f"{row.get('gbps')} GB/s" + (f" ({row['over_copy']} of the copy)" if "over_copy" in row else "")
        elif name == "lora_adapter":
            figure = (f"full {row.get('full_bytes')} B in {row.get('full_s')} s, adapters {row.get('adapter_bytes')} "
                      f"B in {row.get('adapter_s')} s: {row.get('adapter_over_full_bytes')} of the bytes")
        elif name == "vllm_sampler":
            figure = f"rc {row.get('rc')}, {row.get('step_s')} s/step"
        else:
            figure = f"{row.get('s')} s/update, {row.get('gbps')} GB/s" + (
                f" ({row['over_copy']} of the copy)" if row.get("over_copy") is not None else "")
        out.append(f"weights {name}: {figure}")
    return out


# -------------------------------------------------------------------------------------------------- decode
class Decoder:
    """The decode part's model, rows and clock: the demo set's first prompts, each a group's number of times."""

    def __init__(self, check: Check, pol: str, new_tokens: int):
        import torch

        from dschat.models.loading import create_causal_lm, load_tokenizer

        self.check, self.pol, self.new_tokens = check, pol, new_tokens
        self.dev = "cuda" if check.cuda else "cpu"
        self.dtype = torch.bfloat16 if check.cuda else torch.float32
        self.tok = load_tokenizer(pol)
        self.model = create_causal_lm(pol, self.dtype).to(self.dev).eval()  # sets dschat's SDPA policy
        texts = [json.loads(x)["prompt"] for x in open(prompts_file())][:check.size["prompts"]]
        enc = [e for e in (self.tok(t)["input_ids"] for t in texts) for _ in range(check.size["group"])]
        self.width = max(map(len, enc))
        pad = self.tok.pad_token_id
        self.ids = torch.tensor([[pad] * (self.width - len(e)) + e for e in enc], device=self.dev)
        starts = torch.tensor([self.width - len(e) for e in enc])
        self.mask = (torch.arange(self.width)[None, :] >= starts[:, None]).long().to(self.dev)
        self.parity_tokens = check.size["parity"]
        self.reference = self.generate(self.hf(), self.model, self.parity_tokens, greedy=True).sequences
        self.base = self.generate(self.eager(), self.model, self.parity_tokens, seed=7, logprobs=True)

    @staticmethod
    def hf() -> Any:
        from dschat.generation.decode import HFBackend

        return HFBackend()

    @staticmethod
    def eager(kind: str = "dschat", **kw: Any) -> Any:
        """dschat's loop with the step of ``kind``: ``dschat`` (eager), ``compiled`` or ``graph``."""
        from dschat.generation.decode import CompiledBackend, DschatBackend, GraphBackend

        return {"dschat": DschatBackend, "compiled": CompiledBackend, "graph": GraphBackend}[kind](**kw)

    def sync(self) -> None:
        import torch

        if self.check.cuda:
            torch.cuda.synchronize()

    def generate(self, backend: Any, m: Any, n: int, greedy: bool = False, seed: int = 0,
                 logprobs: bool = False) -> Any:
        import torch

        from dschat.generation.backends import generate
        from dschat.generation.decode import GenerationConfig, Prompts

        cfg = GenerationConfig(max_new_tokens=n, do_sample=not greedy, logprobs=logprobs)
        torch.manual_seed(seed)
        with torch.no_grad():
            return generate(backend, m, Prompts(self.ids, self.mask, self.tok.eos_token_id, self.tok.pad_token_id), cfg)

    def captures(self, backend: Any) -> int:
        graphs = getattr(backend, "graphs", None)
        return graphs.captures if graphs is not None else 0

    def timed(self, backend: Any, m: Any) -> dict[str, Any]:
        """A warm-up at the timed shape (the same rows and new tokens: kernels chosen, graphs captured, code
        compiled), then the timed run, which must capture nothing."""
        t = time.perf_counter()
        self.generate(backend, m, self.new_tokens)
        self.sync()
        warm_s = time.perf_counter() - t
        before = self.captures(backend)
        wall, cpu = time.perf_counter(), time.process_time()
        out = self.generate(backend, m, self.new_tokens)
        self.sync()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        steps = max(out.sequences.shape[1] - self.width, 1)
        return {"ms_per_step": round(1000 * wall / steps, 3), "cpu_ms_per_step": round(1000 * cpu / steps, 3),
                "steps": steps, "s": round(wall, 3), "warmup_s": round(warm_s, 3),
                "first_call_extra_s": round(warm_s - wall, 2), "captures_in_timed": self.captures(backend) - before}

    def parity(self, backend: Any, m: Any) -> dict[str, Any]:
        import torch

        from dschat.generation.decode import DschatBackend

        got = self.generate(backend, m, self.parity_tokens, greedy=True).sequences
        rows = [a == b for a, b in zip(got.tolist(), self.reference.tolist(), strict=True)]
        out: dict[str, Any] = {"greedy_rows_equal": round(sum(rows) / len(rows), 4)}
        if isinstance(backend, DschatBackend):
            sampled = self.generate(backend, m, self.parity_tokens, seed=7, logprobs=True)
            same = torch.equal(sampled.sequences, self.base.sequences)
            if sampled.logprobs is not None and same:
                out["logprob_max_diff_to_eager"] = float((sampled.logprobs - self.base.logprobs).abs().max())
            else:
                out["sampled_equal_to_eager"] = bool(same)
        return out

    def plain_model(self) -> Any:
        import transformers as T

        return T.AutoModelForCausalLM.from_pretrained(self.pol, dtype=self.dtype).to(self.dev).eval()

    def row(self, make: Any, which: Any) -> dict[str, Any]:
        backend, m = make(), which()
        try:
            row = self.timed(backend, m)
            row.update(self.parity(backend, m))
            if getattr(backend, "graphs", None) is not None:
                row.update(captures=backend.graphs.captures, capture_s=round(backend.graphs.capture_seconds, 3))
            return row
        finally:
            backend.close()


def compile_backends(d: Decoder) -> list[tuple[str, Any, Any, bool]]:
    """The compile-heavy variants (``--compile-variants``)."""
    import torch

    from dschat.generation import decode as D
    from dschat.generation.lean_llama import LeanLlama

    def default_compile() -> Any:
        D._compiled_step = None
        return d.eager("compiled")

    def reduce_overhead() -> Any:
        D._compiled_step = torch.compile(LeanLlama.step, mode="reduce-overhead")
        return d.eager("compiled")

    class HFStatic(D.HFBackend):
        """HF generate with its static cache, whose forward transformers compiles."""

        name = "hf_static"

        def generate(self, module: Any, prompt: Any, prompt_mask: Any, config: Any, eos: Any, pad: Any) -> Any:
            out = module.generate(prompt, attention_mask=prompt_mask, max_new_tokens=config.max_new_tokens,
                                  do_sample=config.do_sample, pad_token_id=pad, eos_token_id=eos, top_k=0,
                                  temperature=1.0, top_p=1.0, cache_implementation="static")
            return D.Generated(out)

    model = lambda: d.model
    return [("compiled", default_compile, model, False), ("lean_reduce_overhead", reduce_overhead, model, False),
            ("hf_static_compiled", HFStatic, model, False)]


def decode_backends(d: Decoder, compile_variants: bool) -> list[tuple[str, Any, Any, bool]]:
    """(name, backend maker, model maker, SDPA's cuDNN backend on), in order of value. The cuDNN rows come after
    the others: dschat's loader has turned it off for the process, and they turn it back on."""
    model = lambda: d.model
    out: list[tuple[str, Any, Any, bool]] = [("dschat", d.eager, model, False),
                                              ("graph", lambda: d.eager("graph"), model, False),
                                              ("hf", d.hf, model, False),
                                              ("dschat_growing", lambda: d.eager(constant_shapes=False), model, False),
                                              ("hf_plain", d.hf, d.plain_model, False)]
    if d.check.cuda:
        out += [("hf_sdpa_default", d.hf, model, True), ("hf_plain_sdpa_default", d.hf, d.plain_model, True)]
        from dschat.generation.vllm_engine import VLLMBackend, vllm_installed

        if vllm_installed():
            out.append(("vllm", VLLMBackend, model, False))
    if compile_variants:
        out += compile_backends(d)
    return out


def decode(check: Check) -> None:
    import torch

    from dschat import devices

    d = Decoder(check, str(check.work / "policy"), check.size["tokens"])
    res: dict[str, Any] = {"rows": len(d.ids), "prompt_width": d.width, "new_tokens": d.new_tokens}
    slowest = 0.0
    for name, make, which, cudnn in decode_backends(d, check.compile_variants):
        if check.left() < max(20.0, 1.2 * slowest):
            res.setdefault("skipped", []).append(name)
            continue
        if cudnn:
            torch.backends.cuda.enable_cudnn_sdp(True)
        else:
            devices.prefer_attention_kernels()
        t = time.time()
        try:
            res[name] = d.row(make, which)
        except Exception as e:  # one backend's failure is a row of the report, not the end of the part
            res[name] = {"error": error_text(e)}
        slowest = max(slowest, time.time() - t)
        print(f"decode {name}: {res[name]}", flush=True)
        check.save("decode", res)
    check.save("decode", res)


# ------------------------------------------------------------------------------------------ the parent run
def part_argv(args: argparse.Namespace, part: str, work: Path, deadline: float) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--part", part, "--out-dir", str(args.out_dir), "--work",
            str(work), "--deadline", f"{deadline:.1f}"]
    if args.smoke:
        argv.append("--smoke")
    if args.compile_variants:
        argv.append("--compile-variants")
    if args.inject_failure:
        argv += ["--inject-failure", args.inject_failure]
    return argv


def allowance(args: argparse.Namespace, part: str, t0: float) -> float:
    """Seconds ``part`` may take: its cap, within what is left of the budget (``big``: its own allowance)."""
    cap = SMOKE_CAP if args.smoke else CAPS[part]
    if part == "decode" and args.compile_variants:
        cap += COMPILE_EXTRA_S
    if part == "weights" and not args.smoke and gpu_count() > 1:
        cap += TWO_GPU_EXTRA_S
    if part == "big":
        return cap
    return min(cap, args.budget - (time.time() - t0))


def run_part(args: argparse.Namespace, part: str, work: Path, t0: float) -> dict[str, Any]:
    deadline = time.time() + allowance(args, part, t0)
    t = time.time()
    log = args.out_dir / "logs" / f"part-{part}.log"
    rc = run_logged(part_argv(args, part, work, deadline), log, deadline - time.time() + GRACE_S)
    row = {"rc": rc, "wall_s": round(time.time() - t, 1), "log": f"logs/part-{part}.log"}
    print(f"gpu_check: {part} rc {rc} in {row['wall_s']} s", flush=True)
    return row


FIGURES = {"grpo": {"dschat": "step_s", "trl": "step_s", "dschat_async": "step_s"},
           "stages": {"stage1": "steps", "stage2": "steps", "stage3_ppo": "steps"},
           "ppo": {"": "step_s"}, "big": {"lora": "steps", "zero3": "steps"}, "setup": {"": "policy_params"},
           "weights": {"copy": "gbps", "pack": "gbps", "update_gloo": "gbps", "update_nccl": "gbps",
                       "lora_adapter": "adapter_over_full_bytes", "vllm_sampler": "step_s"}}


def row_errors(path: str, node: Any) -> list[str]:
    """Every ``error`` and non-zero ``rc`` under ``node`` (a command's own ``json`` output is not looked into)."""
    if not isinstance(node, dict):
        return []
    out = [f"{path}: {node['error']}"] if "error" in node else []
    if isinstance(node.get("rc"), int) and node["rc"] != 0:
        out.append(f"{path}: exit code {node['rc']}")
    for key, value in node.items():
        if key != "json":
            out += row_errors(f"{path}.{key}", value)
    return out


def missing_figures(part: str, node: Any) -> list[str]:
    if not isinstance(node, dict):
        return [f"{part}: no result"]
    if part == "decode":
        rows = {k: v for k, v in node.items() if isinstance(v, dict)}
        out = [f"decode.{k}: no ms_per_step" for k, v in rows.items() if "error" not in v and "ms_per_step" not in v]
        out += [f"decode.{k}: {v['captures_in_timed']} captures in the timed run" for k, v in rows.items()
                if v.get("captures_in_timed")]
        return out + ([] if rows else ["decode: no backend measured"])
    out = []
    for key, figure in FIGURES.get(part, {}).items():
        row = node.get(key) if key else node
        if not isinstance(row, dict):
            out.append(f"{part}.{key}: no result")
        elif "skipped" not in row and "error" not in row and not row.get(figure):
            out.append(f"{part}{'.' + key if key else ''}: no {figure}")
    return out


def problems(report: dict[str, Any], parts: list[str], smoke: bool) -> list[str]:
    """What failed: a part's process, a row's error or exit code; with ``smoke`` also a part that did not run and
    a missing figure."""
    out: list[str] = []
    for part in parts:
        proc = report.get("parts", {}).get(part)
        if proc is None:
            if smoke:
                out.append(f"{part}: did not run")
            continue
        if proc["rc"] != 0:
            why = f": {report[f'error_{part}']}" if f"error_{part}" in report else ""
            out.append(f"{part}: its process exited {proc['rc']} ({proc['log']}){why}")
        out += row_errors(part, report.get(part))
        if smoke:
            out += missing_figures(part, report.get(part))
    return out


def summary(report: dict[str, Any]) -> list[str]:
    """The headline figures, one line each (the report has the rest)."""
    out = []
    grpo = report.get("grpo") or {}
    for key in [k for k in ("dschat", "trl") if k in grpo]:
        row = grpo[key]
        figure = f"skipped: {row['skipped']}" if "skipped" in row else f"{row.get('step_s')} s/step"
        out.append(f"grpo {key}: {figure}")
    if "dschat_over_trl" in grpo:
        out.append(f"grpo dschat/trl: {grpo['dschat_over_trl']}")
    if "lockstep_over_async" in grpo:
        out.append(f"grpo lockstep/async ({grpo['dschat_async']['sampler_devices']}): {grpo['lockstep_over_async']}")
    rows = [(name, row) for name, row in (report.get("stages") or {}).items()]
    rows += [(f"big {name}", row) for name, row in (report.get("big") or {}).items() if isinstance(row, dict)]
    for name, row in rows:
        out.append(f"{name}: rc {row.get('rc')}, {row.get('wall_s')} s, peak {row.get('peak_device_mib')} MiB")
    if isinstance(report.get("ppo"), dict):
        out.append(f"ppo: {report['ppo'].get('step_s')} s/step")
    if isinstance(report.get("weights"), dict):
        out += weights_lines(report["weights"])
    for name, row in (report.get("decode") or {}).items():
        if isinstance(row, dict):
            out.append(f"decode {name}: {row.get('ms_per_step', row.get('error'))} ms/step")
    return out


def run_all(args: argparse.Namespace) -> int:
    shutil.rmtree(args.out_dir / "logs", ignore_errors=True)  # a previous run's logs would read as this one's
    (args.out_dir / "logs").mkdir(parents=True)
    work = Path(tempfile.mkdtemp(prefix="dschat-gpu-check-"))
    parts = ["setup", *[p for p in args.parts.split(",") if p], *(["big"] if args.big else [])]
    t0 = time.time()
    (args.out_dir / REPORT).unlink(missing_ok=True)
    update_report(args.out_dir, started=t0, smoke=args.smoke, budget_s=args.budget, order=parts, parts={})
    try:
        for part in parts:
            report = read_report(args.out_dir)
            if part != "setup" and report["parts"].get("setup", {}).get("rc") != 0:
                update_report(args.out_dir, skipped=[*report.get("skipped", []), f"{part} (setup failed)"])
                continue
            if part != "setup" and allowance(args, part, t0) < MIN_PART_S:
                update_report(args.out_dir, skipped=[*report.get("skipped", []), f"{part} (budget)"])
                continue
            row = run_part(args, part, work, t0)
            report = read_report(args.out_dir)
            update_report(args.out_dir, parts={**report["parts"], part: row})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = read_report(args.out_dir)
    found = problems(report, parts, args.smoke)
    report = update_report(args.out_dir, problems=found, ok=not found)
    for line in summary(report):
        print(f"gpu_check: {line}")
    for line in found:
        print(f"gpu_check: FAILED {line}")
    print(f"gpu_check: report {args.out_dir / REPORT}, logs {args.out_dir / 'logs'}; "
          f"{'ok' if not found else f'{len(found)} problem(s)'} in {report['elapsed_s']} s")
    return 1 if found else 0


PART_FUNCS = {"setup": setup, "grpo": grpo, "stages": stages, "ppo": ppo, "weights": weights, "decode": decode,
              "big": big}


def run_one(args: argparse.Namespace) -> int:
    """One part, in this process (the parent starts one such process per part)."""
    if args.part == args.inject_failure:
        print(f"gpu_check: failure injected into {args.part}", flush=True)
        return 3
    check = Check(args.out_dir, Path(args.work), args.deadline, args.smoke, args.compile_variants)
    try:
        PART_FUNCS[args.part](check)
    except Exception as e:  # the report keeps what the part measured before
        update_report(args.out_dir, **{f"error_{args.part}": error_text(e)})
        raise
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", type=Path, default=Path("gpu_check_out"),
                    help="where gpu_check.json and logs/ go [gpu_check_out]")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, run in this order [{','.join(PARTS)}]")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for the parts (not --big) [450]")
    ap.add_argument("--big", action="store_true", help="add stage 2 on a Llama-2-7B-shaped model (minutes more)")
    ap.add_argument("--compile-variants", action="store_true",
                    help="add the compile-heavy decode backends (compiled, lean_reduce_overhead, hf_static_compiled)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and few tokens: the plumbing, on any machine")
    ap.add_argument("--inject-failure", metavar="PART", default="",
                    help="make PART's process fail at once (tests the exit status)")
    ap.add_argument("--part", choices=sorted(PART_FUNCS), help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--side", help=argparse.SUPPRESS)  # one side of a weights pair: its spec's JSON file
    args = ap.parse_args(argv)
    unknown = [p for p in args.parts.split(",") if p and p not in PARTS]
    if unknown:
        ap.error(f"unknown part {unknown[0]!r} (the parts: {', '.join(PARTS)})")
    args.out_dir = args.out_dir.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.side:
        weights_side(json.loads(Path(args.side).read_text()))
        return 0
    if args.part:
        return run_one(args)
    if not args.smoke and not cuda_elsewhere():
        print("gpu_check: no CUDA device here (use --smoke to check the script itself on a CPU)", file=sys.stderr)
        return 2
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
