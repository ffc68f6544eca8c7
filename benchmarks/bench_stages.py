"""Every stage against its bare ceiling, and against TRL when it is installed, on one fixed local workload.

Each row trains the same model on the same data three ways, each in a fresh process:

* ``dschat``: ``dschat train --step N`` (its CLI, as a user runs it), timed from its ``metrics.jsonl``;
* ``ceiling``: a bare PyTorch loop (HF model, forward + backward + ``torch.optim.AdamW``) on the very batches
  dschat's loader yields (dschat's data functions build them in-process), plus bare HF ``generate`` for the
  sampling rows: what any framework could reach on this workload;
* ``trl`` (``--trl``): TRL's trainer for that stage (RewardTrainer, DPOTrainer, GRPOTrainer), when ``import trl``
  works in ``--trl-python`` (default: this interpreter). TRL is never a dependency of dschat.

Rows (``--only``): ``sft`` and ``sft-packed`` (``--packing``), ``rm`` (reward model), ``dpo`` (``--algo dpo``),
``grpo`` (2 prompts x 4 completions, 64 new tokens), ``ppo`` (8 prompts, 64 new tokens, 4 PPO epochs).
The workload (built once under ``--work``, no Hub): the demo tokenizer dschat ships, a seeded 4-layer Llama
(hidden 256), a reward/critic model from the same config, 512 demo
preference rows and 512 demo prompts. fp32, constant learning rate, no gradient checkpointing, no evaluation.

Timing: 2 warm-up steps, then ``--steps`` timed steps (default per row); the window runs from the end of the last
warm-up step to the end of the last timed step, so start-up, tokenisation, model loading and saving are outside
it. Throughput is the row's unit per second (SFT rows, pairs, completions, episodes). ``--rounds N`` runs every
selected row's sides back to back per round, in alternating order; the table gives the median over rounds of
each side's throughput and the median of the per-round ratios (a busy machine slows the sides of one round
alike, so ratios are the robust figure).

    python benchmarks/bench_stages.py --quick                        # smoke: every row, 1 round, 2 timed steps
    python benchmarks/bench_stages.py --rounds 3 --threads 2 --out results.json
    python benchmarks/bench_stages.py --only grpo ppo --rounds 5
    python benchmarks/bench_stages.py --trl --trl-python /path/to/trl-venv/bin/python

This module imports only the standard library at the top: ``dschat train --reward-funcs`` loads
``bench_reward`` from it, and the TRL rows run it under an interpreter without dschat.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 2  # steps excluded from the timed window (first-step allocations, DPO's reference pass)
SEED = 1234
WORKLOAD_VERSION = 1


@dataclass(frozen=True)
class Shape:
    """The per-step work of the rows; dschat's flags and the ceilings are built from the same values."""

    batch: int = 8  # SFT rows (padded) or packed sequences, pairs (rm, dpo), episodes (ppo) per step
    grpo_prompts: int = 2  # GRPO prompts per step, each with `generations` completions
    generations: int = 4
    new_tokens: int = 64
    ppo_epochs: int = 4
    max_seq_len: int = 256
    max_prompt_len: int = 128
    lr: float = 1e-5


@dataclass(frozen=True)
class Row:
    stage: int
    unit: str
    steps: int  # default timed steps
    trl: str | None  # TRL's trainer for the row, if any
    setting: str


ROWS: dict[str, Row] = {
    "sft": Row(1, "sequences", 20, None, "stage 1, 8 padded rows per step (prompt + chosen), max_seq_len 256"),
    "sft-packed": Row(1, "sequences", 20, None, "stage 1 --packing: 8 packed sequences of <= 256 tokens per step "
                                                "(about 2 rows each); throughput counts rows"),
    "rm": Row(2, "pairs", 30, "RewardTrainer", "stage 2, 8 pairs per step, --rm-loss last-token (the loss "
                                               "of the ceiling and of RewardTrainer), clip 1.0"),
    "dpo": Row(3, "pairs", 20, "DPOTrainer", "--algo dpo, 8 pairs per step, sigmoid, beta 0.1, reference log-probs "
                                             "precomputed (TRL: reference forward per step, its default)"),
    "grpo": Row(3, "completions", 15, "GRPOTrainer", "--algo grpo, 2 prompts x 4 completions, 64 new tokens, "
                                                     "temperature 1, beta 0, loss dapo, mu 1, rule reward"),
    "ppo": Row(3, "episodes", 5, None, "--algo ppo, 8 prompts, 64 new tokens, temperature 0.7, 4 PPO epochs of "
                                       "actor + critic, reference and reward model forwards"),
}


# Rows whose ceiling computes dschat's own loss on the same batches from the same weights with the same optimizer:
# their per-step losses agree, which checks that both sides train on the same data (rm's ceiling scores with its own
# sequence-classification head, and the sampling rows draw different samples).
SAME_LOSS = ("sft", "sft-packed", "dpo")


# ------------------------------------------------------------------------------------------------ reward rule
KEYWORDS = ("<think>", "<answer>", "退款", "发票", "优惠", "refund", "invoice", "coupon", "order", "sorry")


