"""Memory per phase (dschat.training.memory) and out-of-memory handling (dschat.training.oom, oom_advice): the
meter's arithmetic on scripted probes, the CPU probe on this host, forwards split in halves giving the unsplit
results, and a training micro-batch out of memory stopping with exit 4, the planner's advice and a state that
--resume finishes."""

from __future__ import annotations

import pytest
import torch

from dschat.training import memory, oom, oom_advice
from dschat.training.memory import CudaProbe, MemoryMeter, MiB, RssProbe


class Scripted:
    """A probe whose current bytes the test sets; the peak follows them and a reset brings it to the current."""

    def __init__(self) -> None:
        self.now = self.top = 0

    def use(self, n: int) -> None:
        self.now = n
        self.top = max(self.top, n)

    def reset(self) -> None:
        self.top = self.now

    def read(self) -> dict[str, int]:
        return {"peak_rss": self.top}


def test_nested_phases_count_their_own_peaks() -> None:
    probe = Scripted()
    meter = MemoryMeter(probe)
    with meter.phase("experience"):
        probe.use(10 * MiB)
        with meter.phase("generate"):
            probe.use(50 * MiB)  # the KV cache
            probe.use(12 * MiB)  # freed at the end of generation
        probe.use(20 * MiB)  # the reference forward
        with meter.phase("experience"):  # the same phase again inside: part of the outer block
            probe.use(25 * MiB)
        probe.use(0)
    with meter.phase("train_actor"):
        probe.use(30 * MiB)
    # experience: its own peak (10 before generating, then 20 and 25 after), not generation's 50
    assert meter.take() == {"memory/experience_peak_rss_mib": 25.0, "memory/generate_peak_rss_mib": 50.0,
                            "memory/train_actor_peak_rss_mib": 30.0, "memory/oom_splits": 0.0}
    assert meter.take() == {}  # taken: nothing new
    with meter.phase("generate"):
        probe.use(40 * MiB)
    assert meter.take()["memory/generate_peak_rss_mib"] == 40.0  # since the last take
    assert meter.summary() == {"peak_mib": 50.0, "peak_figure": "peak_rss", "peak_phase": "generate",
                               "oom_splits": 0,
                               "phases": {"experience": {"peak_rss": 25.0}, "generate": {"peak_rss": 50.0},
                                          "train_actor": {"peak_rss": 30.0}}}


class FakeCuda:
    """``torch.cuda``'s memory calls over scripted figures."""

    def __init__(self) -> None:
        self.allocated = self.reserved = 0
        self.max_allocated = self.max_reserved = 0
        self.total, self.used_by_others = 80 * 1024 * MiB, 600 * MiB
        self.resets = 0

    def alloc(self, n: int, reserve: int) -> None:
        self.allocated, self.reserved = n, max(self.reserved, reserve)
        self.max_allocated, self.max_reserved = max(self.max_allocated, n), max(self.max_reserved, self.reserved)

    def reset_peak_memory_stats(self, device: object = None) -> None:
        self.resets += 1
        self.max_allocated, self.max_reserved = self.allocated, self.reserved

    def max_memory_allocated(self, device: object = None) -> int:
        return self.max_allocated

    def max_memory_reserved(self, device: object = None) -> int:
        return self.max_reserved

    def mem_get_info(self, device: object = None) -> tuple[int, int]:
        return self.total - self.reserved - self.used_by_others, self.total


def test_cuda_figures_reset_per_phase() -> None:
    cuda = FakeCuda()
    meter = MemoryMeter(CudaProbe(0, cuda))
    with meter.phase("generate"):
        cuda.alloc(3000 * MiB, 4096 * MiB)
        cuda.alloc(1000 * MiB, 4096 * MiB)
    with meter.phase("train_actor"):
        cuda.alloc(2000 * MiB, 5120 * MiB)
    figures = meter.take()
    # generate: allocated peaked at 3000, reserved 4096; the device's used total = reserved + other processes' 600
    assert figures["memory/generate_peak_allocated_mib"] == 3000.0
    assert figures["memory/generate_peak_reserved_mib"] == 4096.0
    assert figures["memory/generate_device_used_mib"] == 4696.0
    # train_actor's peaks start from the reset at its start (1000 allocated then), not generation's 3000
    assert figures["memory/train_actor_peak_allocated_mib"] == 2000.0
    assert figures["memory/train_actor_peak_reserved_mib"] == 5120.0
    assert cuda.resets == 4  # at each block's start and end
    assert meter.summary()["peak_figure"] == "device_used" and meter.summary()["peak_mib"] == 5720.0


