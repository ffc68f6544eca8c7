"""Checks of the vLLM backend, each run in a process of its own by ``test_vllm.py`` (vLLM binds threads and replaces
``torch.set_num_threads`` process-wide, so it stays out of the test process). Prints one JSON line last.

    python -m tests.dschat.vllm_checks greedy FOLDER FAMILY...
    python -m tests.dschat.vllm_checks sync FOLDER
    python -m tests.dschat.vllm_checks episodes FOLDER
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch


def _prompts(tok: Any, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    from dschat.data.collators import pad_sequences

    ids = [tok(t, add_special_tokens=True)["input_ids"] for t in texts]
    return pad_sequences(ids, tok.pad_token_id, "left")


def _sample(backend: Any, model: Any, ids: Any, mask: Any, gen: Any, tok: Any, engine: Any = None) -> Any:
    """Through the entry, as the hybrid engine samples from vLLM: the weights synced first, then the sample."""
    from dschat.generation.backends import generate
    from dschat.generation.decode import Prompts

    return generate(backend, model, Prompts(ids, mask, tok.eos_token_id, tok.pad_token_id), gen, engine=engine)


TEXTS = ["你好，今天天气怎么样？", "My parcel has not arrived and the invoice looks wrong; what now?", "Hi"]


def greedy(folder: str, families: list[str]) -> dict[str, Any]:
    """Greedy answers (16 tokens, stopping at EOS) of vLLM and HF ``generate`` on each family's tiny model."""
    from dschat.generation.decode import GenerationConfig, HFBackend
    from dschat.generation.vllm_engine import VLLMBackend, WeightSyncError, supports
    from dschat.models.loading import create_causal_lm, load_tokenizer
    from tests.families import build_family

    out: dict[str, Any] = {}
    for family in families:
        path = str(build_family(family, folder, heads=2))  # 32-wide heads: vLLM's CPU attention has no 16
        tok = load_tokenizer(path)
        model = create_causal_lm(path).eval()
        ok, why = supports(model)
        if not ok:
            out[family] = {"supported": False, "why": why}
            continue
        ids, mask = _prompts(tok, TEXTS)
        gen = GenerationConfig(max_new_tokens=16, do_sample=False)
        hf = HFBackend().generate(model, ids, mask, gen, tok.eos_token_id, tok.pad_token_id).sequences
        backend = VLLMBackend()
        try:
            ours = _sample(backend, model, ids, mask, gen, tok).sequences
            diff = backend.last["sync/max_logprob_diff"]
        except WeightSyncError as e:
            out[family] = {"supported": True, "equal": False, "error": str(e)}
            continue
        finally:
            backend.close()
        out[family] = {"supported": True, "equal": ours.tolist() == hf.tolist(), "probe": diff,
                       "vllm": ours.tolist(), "hf": hf.tolist()}
    return out


class _Steps:
    """Stands for a DeepSpeed engine's step count: what the backend keys its weights on."""

    global_steps = 0


def _train_step(model: torch.nn.Module, ids: torch.Tensor, lr: float) -> None:
    """One plain SGD step on the LM loss of ``ids`` (every trainable parameter moves)."""
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
                p.grad = None
    model.eval()


def sync(folder: str) -> dict[str, Any]:
    """After a training step and a sync: the probe and greedy parity with HF; a skipped sync and a sync without the
    prefix-cache reset are each caught; LoRA (merged into the pushed weights) syncs correctly."""
    from dschat.config import LoraArgs
    from dschat.generation.decode import GenerationConfig, HFBackend
    from dschat.generation.vllm_engine import VLLMBackend, WeightSyncError
    from dschat.models.loading import create_causal_lm, load_tokenizer, resolve_model

    path = resolve_model("tiny")
    tok = load_tokenizer(path)
    ids, mask = _prompts(tok, TEXTS)
    gen = GenerationConfig(max_new_tokens=12, do_sample=False)
    train_ids = torch.tensor([tok("退款什么时候到账？谢谢你的帮助！")["input_ids"]])
    out: dict[str, Any] = {}

    def run(case: str, lora: bool = False, **switches: Any) -> None:
        torch.manual_seed(0)
        model = create_causal_lm(path, lora=LoraArgs(lora_dim=4, lora_alpha=8) if lora else None).eval()
        steps = _Steps()
        backend = VLLMBackend(**switches)
        try:
            _sample(backend, model, ids, mask, gen, tok, steps)
            first = backend.last["sync/max_logprob_diff"]
            for _ in range(2 if lora else 1):  # LoRA: B starts at zero, so the second step moves the merged weights
                _train_step(model, train_ids, lr=0.5 if lora else 0.05)
                steps.global_steps += 1
            row: dict[str, Any] = {"first_probe": first}
            try:
                seqs = _sample(backend, model, ids, mask, gen, tok, steps)
                hf = HFBackend().generate(model, ids, mask, gen, tok.eos_token_id, tok.pad_token_id).sequences
                row.update(caught=False, probe=backend.last["sync/max_logprob_diff"],
                           equal=seqs.sequences.tolist() == hf.tolist())
            except WeightSyncError as e:
                row.update(caught=True, message=str(e), broken=backend.broken is not None)
            out[case] = row
        finally:
            backend.close()

    run("synced")
    run("skipped", skip_sync=True)
    run("no_prefix_reset", reset_prefix_cache=False)
    run("lora", lora=True)
    return out