def bench_reward(prompts: list[str], completions: list[str], **row_fields: Any) -> list[float]:
    """The GRPO rows' rule reward (dschat's ``--reward-funcs`` signature; TRL calls it with keywords): up to two
    points for keywords, minus the distance from a 40-character answer in units of 40 characters."""
    return [min(2, sum(k in c for k in KEYWORDS)) - abs(len(c) - 40) / 40.0 for c in completions]


# ------------------------------------------------------------------------------------------------ workload
def _sha(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def build_workload(work: str | Path, hidden: int = 256, intermediate: int = 704, layers: int = 4, heads: int = 4,
                   pairs: int = 512, prompts: int = 512) -> dict[str, Any]:
    """The fixed workload, built once into ``work/workload-<digest>`` (the digest covers the sizes, the shipped
    tokenizer and the demo corpus generator): ``policy/`` (a seeded Llama causal LM with the demo tokenizer),
    ``reward/`` (a seeded ``LlamaForSequenceClassification`` of the same config, one label: a saved reward
    model, also the critic's start), ``pairwise.jsonl`` (demo preference rows) and ``prompts.jsonl`` (demo
    prompts). Returns the manifest (paths, sizes, parameter counts)."""
    import torch
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    from dschat.demo import corpus
    from dschat.models.loading import load_tokenizer
    from dschat.models.tiny import TOKENIZER_MODEL_PATH, save_tiny_tokenizer, tiny_model_config
    from dschat.utils import atomic_dir, write_jsonl

    sizes = {"hidden": hidden, "intermediate": intermediate, "layers": layers, "heads": heads, "pairs": pairs,
             "prompts": prompts}
    key = json.dumps([WORKLOAD_VERSION, sizes, _sha(TOKENIZER_MODEL_PATH), _sha(corpus.__file__)], sort_keys=True)
    folder = Path(work).resolve() / f"workload-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    manifest = folder / "manifest.json"
    if manifest.exists():
        return json.loads(manifest.read_text())
    rng = torch.random.get_rng_state()
    with atomic_dir(folder, replace=False) as tmp:
        save_tiny_tokenizer(tmp / "policy")
        tok = load_tokenizer(str(tmp / "policy"))
        config = tiny_model_config(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id,
                                   num_hidden_layers=layers, hidden_size=hidden, intermediate_size=intermediate,
                                   num_attention_heads=heads)
        torch.manual_seed(SEED)
        policy = LlamaForCausalLM(config)
        policy.save_pretrained(tmp / "policy")
        config.num_labels = 1
        torch.manual_seed(SEED + 1)
        reward = LlamaForSequenceClassification(config)
        save_tiny_tokenizer(tmp / "reward")
        reward.save_pretrained(tmp / "reward")
        write_jsonl(corpus.generate_pairwise(pairs, seed=0), tmp / "pairwise.jsonl")
        write_jsonl(corpus.generate_prompts(prompts, seed=0), tmp / "prompts.jsonl")
        info = {"folder": str(folder), "policy": str(folder / "policy"), "reward": str(folder / "reward"),
                "pairwise": str(folder / "pairwise.jsonl"), "prompts": str(folder / "prompts.jsonl"),
                "data_cache": str(folder / "data_cache"), "sizes": sizes, "vocab": len(tok),
                "policy_params": sum(p.numel() for p in policy.parameters()),
                "reward_params": sum(p.numel() for p in reward.parameters()), "seed": SEED}
        (tmp / "manifest.json").write_text(json.dumps(info, indent=1))
    torch.random.set_rng_state(rng)
    return json.loads(manifest.read_text())


# ------------------------------------------------------------------------------------------------ dschat side
def dschat_flags(row: str, wl: dict[str, Any], shape: Shape, steps: int, out: Path) -> list[str]:
    """``dschat train`` arguments of a row: the benchmark's common settings (fp32, no gradient checkpointing,
    constant learning rate, no evaluation or saving during the run, a metrics row per step)."""
    s = shape
    common = ["--dtype", "fp32", "--seed", str(SEED), "--max-seq-len", str(s.max_seq_len), "--eval-fraction", "0",
              "--eval-interval", "0", "--log-interval", "1", "--save-interval", "0", "--no-save-final-state",
              "--no-progress", "--force", "--data-cache-dir", wl["data_cache"], "--output-dir", str(out),
              "--max-steps", str(WARMUP + steps), "--lr-scheduler-type", "constant", "--num-warmup-steps", "0",
              "--gradient-accumulation-steps", "1"]
    one_model = ["--no-gradient-checkpointing", "--per-device-train-batch-size", str(s.batch), "--learning-rate",
                 str(s.lr), "--weight-decay", "0"]
    if row in ("sft", "sft-packed"):
        return ["--step", "1", "--model", wl["policy"], "--data", wl["pairwise"], "--data-split", "10,0,0",
                *one_model, "--max-grad-norm", "0", *(["--packing"] if row == "sft-packed" else []), *common]
    if row == "rm":
        return ["--step", "2", "--model", wl["reward"], "--data", wl["pairwise"], "--data-split", "0,10,0",
                *one_model, "--max-grad-norm", "1.0", "--rm-loss", "last-token", *common]
    actor = ["--actor-model", wl["policy"], "--no-actor-gradient-checkpointing", "--actor-learning-rate", str(s.lr),
             "--max-grad-norm", "1.0", "--data-split", "0,0,10"]
    if row == "dpo":
        return ["--step", "3", "--algo", "dpo", *actor, "--data", wl["pairwise"], "--dpo-loss-type", "sigmoid",
                "--dpo-beta", "0.1", "--per-device-training-batch-size", str(s.batch), *common]
    sampling = ["--data", wl["prompts"], "--max-answer-seq-len", str(s.new_tokens), "--max-prompt-seq-len",
                str(s.max_prompt_len), "--top-p", "1.0", "--top-k", "0"]
    if row == "grpo":
        # TRL's GRPOConfig defaults (loss dapo without dynamic sampling or overlong penalty, epsilon 0.2 both
        # ways, group scaling), so the TRL row does the same work
        return ["--step", "3", "--algo", "grpo", *actor, *sampling, "--temperature", "1.0", "--reward-funcs",
                f"{Path(__file__).resolve()}:bench_reward", "--beta", "0", "--num-generations", str(s.generations),
                "--per-device-generation-batch-size", str(s.grpo_prompts), "--per-device-training-batch-size",
                str(s.grpo_prompts * s.generations), "--num-iterations", "1", "--loss-type", "dapo",
                "--no-dynamic-sampling", "--no-overlong-penalty", "--epsilon", "0.2", "--epsilon-high", "0.2",
                "--scale-rewards", "group", "--no-mask-truncated-completions", *common]
    if row == "ppo":
        return ["--step", "3", "--algo", "ppo", *actor, *sampling, "--temperature", "0.7", "--reward-model",
                wl["reward"], "--critic-model", wl["reward"], "--no-critic-gradient-checkpointing",
                "--critic-learning-rate", str(s.lr), "--per-device-generation-batch-size", str(s.batch),
                "--per-device-training-batch-size", str(s.batch), "--generation-batches", "1", "--ppo-epochs",
                str(s.ppo_epochs), "--kl-ctl", "0.05", "--gamma", "1.0", "--lam", "0.95", "--cliprange", "0.2",
                "--cliprange-value", "0.2", "--whiten-advantages", *common]
    raise KeyError(row)


def step_times(metrics_jsonl: Path) -> tuple[dict[int, float], dict[int, float | None]]:
    """Training steps' ``time`` stamps (seconds since the run's tracker started) and losses from
    ``metrics.jsonl``; evaluation rows (``eval/`` keys) are skipped."""
    times: dict[int, float] = {}
    losses: dict[int, float | None] = {}
    for line in metrics_jsonl.read_text(encoding="utf-8").splitlines():
        r = json.loads(line) if line.strip() else {}
        if r and not any(k.startswith("eval/") for k in r):
            times[int(r["step"])] = float(r["time"])
            losses[int(r["step"])] = r.get("train/loss", r.get("train/actor_loss"))
    return times, losses


def window(ends: list[float], steps: int) -> dict[str, Any]:
    """The timed window of end-of-step times ``ends`` (warm-up steps first)."""
    if len(ends) < WARMUP + steps:
        raise RuntimeError(f"{len(ends)} steps recorded, {WARMUP + steps} needed")
    return {"wall_s": ends[WARMUP + steps - 1] - ends[WARMUP - 1], "steps": steps,
            "step_s": [round(ends[i] - ends[i - 1], 4) for i in range(WARMUP, WARMUP + steps)]}


# ------------------------------------------------------------------------------------------------ ceilings
def _device() -> Any:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _phase_rows(wl: dict[str, Any], shape: Shape, phase: int, file: str, tok: Any, packing: bool = False,
                tokenize_as: int | None = None) -> tuple[list[Any], Any]:
    """Training rows of ``phase`` exactly as the dschat row tokenises them (same flags, same data cache)."""
    from dschat.config import DataArgs
    from dschat.data import load_phase

    data = DataArgs(data=[wl[file]], data_split={1: "10,0,0", 2: "0,10,0", 3: "0,0,10"}[phase],
                    data_cache_dir=wl["data_cache"], max_seq_len=shape.max_seq_len,
                    max_prompt_seq_len=shape.max_prompt_len, eval_fraction=0.0, packing=packing)
    return load_phase(data, phase, tok, SEED, log=lambda _: None, tokenize_as=tokenize_as).train, data


def loader_batches(rows: list[Any], batch_size: int, collator: Any, data: Any, n: int) -> list[tuple[Any, int]]:
    """The first ``n`` batches dschat's training loader yields (``dschat.training.stage.training_loader``, epoch after
    epoch, as its ``EpochStream``), each with the number of dataset rows in it (packs count their rows)."""
    from dschat.data.packing import unpacked_rows
    from dschat.training.stage import training_loader

    loader = training_loader(rows, batch_size, collator, SEED, data)
    out: list[tuple[Any, int]] = []
    epoch = 0
    while len(out) < n:
        loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        for idx in loader.batch_sampler:  # what iterating the loader does (no workers): indices, then collate
            items = [loader.dataset[i] for i in idx]
            out.append((loader.collate_fn(items), len(unpacked_rows(items))))
            if len(out) == n:
                break
        epoch += 1
    return out


def _to(batch: Any, dev: Any) -> Any:
    return {k: v.to(dev) if hasattr(v, "to") else v for k, v in batch.items()}


def _adamw(model: Any, lr: float) -> Any:
    import torch

    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)