def test_cpu_peak_rss_resets_per_phase_on_this_host() -> None:
    probe = RssProbe()
    meter = MemoryMeter(probe)
    with meter.phase("big"):
        block = bytearray(96 * MiB)
        block[:: 4096] = b"x" * len(block[:: 4096])  # touch every page
        del block
    with meter.phase("small"):
        pass
    figures = meter.take()
    assert probe.resettable, "/proc/self/clear_refs refused the reset on this host"
    assert figures["memory/big_peak_rss_mib"] - figures["memory/small_peak_rss_mib"] > 80


def test_split_on_oom_runs_halves_in_order_and_counts(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    memory.reset(Scripted())
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(oom, "INJECT", lambda site, n: site == "eval" and n > 2)  # any forward over 3+ rows

    def run(a: int, b: int) -> torch.Tensor:
        calls.append((a, b))
        return torch.arange(a, b) * 10

    out = oom.split_on_oom("eval", 7, run, torch.cat)
    assert out.tolist() == [0, 10, 20, 30, 40, 50, 60]  # the unsplit result
    assert calls == [(0, 1), (1, 3), (3, 5), (5, 7)]  # 7 -> 3 + 4 -> (1 + 2) + (2 + 2)
    assert memory.METER.oom_splits == 3 and memory.take()["memory/oom_splits"] == 3.0
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == "[memory] out of memory in eval over 7 rows: running halves of 3 and 4 rows " \
                       "(memory/oom_splits 1)" and len(lines) == 3
    with pytest.raises(torch.OutOfMemoryError):  # a collective forward is not split
        oom.split_on_oom("eval", 7, run, torch.cat, local=False)
    monkeypatch.setattr(oom, "INJECT", lambda site, n: True)
    with pytest.raises(torch.OutOfMemoryError):  # one row that does not fit: nothing left to split
        oom.split_on_oom("eval", 2, run, torch.cat)
    monkeypatch.setattr(oom, "INJECT", None)
    with pytest.raises(ValueError):  # any other error goes on at once
        oom.split_on_oom("eval", 4, lambda a, b: (_ for _ in ()).throw(ValueError("x")), torch.cat)


@pytest.fixture(scope="module")
def tiny_actor():
    from dschat import engine as E
    from dschat.models.loading import create_causal_lm, load_tokenizer, resolve_model

    E.setup_distributed()
    path = resolve_model("tiny")
    return create_causal_lm(path).eval(), load_tokenizer(path)


def _prompts(tok):
    texts = ["\n\nHuman: Where is my refund?\n\nAssistant:", "\n\nHuman: 2 + 3 =\n\nAssistant:",
             "\n\nHuman: Name a colour.\n\nAssistant:", "\n\nHuman: Hi\n\nAssistant:"]
    enc = [tok(t)["input_ids"] for t in texts]
    width = max(map(len, enc))
    prompt = torch.tensor([[tok.pad_token_id] * (width - len(e)) + e for e in enc])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(e) for e in enc])[:, None]).long()
    return {"prompt": prompt, "prompt_att_mask": mask}


