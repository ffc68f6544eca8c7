"""What dschat does on a GPU's decode path, checked on a CPU:

* the attention policy (SDPA off its cuDNN backend) is applied by every model loader, so the commands that only
  sample or score (``dschat eval``, ``generate``, ``chat``, the judge, a served reward model) get it too;
* a seeded side computation (an evaluation's sampling, a judge's votes) forks the current CUDA device's random
  state with the CPU's, so training's CUDA stream does not replay after it;
* CUDA-graph captures are counted per generate phase, released (with their KV caches) when it ends, before
  scoring and training, made once per rollout whether or not ZeRO-3 moved the weights, logged per stage-3 step,
  and planned in the generate phase alone.

``CapturedStep`` runs eagerly off CUDA; its ``_capture`` is replaced by a fake that records what a capture would
have been made for, so the cache's logic (buckets, keys, counts, release) runs as on a GPU.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from click.testing import CliRunner

from dschat.generation import graphs as GR
from dschat.generation.decode import DschatBackend, GenerationConfig, GraphBackend
from dschat.generation.hybrid_engine import HybridEngine
from tests.dschat.test_generation import PAD, hf_greedy, model_of, prompts


# ------------------------------------------------------------------------------------------ attention policy
@pytest.fixture
def cudnn_sdp_on(monkeypatch):
    """cuDNN SDPA enabled (torch's default) for the test, whatever ran before it; the flag restored after."""
    monkeypatch.delenv("DSCHAT_CUDNN_ATTENTION", raising=False)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def _tiny() -> str:
    from dschat.models.loading import resolve_model

    return resolve_model("tiny")


def _load_for_eval_and_generate() -> None:  # dschat eval --step 3 and dschat generate: rlhf.engines.frozen_models
    from dschat.models.loading import load_tokenizer
    from dschat.rlhf.engines import frozen_models

    frozen_models(_tiny(), load_tokenizer(_tiny()), torch.float32)


def _load_reward_model() -> None:  # a reward model scored by dschat eval, served by dschat serve
    from dschat.models.loading import frozen_reward_model, load_tokenizer

    frozen_reward_model(_tiny(), torch.float32, load_tokenizer(_tiny()).pad_token_id)


def _load_judge() -> None:  # dschat judge, dschat eval --judge-model, the judge reward
    from dschat.rewards.judge import load_judge

    load_judge("tiny", "fp32", device=torch.device("cpu"))


def _chat() -> None:  # dschat chat, the whole command in this process
    from dschat.cli.chat import chat_command

    result = CliRunner().invoke(chat_command, ["--model", "tiny", "--prompt", "hi", "--max-new-tokens", "2",
                                               "--greedy", "--device", "cpu"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("load", [_load_for_eval_and_generate, _load_reward_model, _load_judge, _chat],
                         ids=["eval-generate", "reward-model", "judge", "chat"])
def test_every_loading_path_applies_the_attention_policy(load, cudnn_sdp_on):
    assert torch.backends.cuda.cudnn_sdp_enabled()
    load()
    assert not torch.backends.cuda.cudnn_sdp_enabled()


def test_the_attention_policy_can_be_declined(cudnn_sdp_on, monkeypatch):
    from dschat.devices import prefer_attention_kernels

    monkeypatch.setenv("DSCHAT_CUDNN_ATTENTION", "1")
    prefer_attention_kernels()
    assert torch.backends.cuda.cudnn_sdp_enabled()
    monkeypatch.delenv("DSCHAT_CUDNN_ATTENTION")
    prefer_attention_kernels()
    assert not torch.backends.cuda.cudnn_sdp_enabled()


# ------------------------------------------------------------------------------------------ random streams
SAMPLED = GenerationConfig(max_new_tokens=6, temperature=0.9)


def test_a_seeded_sample_leaves_the_cpu_stream_where_it_was():
    """Training's draws after a seeded evaluation are those it would have made without it; the evaluation's own
    draws depend on its seed alone."""
    model = model_of("llama")
    ids, mask = prompts()
    hybrid = HybridEngine(model, PAD, 1, backend=DschatBackend())
    torch.manual_seed(11)
    want = torch.rand(4)
    torch.manual_seed(11)
    first = hybrid.generate(ids, mask, SAMPLED, generator_seed=5)
    assert torch.equal(torch.rand(4), want)
    torch.manual_seed(99)
    assert torch.equal(hybrid.generate(ids, mask, SAMPLED, generator_seed=5), first)


def _on_cuda_device(monkeypatch, index: int) -> tuple[list, list]:
    """torch as if CUDA device ``index`` were current, for the rest of the test: ``fork_rng``'s devices and the
    CUDA seeds are recorded (the CPU's state is forked for real), nothing touches a device."""
    forks: list = []
    seeds: list = []
    real = torch.random.fork_rng

    @contextlib.contextmanager
    def fork_rng(devices=None, enabled=True, device_type=None, **kw):
        forks.append((list(devices) if devices is not None else None, device_type))
        with real(devices=[]):
            yield

    monkeypatch.setattr(torch.random, "fork_rng", fork_rng)
    monkeypatch.setattr(torch.cuda, "manual_seed", seeds.append)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: index)
    return forks, seeds


def test_a_seeded_sample_forks_the_current_cuda_device(monkeypatch):
    """On a GPU the evaluation's seed goes to the current device's generator too, and that generator's state is
    restored after (torch.random.fork_rng over the device), so rollouts after an evaluation do not replay one
    stream."""
    model = model_of("llama")
    ids, mask = prompts()
    hybrid = HybridEngine(model, PAD, 1, backend=DschatBackend())
    forks, seeds = _on_cuda_device(monkeypatch, 3)
    hybrid.generate(ids, mask, SAMPLED, generator_seed=5)
    assert forks == [([3], "cuda")] and seeds == [5]
    hybrid.generate(ids, mask, SAMPLED)  # an unseeded rollout draws from the run's streams: nothing forked
    assert len(forks) == 1


def test_a_judges_seeded_votes_fork_the_current_cuda_device(monkeypatch):
    from dschat.models.loading import load_tokenizer
    from dschat.rewards.judge import SamplingArgs, generate_completions

    model = model_of("llama")
    tok = load_tokenizer(_tiny())
    args = SamplingArgs(max_new_tokens=2, votes=2, batch_size=2, seed=40, backend="hf")
    forks, seeds = _on_cuda_device(monkeypatch, 1)
    generate_completions(model, tok, [[5, 6, 7], [8, 9, 10], [10, 11, 12]], args, progress=False)
    assert forks == [([1], "cuda")] and seeds == [40, 41]  # one fork around the call, a seed per batch


def test_forked_rng_on_a_cpu_forks_no_device():
    from dschat.devices import forked_rng

    torch.manual_seed(3)
    want = torch.rand(3)
    torch.manual_seed(3)
    with forked_rng(8):
        seeded = torch.rand(3)
    assert torch.equal(torch.rand(3), want)
    torch.manual_seed(8)
    assert torch.equal(torch.rand(3), seeded)


# ------------------------------------------------------------------------------------------ CUDA-graph captures
@pytest.fixture
def fake_capture(monkeypatch):
    """What each capture was made for, as a CUDA capture would record it; the step then runs eagerly."""
    made = []

    def capture(self, pool):
        made.append(tuple(self.dec.keys.shape))
        self.capture_seconds = 0.25

    monkeypatch.setattr(GR.CapturedStep, "_capture", capture)
    return made


GREEDY = GenerationConfig(max_new_tokens=8, do_sample=False)


def test_captures_are_counted_per_generate_phase_and_released_before_training(fake_capture, monkeypatch):
    """Two rollouts of one shape in a generate phase: one capture, then none; the count is reported once. The
    phase's release frees every capture and its KV cache (on CUDA the allocator's cache too), so the next phase
    captures again; a phase without generation reports zero."""
    model = model_of("llama")
    ids, mask = prompts()
    backend = GraphBackend(capture=True)
    hybrid = HybridEngine(model, PAD, 1, backend=backend)
    want = hf_greedy(model, ids, mask, 8, eos=1)
    counts = []
    for _ in range(2):  # two rollouts of one phase
        assert torch.equal(hybrid.generate(ids, mask, GREEDY), want)
        counts.append(hybrid.capture_metrics()["generation/graph_captures"])
    assert counts == [1.0, 0.0] and len(fake_capture) == 1 and len(backend.graphs.steps) == 1
    hybrid.release()
    assert not backend.graphs.steps and backend.graphs.pool is None  # nothing held past the phase
    assert torch.equal(hybrid.generate(ids[:2], mask[:2], GREEDY), want[:2])  # the next phase: same bucket
    assert len(fake_capture) == 2
    assert hybrid.sync_metrics() == {"generation/graph_captures": 1.0, "generation/graph_capture_s": 0.25}
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    hybrid.release()
    assert emptied == [1] and not backend.graphs.steps
    hybrid.release()
    assert emptied == [1]  # nothing held, nothing to give back
    assert hybrid.sync_metrics() == {"generation/graph_captures": 0.0, "generation/graph_capture_s": 0.0}


def test_a_backend_without_captures_reports_none():
    hybrid = HybridEngine(model_of("llama"), PAD, 1, backend=DschatBackend())
    hybrid.release()
    assert hybrid.sync_metrics() == {}


def test_weights_gathered_into_new_memory_cost_no_extra_capture_per_step(fake_capture):
    """A ZeRO-3 gather puts the weights in new memory at every generation call. A step's rollout captures once and
    is released, whether or not its weights moved; an evaluation's batches share one capture while the weights
    stay put and capture again for each batch whose weights moved (a capture is never replayed over memory the
    weights left). Every answer is HF generate's."""
    model = model_of("llama")
    ids, mask = prompts()
    want = hf_greedy(model, ids, mask, 8, eos=1)
    hybrid = HybridEngine(model, PAD, 1, backend=GraphBackend(capture=True))

    def moved() -> None:
        for p in model.parameters():
            p.data = p.data.clone()

    per_step = []
    for move in (False, True, True, False):  # training steps: one rollout each, released after it
        if move:
            moved()
        assert torch.equal(hybrid.generate(ids, mask, GREEDY), want)
        hybrid.release()
        per_step.append(hybrid.capture_metrics()["generation/graph_captures"])
    assert per_step == [1.0, 1.0, 1.0, 1.0]
    for moves in ((False, False, False), (True, True, True)):  # an evaluation's three batches
        for move in moves:
            if move:
                moved()
            assert torch.equal(hybrid.generate(ids, mask, GREEDY), want)
        hybrid.release()
        per_step.append(hybrid.capture_metrics()["generation/graph_captures"])
    assert per_step[4:] == [1.0, 3.0]


def test_zero3_steps_capture_once_each_and_answer_as_hf(fake_capture):
    """A ZeRO-3 actor (DeepSpeed's gathers, partitioned weights) through the graph backend: each step's rollout is
    one capture, released before the optimizer step; the answers are HF generate's on the gathered weights before
    and after the update."""
    import deepspeed
    from transformers import LlamaForCausalLM

    from dschat import engine as E
    from dschat.config import EngineArgs, OptimArgs
    from dschat.models.tiny import tiny_model_config

    E.setup_distributed()
    torch.manual_seed(0)
    # hidden 128: every matrix is over ZeRO-3's persistence threshold, so partitioned
    model = LlamaForCausalLM(tiny_model_config(num_hidden_layers=2, hidden_size=128, intermediate_size=256))
    eng = E.build_train_engine(model, engine=EngineArgs(zero_stage=3), optim=OptimArgs(
        learning_rate=1e-2, per_device_train_batch_size=2, num_warmup_steps=0), dtype=torch.float32, total_steps=2)
    backend = GraphBackend(capture=True)
    hybrid = HybridEngine(eng, pad_token_id=0, eos_token_id=2, backend=backend)
    ids = torch.randint(4, 100, (3, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    for _ in range(2):
        got = hybrid.generate(ids, mask, GenerationConfig(max_new_tokens=10, do_sample=False))
        hybrid.release()
        assert hybrid.sync_metrics()["generation/graph_captures"] == 1.0 and not backend.graphs.steps
        module = E.unwrap(eng)
        with deepspeed.zero.GatheredParameters(list(module.parameters())), torch.no_grad():
            want = module.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                                   eos_token_id=2)
        assert torch.equal(got, want)
        x = torch.randint(4, 100, (2, 8))
        eng.backward(eng(input_ids=x, labels=x).loss)
        eng.step()
    assert len(fake_capture) == 2


def test_stage3_logs_captures_per_step_and_trains_without_them(tmp_path, fake_capture, monkeypatch):
    """A GRPO run sampling through the graph backend: every step's row logs the captures its generation made (1:
    the previous one was released) and their seconds, the evaluations' captures being no step's; no capture is
    held while a step's rollouts are scored or the policy trains."""
    import dschat.generation.hybrid_engine as HE
    from dschat.config import build_config
    from dschat.demo import demo_files
    from dschat.rlhf.config import RLHFConfig
    from dschat.rlhf.grpo import GRPO
    from dschat.rlhf.scoring import Scorer
    from tests.helpers import read_jsonl
    from tests.helpers import run_stage as run

    backends: list[DschatBackend] = []

    def graph_backend(*args, **kwargs):
        backends.append(GraphBackend(capture=True))
        return backends[-1]

    held = []  # (where, captures held) at each scoring and each policy update
    score, update = Scorer.__call__, GRPO.update

    def spy_score(self, rollout, batch):
        held.append(("score", len(backends[0].graphs.steps)))
        return score(self, rollout, batch)

    def spy_update(self, batch):
        held.append(("train", len(backends[0].graphs.steps)))
        return update(self, batch)

    monkeypatch.setattr(HE, "make_backend", graph_backend)
    monkeypatch.setattr(Scorer, "__call__", spy_score)
    monkeypatch.setattr(GRPO, "update", spy_update)
    out = tmp_path / "grpo"
    run(build_config(RLHFConfig, {
        "algo": "grpo", "actor_model": "tiny", "data": [str(demo_files()["prompts"])], "output_dir": str(out),
        "max_steps": 2, "max_answer_seq_len": 12, "num_generations": 2, "per_device_generation_batch_size": 2,
        "per_device_training_batch_size": 2, "max_eval_rows": 4, "per_device_eval_batch_size": 4,
        "reward_funcs": ["format"], "dynamic_sampling": False, "progress": False, "force": True}))
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "train/actor_loss" in r]
    assert len(rows) == 2
    # an evaluation keeps its capture over its batches and their scores; a step scores and trains with none
    assert held == [("score", 1), ("score", 0), ("train", 0), ("score", 0), ("train", 0), ("score", 1)]
    assert [r["generation/graph_captures"] for r in rows] == [1.0, 1.0]
    assert [r["generation/graph_capture_s"] for r in rows] == [0.25, 0.25]
    assert len(fake_capture) == 4  # the evaluation before, each step, the evaluation after
    assert not backends[0].graphs.steps  # the last evaluation's capture went too


# ------------------------------------------------------------------------------------------ the plan
def _items(plan, phase: str) -> dict[str, int]:
    return {what: b for p in plan.phases if p.name == phase for _, what, b in p.items}


def test_the_plan_counts_graph_captures_in_the_generate_phase_alone():
    """Sampling through CUDA graphs (auto on a GPU, a Llama-architecture actor): the generate phase holds each
    capture's KV cache at its bucket's size (6 rows of 100 + 200 tokens: 8 x 384) and its token step; no other
    phase counts them, since they are released when the call ends; ZeRO-3 adds its gather, not another capture.
    With LoRA, on a CPU, with ``--generation-backend dschat``, DeepSpeed's hybrid engine or for another
    architecture the eager loop's exact cache is planned instead."""
    from dschat.planning import make_plan
    from dschat.planning.memory import kv_cache_bytes

    base = {"algo": "grpo", "actor_model": "llama-2-7b", "max_prompt_seq_len": 100, "max_answer_seq_len": 200,
            "num_generations": 3, "per_device_generation_batch_size": 2}
    plan = make_plan(3, base, suggest=False)
    shape, gen = plan.models[0].shape, _items(plan, "generate")
    assert gen["KV cache 8 x 384 tokens"] == kv_cache_bytes(shape, 8, 384, 2)
    assert 0 < gen["CUDA-graph token step"] < gen["KV cache 8 x 384 tokens"]
    for phase in plan.phases:
        if phase.name != "generate":
            assert not any("KV cache" in w or "CUDA-graph" in w for _, w, _ in phase.items), phase.name
    z3 = _items(make_plan(3, {**base, "actor_zero_stage": 3}, num_gpus=8, suggest=False), "generate")
    assert z3["KV cache 8 x 384 tokens"] == gen["KV cache 8 x 384 tokens"] and "weights gathered whole" in z3
    eager = [make_plan(3, {**base, **change}, suggest=False, **where) for change, where in (
        ({"actor_lora_dim": 8}, {}), ({}, {"gpu": "CPU"}), ({"generation_backend": "dschat"}, {}),
        ({"enable_hybrid_engine": True}, {}))]
    for p in eager:
        gen = _items(p, "generate")
        assert gen["KV cache 6 x 300 tokens"] == kv_cache_bytes(shape, 6, 300, p.models[0].sharding.dtype_bytes)
        assert not any("CUDA-graph" in w for w in gen)
    assert _items(make_plan(3, {**base, "generation_backend": "graph"}, suggest=False), "generate") == \
        _items(plan, "generate")
    assert not any("CUDA-graph" in w for w in _items(make_plan(3, {**base, "actor_model": "gemma-2-2b"},
                                                               suggest=False), "generate"))  # not a lean family


def test_remax_plans_one_capture_at_a_time():
    """ReMax's greedy call is released before its sampled call: the phase holds the larger capture alone."""
    from dschat.planning import make_plan

    values = {"algo": "remax", "actor_model": "llama-2-7b", "max_prompt_seq_len": 100, "max_answer_seq_len": 200,
              "num_generations": 4, "per_device_generation_batch_size": 3}
    gen = _items(make_plan(3, values, suggest=False), "generate")
    assert [w for w in gen if "KV cache" in w] == ["KV cache 16 x 384 tokens"]  # 12 sampled rows; not the 3 greedy


def test_the_planner_knows_the_graph_backend_as_it_is():
    from dschat.generation.lean_llama import LEAN_MODEL_TYPES
    from dschat.planning import plan as PL

    assert PL.GRAPH_MODEL_TYPES == LEAN_MODEL_TYPES
    assert (PL.GRAPH_BATCH_BUCKET, PL.GRAPH_WIDTH_BUCKET) == (GR.BATCH_BUCKET, GR.WIDTH_BUCKET)


def test_the_plan_counts_the_decoders_stacked_weights_on_a_gpu():
    """dschat's decoder on a GPU stacks each layer's q/k/v and gate/up weights for the call (up to 4 GiB): the
    generate phase counts exactly the bytes the decoder copies; not on a CPU, nor where the copy would be larger."""
    import transformers as T

    from dschat.generation.lean_llama import FUSE_COPY_BYTES, stacked_bytes
    from dschat.planning import make_plan
    from dschat.planning import plan as PL
    from dschat.planning.shapes import ModelShape

    assert PL.FUSE_COPY_BYTES == FUSE_COPY_BYTES
    cfg = T.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                        num_attention_heads=8, num_key_value_heads=2)
    model = T.LlamaForCausalLM(cfg)
    shape = ModelShape("t", "llama", 64, 3, 8, 2, 8, 96, 64, False)
    assert PL.stacked_weight_bytes(shape, 4) == stacked_bytes(model)
    base = {"algo": "grpo", "actor_model": "meta-llama/Llama-3.2-1B", "max_prompt_seq_len": 100,
            "max_answer_seq_len": 200, "num_generations": 3, "per_device_generation_batch_size": 2}
    gen = _items(make_plan(3, base, suggest=False), "generate")
    one_b = make_plan(3, base, suggest=False).models[0].shape
    assert gen["q/k/v and gate/up weights stacked"] == PL.stacked_weight_bytes(one_b, 2)
    assert "q/k/v and gate/up weights stacked" in _items(make_plan(3, {**base, "generation_backend": "dschat"},
                                                                   suggest=False), "generate")
    assert "q/k/v and gate/up weights stacked" not in _items(make_plan(3, base, gpu="CPU", suggest=False), "generate")
    big = _items(make_plan(3, {**base, "actor_model": "llama-2-7b"}, suggest=False), "generate")
    assert "q/k/v and gate/up weights stacked" not in big  # 7B's copy is over the cap: its decoder does not stack