def _update(loss: Any, model: Any, opt: Any, clip: float) -> float:
    import torch

    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.item())


def _lm(path: str, dev: Any, train: bool = True) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(dev)
    return model.train() if train else model.eval().requires_grad_(False)


def _scorer(path: str, pad: int, dev: Any, train: bool = True) -> Any:
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32).to(dev)
    model.config.pad_token_id = pad
    return model.train() if train else model.eval().requires_grad_(False)


def _positions(mask: Any) -> Any:
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def _token_logprobs(model: Any, ids: Any, mask: Any, temperature: float = 1.0) -> Any:
    """Log-probs ``(B, T-1)`` of tokens 1.. of ``ids`` ``(B, T)`` given the ones before."""
    logits = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), use_cache=False).logits
    logits = logits[:, :-1].float() / temperature
    return logits.log_softmax(-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def _sample(model: Any, tok: Any, prompt: Any, prompt_mask: Any, new_tokens: int, temperature: float) -> tuple:
    """Bare HF ``generate`` (KV cache, sampling) of left-padded prompts; returns sequences ``(B, P + A)``, their
    attention mask and the answers' mask ``(B, A)`` (up to and including the first EOS)."""
    import torch

    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=prompt, attention_mask=prompt_mask, do_sample=True, temperature=temperature,
                             top_k=0, top_p=1.0, max_new_tokens=new_tokens, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)
    model.train()
    answer = out[:, prompt.shape[1]:]
    is_eos = (answer == tok.eos_token_id).long()
    action_mask = ((is_eos.cumsum(-1) - is_eos) == 0).long()  # (B, A)
    answer = answer.masked_fill(action_mask == 0, tok.pad_token_id)
    return torch.cat([prompt, answer], 1), torch.cat([prompt_mask.long(), action_mask], 1), action_mask