def test_generation_oom_splits_and_greedy_answers_equal_the_unsplit(tiny_actor, monkeypatch) -> None:
    from dschat.generation.decode import GenerationConfig
    from dschat.generation.hybrid_engine import HybridEngine
    from dschat.rlhf.rollout import answer_logprobs, generate_rollout

    model, tok = tiny_actor
    hybrid = HybridEngine(model, tok.pad_token_id, tok.eos_token_id)
    batch, greedy = _prompts(tok), GenerationConfig(max_new_tokens=10, do_sample=False)
    memory.reset(Scripted())
    whole, dropped = generate_rollout(hybrid, tok, batch, greedy)
    monkeypatch.setattr(oom, "INJECT", lambda site, n: site == "generate" and n == 4)
    split, dropped_split = generate_rollout(hybrid, tok, batch, greedy)
    assert memory.METER.oom_splits == 1 and dropped_split == dropped
    for name in ("sequences", "attention_mask", "action_mask", "reached_eos"):
        assert torch.equal(getattr(split, name), getattr(whole, name)), name
    # sampled: each half draws afresh (the sampler's stream runs per batch), same rows and prompts
    sampled, _ = generate_rollout(hybrid, tok, batch, GenerationConfig(max_new_tokens=10, temperature=1.0), seed=3)
    assert sampled.sequences.shape[0] == 4 and memory.METER.oom_splits == 2
    assert torch.equal(sampled.sequences[:, : whole.prompt_len], batch["prompt"])

    # the experience forwards: without gradient a forward out of memory runs on halves, same log-probs
    monkeypatch.setattr(oom, "INJECT", None)
    with torch.no_grad():
        logps = answer_logprobs(model, whole)
    monkeypatch.setattr(oom, "INJECT", lambda site, n: site == "experience" and n == 4)
    with torch.no_grad():
        halves = answer_logprobs(model, whole)
    assert memory.METER.oom_splits == 3
    assert torch.allclose(halves, logps, atol=1e-6, rtol=0)
    trained = answer_logprobs(model, whole)  # with gradient (a training forward): never split, nothing injected
    assert trained.requires_grad and memory.METER.oom_splits == 3


def test_value_and_reward_forwards_split_give_the_same_values(tiny_actor, monkeypatch) -> None:
    from dschat.models.loading import create_reward_model, resolve_model
    from dschat.rlhf.rollout import answer_values, make_rollout
    from dschat.rlhf.scoring import score_rows

    _, tok = tiny_actor
    critic = create_reward_model(resolve_model("tiny"), pad_token_id=tok.pad_token_id).eval()
    batch = _prompts(tok)
    answers = torch.tensor([[5, 6, tok.eos_token_id], [7, 8, 9], [10, tok.eos_token_id, 0], [11, 12, 13]])
    rollout, _ = make_rollout(batch["prompt"], batch["prompt_att_mask"], torch.cat([batch["prompt"], answers], 1),
                              tok.eos_token_id, tok.pad_token_id)
    memory.reset(Scripted())
    with torch.no_grad():
        values = answer_values(critic, rollout)
        rows = [list(range(3, 3 + n)) for n in (5, 9, 7, 6)]
        scores = score_rows(critic, rows, tok.pad_token_id)
    monkeypatch.setattr(oom, "INJECT", lambda site, n: site in ("experience", "score") and n > 1)
    with torch.no_grad():
        assert torch.allclose(answer_values(critic, rollout), values, atol=1e-6, rtol=0)
        assert torch.equal(score_rows(critic, rows, tok.pad_token_id), scores)  # a row scores alone anyway
    assert memory.METER.oom_splits > 0