def episodes(folder: str) -> dict[str, Any]:
    """Greedy episodes with an environment, turn by turn on vLLM and on HF generate: the same tokens, masks and
    rewards. The turn's end is the token the untrained model writes most, so the episodes have several turns."""
    from dschat.agents.agent import Agent
    from dschat.agents.episode import Episodes
    from dschat.agents.tools import ToolRunner
    from dschat.generation.backends import generate
    from dschat.generation.decode import GenerationConfig, HFBackend, Prompts
    from dschat.generation.vllm_engine import VLLMBackend
    from dschat.models.loading import create_causal_lm, load_tokenizer
    from tests.dschat.scripted import Again
    from tests.families import build_family

    path = str(build_family("llama_sp", folder, heads=2))
    tok = load_tokenizer(path)
    model = create_causal_lm(path).eval()
    ids, mask = _prompts(tok, TEXTS)
    first = HFBackend().generate(model, ids, mask, GenerationConfig(max_new_tokens=24, do_sample=False),
                                 tok.eos_token_id, tok.pad_token_id).sequences[:, ids.shape[1]:]
    end = Counter(first.flatten().tolist()).most_common(1)[0][0]  # the token it writes most: the turn's end
    gen = GenerationConfig(max_new_tokens=64, do_sample=False)
    out: dict[str, Any] = {}
    for name, backend in (("hf", HFBackend()), ("vllm", VLLMBackend())):
        agent = Agent([], ToolRunner([]), {"Again": Again}, "env", 4)
        eps = Episodes(agent, tok, [{} for _ in TEXTS], [end], tok.pad_token_id)
        try:
            got = generate(backend, model, Prompts(ids, mask, [end], tok.pad_token_id), gen, episodes=eps)
        finally:
            backend.close()
        out[name] = {"sequences": got.sequences.tolist(), "policy": got.policy_mask.tolist(),
                     "real": got.real_mask.tolist(), "turns": [st.counts.turns for st in eps.state],
                     "rewards": [st.env_reward for st in eps.state], "finished": eps.finished()}
    return out


def chat(folder: str) -> dict[str, Any]:
    """``dschat chat --tools calculator`` on vLLM: the policy's tokens scripted where a row samples (a call, then
    an answer), the episode run turn by turn over the engine's whole answers; what the chat showed and returned."""
    from dschat.agents.agent import Agent
    from dschat.agents.tools import ToolRunner, load_tools
    from dschat.generation.chat import Chatbot
    from dschat.models.loading import create_causal_lm, load_tokenizer
    from tests.dschat.scripted import script_policy
    from tests.families import build_family

    path = str(build_family("llama_sp", folder, heads=2))
    tok = load_tokenizer(path)
    model = create_causal_lm(path).eval()
    script = tok(" <tool_call>calculator(6*7)</tool_call> <answer>42</answer>", add_special_tokens=False)["input_ids"]
    script_policy(lambda row: script)
    tools = load_tools(["calculator"])
    bot = Chatbot(model, tok, torch.device("cpu"), max_new_tokens=64, greedy=True, temperature=0.0, top_p=1.0,
                  top_k=0, repetition_penalty=1.0, log=lambda _: None, backend="vllm",
                  agent=Agent(tools, ToolRunner(tools, 5.0, 200), {}, "env", 4))
    shown: list[str] = []
    try:
        answer, _ = bot.reply([{"role": "user", "content": "6 times 7?"}], shown.append)
    finally:
        bot.backend.close()
    return {"backend": bot.backend.name, "shown": "".join(shown), "answer": answer}


def main(argv: list[str]) -> None:
    check, folder, *rest = argv
    Path(folder).mkdir(parents=True, exist_ok=True)
    result = {"greedy": lambda: greedy(folder, rest), "sync": lambda: sync(folder),
              "episodes": lambda: {**episodes(folder), "chat": chat(folder)}}[check]()
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])