def _texts(tok: Any, seq: Any, action_mask: Any, prompt_len: int) -> list[str]:
    return tok.batch_decode([s[prompt_len:][m.bool()] for s, m in zip(seq.cpu(), action_mask.cpu(), strict=True)],
                            skip_special_tokens=True)


Step = Callable[[Any], float]


def ceiling(row: str, wl: dict[str, Any], shape: Shape, n: int) -> tuple[list[tuple[Any, int]], Step]:
    """The bare ceiling of ``row``: its first ``n`` batches (each with its units: SFT rows, pairs, completions or
    episodes) and the step that trains on one (returns the loss)."""
    import torch
    import torch.nn.functional as F

    from dschat.models.loading import load_tokenizer

    dev, s = _device(), shape
    tok = load_tokenizer(wl["policy"])
    pad = tok.pad_token_id
    if row in ("sft", "sft-packed"):
        from dschat.data import DataCollatorSFT
        from dschat.data.packing import sft_inputs

        rows, data = _phase_rows(wl, s, 1, "pairwise", tok, packing=row == "sft-packed")
        batches = loader_batches(rows, s.batch, DataCollatorSFT(pad), data, n)
        model = _lm(wl["policy"], dev)
        opt = _adamw(model, s.lr)

        def sft_step(b: Any) -> float:  # HF's causal-LM loss; packed batches get position ids and a block mask
            inputs = sft_inputs(model, _to(b, dev))
            return _update(model(**inputs, use_cache=False).loss, model, opt, 0.0)
        return batches, sft_step

    if row == "rm":
        from dschat.data import DataCollatorReward

        rows, data = _phase_rows(wl, s, 2, "pairwise", tok)
        batches = loader_batches(rows, s.batch, DataCollatorReward(pad), data, n)
        model = _scorer(wl["reward"], pad, dev)
        opt = _adamw(model, s.lr)

        def rm_step(b: Any) -> float:  # (2B,) last-token scores, chosen first
            b = _to(b, dev)
            scores = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False).logits[:, 0]
            chosen, rejected = scores.chunk(2)
            return _update(-F.logsigmoid(chosen - rejected).mean(), model, opt, 1.0)
        return batches, rm_step

    if row == "dpo":
        from dschat.rlhf.dpo import DataCollatorPairs

        rows, data = _phase_rows(wl, s, 3, "pairwise", tok, tokenize_as=2)
        batches = loader_batches(rows, s.batch, DataCollatorPairs(pad), data, n)
        model, ref = _lm(wl["policy"], dev), _lm(wl["policy"], dev, train=False)
        opt = _adamw(model, s.lr)

        def answer_logps(m: Any, b: Any) -> Any:  # (2B,) summed log-probs of the answer tokens
            logps = _token_logprobs(m, b["input_ids"], b["attention_mask"])
            target = torch.arange(1, b["input_ids"].shape[1], device=dev)
            answer = (target.unsqueeze(0) >= b["prompt_len"].unsqueeze(1)) & b["attention_mask"][:, 1:].bool()
            return (logps * answer).sum(-1)

        with torch.no_grad():  # the reference's log-probs, once, outside the timed loop
            for b, _ in batches:
                b["ref_logps"] = answer_logps(ref, _to(b, dev)).cpu()
        del ref

        def dpo_step(b: Any) -> float:
            b = _to(b, dev)
            chosen, rejected = answer_logps(model, b).chunk(2)
            ref_chosen, ref_rejected = b["ref_logps"].chunk(2)
            margin = (chosen - ref_chosen) - (rejected - ref_rejected)
            return _update(-F.logsigmoid(0.1 * margin).mean(), model, opt, 1.0)
        return batches, dpo_step

    from dschat.data.collators import DataCollatorRLHF

    rows, data = _phase_rows(wl, s, 3, "prompts", tok)
    if row == "grpo":
        batches = loader_batches(rows, s.grpo_prompts, DataCollatorRLHF(pad), data, n)
        batches = [(b, units * s.generations) for b, units in batches]
        model = _lm(wl["policy"], dev)
        opt = _adamw(model, s.lr)
        G = s.generations

        def grpo_step(b: Any) -> float:
            # 1. G completions per prompt (bare generate), 2. rule rewards, group advantages, 3. one policy step
            prompt, prompt_mask = (b[k].repeat_interleave(G, 0).to(dev) for k in ("prompt", "prompt_att_mask"))
            seq, mask, action_mask = _sample(model, tok, prompt, prompt_mask, s.new_tokens, 1.0)
            P = prompt.shape[1]
            rewards = torch.tensor(bench_reward([], _texts(tok, seq, action_mask, P)), device=dev).view(-1, G)
            advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4))
            logprobs = _token_logprobs(model, seq, mask)[:, P - 1:]  # (B, A)
            ratio = torch.exp(logprobs - logprobs.detach())
            per_token = -ratio * advantages.flatten().unsqueeze(1)
            loss = (per_token * action_mask).sum() / action_mask.sum().clamp(min=1)
            return _update(loss, model, opt, 1.0)
        return batches, grpo_step

    if row == "ppo":
        batches = loader_batches(rows, s.batch, DataCollatorRLHF(pad), data, n)
        actor, ref = _lm(wl["policy"], dev), _lm(wl["policy"], dev, train=False)
        critic, reward = _scorer(wl["reward"], pad, dev), _scorer(wl["reward"], pad, dev, train=False)
        opt_actor, opt_critic = _adamw(actor, s.lr), _adamw(critic, s.lr)
        temperature, clip = 0.7, 0.2

        def values(b_seq: Any, b_mask: Any, P: int) -> Any:  # (B, A) critic values of the state before each token
            hidden = critic.model(input_ids=b_seq, attention_mask=b_mask, position_ids=_positions(b_mask),
                                  use_cache=False).last_hidden_state
            return critic.score(hidden).squeeze(-1)[:, P - 1:-1]

        def ppo_step(b: Any) -> float:
            # 1. bare generate, 2. reference / critic / reward forwards, 3. KL rewards and GAE,
            # 4. ppo_epochs of actor and critic steps (old log-probs: the first epoch's forward, before any step)
            prompt, prompt_mask = b["prompt"].to(dev), b["prompt_att_mask"].to(dev)
            seq, mask, action_mask = _sample(actor, tok, prompt, prompt_mask, s.new_tokens, temperature)
            P, am = prompt.shape[1], action_mask.float()
            with torch.no_grad():
                ref_logprobs = _token_logprobs(ref, seq, mask, temperature)[:, P - 1:]
                critic.eval()
                old_values = values(seq, mask, P)
                critic.train()
                score = reward(input_ids=seq, attention_mask=mask, position_ids=_positions(mask),
                               use_cache=False).logits[:, 0].clamp(-5, 5)
            old_logprobs = advantages = returns = None
            for _ in range(s.ppo_epochs):
                logprobs = _token_logprobs(actor, seq, mask, temperature)[:, P - 1:]
                if old_logprobs is None:
                    old_logprobs = logprobs.detach()
                    with torch.no_grad():
                        rewards = -0.05 * (old_logprobs - ref_logprobs) * am
                        last = (am.cumsum(-1) == am.sum(-1, keepdim=True)) & (am > 0)  # the last answer token
                        rewards = rewards + score.unsqueeze(1) * last
                        advantages, gae = torch.zeros_like(rewards), torch.zeros_like(score)
                        for t in reversed(range(rewards.shape[1])):
                            nxt = old_values[:, t + 1] * am[:, t + 1] if t + 1 < rewards.shape[1] else 0.0
                            delta = rewards[:, t] + nxt - old_values[:, t]
                            gae = (delta + 0.95 * gae) * am[:, t]
                            advantages[:, t] = gae
                        returns = advantages + old_values
                        mean = (advantages * am).sum() / am.sum()
                        std = (((advantages - mean) ** 2 * am).sum() / am.sum()).sqrt()
                        advantages = (advantages - mean) / (std + 1e-8)
                ratio = torch.exp(logprobs - old_logprobs)
                surrogate = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - clip, 1 + clip))
                loss = _update((surrogate * am).sum() / am.sum(), actor, opt_actor, 1.0)
                v = values(seq, mask, P)
                v_clipped = old_values + (v - old_values).clamp(-clip, clip)
                v_loss = 0.5 * (torch.max((v - returns) ** 2, (v_clipped - returns) ** 2) * am).sum() / am.sum()
                _update(v_loss, critic, opt_critic, 1.0)
            return loss
        return batches, ppo_step
    raise KeyError(row)