@pytest.mark.slow
def test_training_oom_stops_with_exit_4_one_line_and_a_state_resume_finishes(tmp_path, monkeypatch, capsys) -> None:
    from dschat.cli.options import run_command
    from dschat.cli.train import stage_module
    from tests.helpers import read_json

    out = tmp_path / "s1"
    argv = ["--model", "tiny", "--output-dir", str(out), "--max-steps", "3", "--max-eval-rows", "4",
            "--per-device-train-batch-size", "4", "--no-progress"]
    seen = {"train train": 0}

    def inject(site: str, n: int) -> bool:
        if site == "train train":
            seen[site] += 1
            return seen[site] == 3  # the first micro-batch of step 3
        return False

    monkeypatch.setattr(oom, "INJECT", inject)
    with pytest.raises(SystemExit) as stopped:
        run_command(stage_module(1).command, argv)
    assert stopped.value.code == 4
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dschat:")]
    assert len(err) == 1, err
    line = err[0]
    assert line.startswith("dschat: error: out of memory in stage 1, phase train, micro-batch 1: the plan's peak ")
    assert "kept the state of step 2" in line and "continue with --resume" in line
    assert not (out / "eval.json").exists() and (out / "checkpoints" / "latest").exists()

    monkeypatch.setattr(oom, "INJECT", None)
    run_command(stage_module(1).command, [*argv, "--resume"])  # returns: no exit code but 0
    assert "resumed from" in capsys.readouterr().err
    ev = read_json(out / "eval.json")
    assert ev["steps"] == 3 and ev["memory"]["phases"]["train"]["peak_rss"] > 0