def run_ceiling(row: str, wl: dict[str, Any], shape: Shape, steps: int) -> dict[str, Any]:
    import torch

    torch.manual_seed(SEED)
    batches, step = ceiling(row, wl, shape, WARMUP + steps)
    ends, losses = [], []
    for b, _ in batches:
        losses.append(step(b))
        ends.append(time.perf_counter())
    out = window(ends, steps)
    out["units_per_step"] = [u for _, u in batches]
    if row.startswith("sft"):
        from dschat.data.packing import real_tokens

        out["tokens_per_step"] = [real_tokens(b) for b, _ in batches]
    out.update(losses=[round(x, 4) for x in losses], threads=torch.get_num_threads(), device=str(_device()))
    return out


# ------------------------------------------------------------------------------------------------ TRL side
def run_trl(row: str, wl: dict[str, Any], shape: Shape, steps: int, out_dir: Path) -> dict[str, Any]:
    """TRL's trainer of ``row`` on the same model and data (TRL shuffles and batches them itself), in this
    process; runs under any interpreter with trl, transformers and datasets (not dschat)."""
    try:
        import trl  # noqa: F401
    except ImportError:
        return {"error": "TRL not installed: row skipped"}
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback

    torch.manual_seed(SEED)
    tok = AutoTokenizer.from_pretrained(wl["policy"])

    def read(file: str, keys: tuple[str, ...]) -> Any:
        lines = Path(wl[file]).read_text(encoding="utf-8").splitlines()
        return Dataset.from_list([{k: json.loads(x)[k] for k in keys} for x in lines if x.strip()])

    class StepEnds(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.ends.append(time.perf_counter())

    common = dict(output_dir=str(out_dir), max_steps=WARMUP + steps, per_device_train_batch_size=shape.batch,
                  gradient_accumulation_steps=1, learning_rate=shape.lr, lr_scheduler_type="constant",
                  max_grad_norm=1.0, logging_steps=1, report_to="none", save_strategy="no", eval_strategy="no",
                  gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=not torch.cuda.is_available(),
                  dataloader_num_workers=0, disable_tqdm=True, seed=SEED)
    timer = StepEnds()
    if row == "rm":
        from trl import RewardConfig, RewardTrainer

        model = AutoModelForSequenceClassification.from_pretrained(wl["reward"], num_labels=1, dtype=torch.float32)
        model.config.pad_token_id = tok.pad_token_id
        trainer = RewardTrainer(model=model, args=RewardConfig(**common, max_length=shape.max_seq_len),
                                train_dataset=read("pairwise", ("prompt", "chosen", "rejected")),
                                processing_class=tok, callbacks=[timer])
        per_step = shape.batch
    elif row == "dpo":
        from trl import DPOConfig, DPOTrainer

        model = AutoModelForCausalLM.from_pretrained(wl["policy"], dtype=torch.float32)
        trainer = DPOTrainer(model=model, args=DPOConfig(**common, max_length=shape.max_seq_len, beta=0.1),
                             train_dataset=read("pairwise", ("prompt", "chosen", "rejected")),
                             processing_class=tok, callbacks=[timer])
        per_step = shape.batch
    elif row == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        per_step = shape.grpo_prompts * shape.generations  # TRL's batch size counts completions
        args = GRPOConfig(**{**common, "per_device_train_batch_size": per_step}, num_generations=shape.generations,
                          max_completion_length=shape.new_tokens, temperature=1.0, top_k=0, top_p=1.0, beta=0.0,
                          loss_type="dapo", epsilon=0.2, scale_rewards="group", mask_truncated_completions=False,
                          use_vllm=False, log_completions=False)
        model = AutoModelForCausalLM.from_pretrained(wl["policy"], dtype=torch.float32)
        trainer = GRPOTrainer(model=model, reward_funcs=bench_reward, args=args,
                              train_dataset=read("prompts", ("prompt",)), processing_class=tok, callbacks=[timer])
    else:
        return {"error": f"no TRL row for {row}"}
    trainer.train()
    out = window(timer.ends, steps)
    with warnings.catch_warnings():  # transformers 5 renames the attribute; either spelling answers
        warnings.simplefilter("ignore")
        checkpointing = getattr(trainer.model, "is_gradient_checkpointing", None)
    out.update(units_per_step=[per_step] * (WARMUP + steps), trl=trl.__version__, trainer=type(trainer).__name__,
               gradient_checkpointing=checkpointing, threads=torch.get_num_threads())
    return out


# ------------------------------------------------------------------------------------------------ driver
def child_env(threads: int, with_repo: bool = True) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_DISABLE_PROGRESS_BARS="1", PYTHONUNBUFFERED="1", WANDB_DISABLED="true")
    if with_repo:  # the children import this checkout's dschat
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return env


def run_side(side: str, row: str, wl: dict[str, Any], args: argparse.Namespace, steps: int, tag: str) -> dict:
    """One side of one row in a fresh process; its log goes to ``--work``/logs."""
    work = Path(args.work)
    logs, out = work / "logs", work / "runs" / tag
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{tag}.log"
    shutil.rmtree(out, ignore_errors=True)
    if side == "dschat":
        cmd = [sys.executable, "-c", "from dschat.cli.main import cli; cli()", "train",
               *dschat_flags(row, wl, Shape(), steps, out)]
    else:
        python = args.trl_python if side == "trl" else sys.executable
        cmd = [python, str(Path(__file__).resolve()), "--child", side, "--only", row, "--steps", str(steps),
               "--workload", str(Path(wl["folder"]) / "manifest.json"), "--work", str(out)]
    t0, load = time.time(), os.getloadavg()[0]
    with open(log, "w") as fh:
        p = subprocess.run(cmd, env=child_env(args.threads, side != "trl"), stdout=subprocess.PIPE if side != "dschat"
                           else fh, stderr=fh if side != "dschat" else subprocess.STDOUT, text=True, cwd=str(work))
    r: dict[str, Any] = {"process_wall_s": round(time.time() - t0, 1), "load_before": load, "log": str(log)}
    try:
        if p.returncode != 0:
            raise RuntimeError(f"exit {p.returncode}: {(p.stdout or '')[-300:]}{log.read_text()[-600:]}")
        if side == "dschat":
            shutil.copyfile(out / "metrics.jsonl", logs / f"{tag}.metrics.jsonl")
            times, losses = step_times(out / "metrics.jsonl")
            r.update(window([times[s] for s in sorted(times)], steps), losses=[losses[s] for s in sorted(losses)],
                     command=" ".join(cmd[3:]))
        else:
            r.update(json.loads(p.stdout.strip().splitlines()[-1]))
    except Exception as e:  # noqa: BLE001 - a failed side is reported in the results, the others still run
        r["error"] = r.get("error") or f"{type(e).__name__}: {e}"
    shutil.rmtree(out, ignore_errors=True)  # saved models: not needed
    return r