def test_the_report_draws_the_memory_figures(tmp_path) -> None:
    import json

    from dschat.training.report import write_report

    run = tmp_path / "grpo"
    run.mkdir()
    rows = [{"step": s, "train/actor_loss": 0.1 * s, "memory/generate_peak_rss_mib": 700.0 + s,
             "memory/experience_peak_rss_mib": 650.0, "memory/train_actor_peak_rss_mib": 720.0 + 2 * s,
             "memory/oom_splits": 0.0} for s in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_report([run])
    png = run / "report" / "memory.png"
    assert png.is_file() and png.stat().st_size > 8000
    # a run without memory figures draws no memory plot
    other = tmp_path / "old"
    other.mkdir()
    (other / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/loss": 1.0}) + "\n")
    write_report([other])
    assert not (other / "report" / "memory.png").exists()


# Every stage and algorithm on the tiny preset, one or two steps: the memory figures of each of its phases in
# metrics.jsonl and eval.json, and (stage 3) the rows its step() sampled against what its spec tells the planner.
STAGE3_ALGOS = ("ppo", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax", "online_dpo", "dpo")
PHASES = {1: {"train", "eval"}, 2: {"train", "eval"}, "ppo": {"generate", "experience", "train_actor", "train_critic"},
          "dpo": {"experience", "train_actor", "eval"}}


@pytest.mark.slow
@pytest.mark.parametrize("run_of", [1, 2, *STAGE3_ALGOS])
def test_every_stage_and_algorithm_logs_its_memory_figures(tmp_path, monkeypatch, run_of) -> None:
    from dschat.config import RewardConfig, SFTConfig, build_config
    from dschat.generation.hybrid_engine import HybridEngine
    from dschat.rlhf.config import RLHFConfig
    from tests.helpers import read_json, read_jsonl
    from tests.helpers import run_stage as run

    out = tmp_path / str(run_of)
    common = {"output_dir": str(out), "max_steps": 2, "progress": False, "force": True, "max_eval_rows": 2,
              "per_device_eval_batch_size": 2}
    sampled: list[tuple[bool, int]] = []  # (inside a training step, rows) of each generation call
    in_step = [False]
    if run_of == 1:
        cfg = build_config(SFTConfig, {"model": "tiny", "per_device_train_batch_size": 4, **common})
    elif run_of == 2:
        cfg = build_config(RewardConfig, {"model": "tiny", "per_device_train_batch_size": 2, **common})
    else:
        values = {"algo": run_of, "actor_model": "tiny", "max_answer_seq_len": 6, "per_device_train_batch_size": 2,
                  **common}
        if run_of == "ppo":
            values.update(reward_model="tiny", per_device_generation_batch_size=2)
        elif run_of != "dpo":
            values.update(num_generations=3, per_device_generation_batch_size=2)
        cfg = build_config(RLHFConfig, values)
        algo = cfg.algorithm.load()
        step = algo.step

        def spied_step(self, stream):
            in_step[0] = True
            try:
                return step(self, stream)
            finally:
                in_step[0] = False

        monkeypatch.setattr(algo, "step", spied_step)
        sample = HybridEngine.sample

        def spied_sample(self, prompt, *args, **kwargs):
            sampled.append((in_step[0], prompt.shape[0]))
            return sample(self, prompt, *args, **kwargs)

        monkeypatch.setattr(HybridEngine, "sample", spied_sample)
    run(cfg)
    rows = read_jsonl(out / "metrics.jsonl")
    phases = PHASES.get(run_of, {"generate", "experience", "train_actor"})
    # a step's row (online DPO's untrained tiny actor may tie every group, so a step may have no loss)
    trained = [r for r in rows if any(k.startswith("train/") for k in r)]
    assert trained, rows
    figure = "peak_rss" if not torch.cuda.is_available() else "peak_allocated"
    once = {"experience"} if run_of == "dpo" else set()  # DPO's reference log-probs: once, before its first step
    for name in phases - {"eval"}:
        seen = [f"memory/{name}_{figure}_mib" in r for r in trained]
        assert (any(seen) if name in once else all(seen)), (name, trained[0])
    assert all(r["memory/oom_splits"] == 0 for r in trained)
    memory_of = read_json(out / "eval.json")["memory"]
    assert phases | {"eval"} <= set(memory_of["phases"]) and memory_of["peak_mib"] > 0
    if run_of in (1, 2):
        return
    # what a training step sampled, against the spec the planner reads (dschat.rlhf.specs)
    spec, prompts = cfg.algorithm, cfg.rl.per_device_generation_batch_size
    in_training = [n for inside, n in sampled if inside]
    assert sum(in_training) == 2 * prompts * spec.sampled_per_prompt(cfg)  # two steps
    assert max(in_training, default=0) == spec.generation_rows(cfg)


def test_the_stop_line_names_the_plan_and_the_flags_it_says_would_fit(monkeypatch, tmp_path) -> None:
    from dschat.planning import make_plan
    from dschat.planning.gpus import GiB

    monkeypatch.setattr(oom_advice, "device_memory", lambda: ("A100-80GB", 24 * GiB))
    values = {"model": "llama-2-7b", "zero_stage": 0}
    advisor = oom_advice.Advisor.for_stage("step1_sft", values, tmp_path, 1)
    memory.reset(Scripted())
    line = advisor.stop_line("train", 3, RuntimeError("CUDA out of memory. Tried to allocate 1.00 GiB"), "kept X")
    plan = make_plan(1, values, gpu="A100-80GB", gpu_memory=24 * GiB)
    assert not plan.fits and plan.suggestion
    assert line == (f"out of memory in stage 1, phase train, micro-batch 3: the plan's peak "
                    f"{plan.peak_bytes / GiB:.2f} GiB per device of 24.00 GiB; it says this fits: "
                    f"{plan.suggestion}; kept X")
    # a plan that says "fits" under-counted this run: the flags that fit in memory shrunk by the overshoot
    small = {"model": "opt-125m", "zero_stage": 0}
    advisor = oom_advice.Advisor.for_stage("step1_sft", small, tmp_path, 1)
    fits = make_plan(1, small, gpu="A100-80GB", gpu_memory=24 * GiB)
    assert fits.fits
    line = advisor.stop_line("train", 1, RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB"), "kept X")
    scaled = make_plan(1, small, gpu="A100-80GB", gpu_memory=int(24 * GiB * fits.peak_bytes / (44 * GiB)))
    assert f"it says this fits: {scaled.suggestion}" in line and scaled.suggestion


def test_the_device_a_driver_names_is_found_in_the_planners_table() -> None:
    from dschat.planning.gpus import DEFAULT_GPU, gpu_of_device

    assert gpu_of_device("NVIDIA H100 80GB HBM3") == "H100-80GB"
    assert gpu_of_device("NVIDIA L40S") == "L40S" and gpu_of_device("NVIDIA L4") == "L4"
    assert gpu_of_device("NVIDIA GeForce RTX 4090") == "RTX 4090"
    assert gpu_of_device("Some Future GPU") == DEFAULT_GPU