def nominal_units(row: str, shape: Shape, n: int) -> list[int] | None:
    """Units of ``n`` steps from the shape alone (None for sft-packed, whose rows per step vary)."""
    per = {"sft": shape.batch, "rm": shape.batch, "dpo": shape.batch, "ppo": shape.batch,
           "grpo": shape.grpo_prompts * shape.generations}.get(row)
    return None if per is None else [per] * n


def rate(side: dict[str, Any] | None, units: list[int] | None) -> float | None:
    """Units per second over the timed window (``units``: per step, warm-up steps first)."""
    if not side or "wall_s" not in side or not units:
        return None
    return sum(units[WARMUP:WARMUP + side["steps"]]) / max(side["wall_s"], 1e-9)


def _median(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Rows: " + ", ".join(f"{k} ({v.unit})" for k, v in ROWS.items()))
    ap.add_argument("--only", nargs="+", choices=list(ROWS), help="rows to run (default: all)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each runs every selected row's sides once")
    ap.add_argument("--steps", type=int, help="timed steps of every row (default: the row's own, 5 to 30)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 round, 2 timed steps, every row")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of every process (OMP_NUM_THREADS)")
    ap.add_argument("--trl", action="store_true", help="add TRL rows (rm, dpo, grpo) when `import trl` works")
    ap.add_argument("--trl-python", default=sys.executable, help="interpreter of the TRL rows (a venv with trl)")
    ap.add_argument("--work", default="/tmp/dschat_bench_stages", help="workload cache, logs and runs")
    ap.add_argument("--out", help="results JSON (default: WORK/bench_stages.json)")
    ap.add_argument("--child", choices=("ceiling", "trl"), help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:  # one side of one row, in this process: prints its result as the last line of stdout
        wl, row = json.loads(Path(a.workload).read_text()), a.only[0]
        result = run_ceiling(row, wl, Shape(), a.steps) if a.child == "ceiling" else \
            run_trl(row, wl, Shape(), a.steps, Path(a.work))
        print(json.dumps(result))
        return
    if a.quick:
        a.rounds, a.steps = 1, a.steps or 2
    rows = a.only or list(ROWS)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    os.environ.update(OMP_NUM_THREADS=str(a.threads), HF_HUB_OFFLINE="1")
    sys.path.insert(0, str(ROOT))
    t0 = time.time()
    wl = build_workload(work)
    print(f"workload {wl['folder']} ({wl['policy_params'] / 1e6:.2f}M-parameter policy, vocab {wl['vocab']}) in "
          f"{time.time() - t0:.1f}s; {a.threads} thread(s), {a.rounds} round(s)", flush=True)
    trl_ok = a.trl
    results: list[dict[str, Any]] = []
    for r in range(1, a.rounds + 1):
        for row in rows:
            steps = a.steps or ROWS[row].steps
            sides = ["dschat", "ceiling"] + (["trl"] if trl_ok and ROWS[row].trl else [])
            if r % 2 == 0:
                sides.reverse()
            rec: dict[str, Any] = {"round": r, "row": row, "steps": steps, "order": sides}
            for side in sides:
                res = run_side(side, row, wl, a, steps, f"{row}-{side}-r{r}")
                if side == "trl" and res.get("error", "").startswith("TRL not installed"):
                    print("TRL not installed: row skipped (and the TRL rows after it)", flush=True)
                    trl_ok = False
                rec[side] = res
            # dschat trains on the very batches the ceiling built (sft-packed's rows per step vary)
            units = rec["ceiling"].get("units_per_step") or nominal_units(row, Shape(), WARMUP + steps)
            rec["units_per_step"] = units
            rec["rate"] = {"dschat": rate(rec.get("dschat"), units), "ceiling": rate(rec.get("ceiling"), units),
                           "trl": rate(rec.get("trl"), (rec.get("trl") or {}).get("units_per_step"))}
            if row in SAME_LOSS and "losses" in rec["dschat"] and "losses" in rec["ceiling"]:
                # same weights, batches and optimizer: the losses agree step by step unless the batches differ
                pairs = list(zip(rec["dschat"]["losses"], rec["ceiling"]["losses"], strict=False))
                rec["max_loss_difference"] = max(abs(x - y) for x, y in pairs)
            d, c, t = rec["rate"]["dschat"], rec["rate"]["ceiling"], rec["rate"]["trl"]
            rec["dschat_over_ceiling"] = d / c if d and c else None
            rec["dschat_over_trl"] = d / t if d and t else None
            errors = "; ".join(f"{s}: {rec[s]['error']}" for s in sides if rec[s].get("error"))
            same = f", losses differ by <= {rec['max_loss_difference']:.1e}" if "max_loss_difference" in rec else ""
            print(f"[round {r}] {row}: dschat {_fmt(d)}, ceiling {_fmt(c)}, TRL {_fmt(t)} {ROWS[row].unit}/s{same}"
                  f"{' | ' + errors if errors else ''}", flush=True)
            results.append(rec)

    summary = {}
    for row in rows:
        recs = [x for x in results if x["row"] == row]
        summary[row] = {"unit": ROWS[row].unit, "setting": ROWS[row].setting,
                        **{f"{s}_per_s": _median([x["rate"][s] for x in recs]) for s in ("dschat", "ceiling", "trl")},
                        "dschat_over_ceiling": _median([x["dschat_over_ceiling"] for x in recs]),
                        "dschat_over_trl": _median([x["dschat_over_trl"] for x in recs])}
    print("\n| round | row | dschat | ceiling | TRL | dschat / ceiling | dschat / TRL | load |"
          "\n|---|---|---|---|---|---|---|---|")
    for x in results:
        print(f"| {x['round']} | {x['row']} | {_fmt(x['rate']['dschat'])} | {_fmt(x['rate']['ceiling'])} | "
              f"{_fmt(x['rate']['trl'])} | {_fmt(x['dschat_over_ceiling'])} | {_fmt(x['dschat_over_trl'])} | "
              f"{x['dschat'].get('load_before', 0):.1f} |")
    print("\n| row | unit | dschat /s | bare ceiling /s | dschat / ceiling | TRL /s | dschat / TRL |"
          "\n|---|---|---|---|---|---|---|")
    for row, v in summary.items():
        print(f"| {row} | {v['unit']} | {_fmt(v['dschat_per_s'])} | {_fmt(v['ceiling_per_s'])} | "
              f"{_fmt(v['dschat_over_ceiling'])} | {_fmt(v['trl_per_s'])} | {_fmt(v['dschat_over_trl'])} |")
    import torch

    out = Path(a.out) if a.out else work / "bench_stages.json"
    out.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M"), "threads": a.threads, "rounds": a.rounds, "warmup_steps": WARMUP,
        "shape": asdict(Shape()), "workload": wl, "torch": torch.__version__, "machine": platform.platform(),
        "cpus": os.cpu_count(), "cuda": torch.cuda.is_available(), "summary": summary, "rounds_detail": results,
    }, indent=1, default=str))
    print(f"\nratios: throughput of dschat over the other side, median of the rounds' ratios; results: {out}")


if __name__ == "__main__":
    main()
