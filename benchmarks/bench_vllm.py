"""Sampling on vLLM against dschat's decode loop and HF ``generate``, and the cost of a checked weight sync.

One process, the same random weights and prompts, the three backends interleaved (each once per round, rounds
repeated; medians), so the ratios are the result. EOS is an id no row can sample, so every call generates
exactly ``--new-tokens`` tokens per row. The sync row times what stage 3 adds per policy update on vLLM: the
weights streamed into the engine (``time/sync_s``) and the probe (``time/probe_s``), after a change of every
weight.

    python benchmarks/bench_vllm.py --shape 87m --batch 32 --new-tokens 64 --rounds 3
    python benchmarks/bench_vllm.py --shape tiny --batch 8 --new-tokens 64

Shapes (random weights, Llama layout): tiny (the demo preset, 1.4M), 87m (hidden 768, 6 layers, 12 heads, 4 KV
heads, vocab 32000), 0.5b (Qwen2.5-0.5B's: hidden 896, 24 layers, 14 heads, 2 KV heads, vocab 151936; on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dschat.generation.decode import GenerationConfig  # noqa: E402
from dschat.generation.hybrid_engine import HybridEngine  # noqa: E402
from dschat.models.loading import create_causal_lm, load_tokenizer, resolve_model  # noqa: E402

SHAPES = {
    "87m": dict(arch="llama", hidden_size=768, num_hidden_layers=6, num_attention_heads=12, num_key_value_heads=4,
                intermediate_size=2048, vocab_size=32000),
    "0.5b": dict(arch="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
}


def build(shape: str, folder: str) -> str:
    """A model folder of ``shape`` (random weights, seed 0) with the tiny preset's tokenizer."""
    if shape == "tiny":
        return resolve_model("tiny")
    import transformers as T

    from dschat.models.tiny import save_tiny_tokenizer

    spec = dict(SHAPES[shape])
    arch = spec.pop("arch")
    config = (T.LlamaConfig if arch == "llama" else T.Qwen2Config)(max_position_embeddings=2048, **spec)
    torch.manual_seed(0)
    model = (T.LlamaForCausalLM if arch == "llama" else T.Qwen2ForCausalLM)(config)
    model.save_pretrained(folder)
    save_tiny_tokenizer(folder)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=["tiny", *SHAPES], default="87m")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default="", help="also write the figures here")
    args = ap.parse_args()

    folder = tempfile.mkdtemp(prefix="dschat-bench-vllm-")
    path = build(args.shape, folder)
    tok = load_tokenizer(path)
    model = create_causal_lm(path).eval()
    never = int(model.config.vocab_size) + 7  # an EOS id no row can sample: every call makes new_tokens per row
    texts = ["\n\nHuman: 我的订单什么时候发货？\n\nAssistant:", "\n\nHuman: Where is my refund?\n\nAssistant:"]
    enc = [tok(texts[i % 2])["input_ids"] for i in range(args.batch)]
    width = max(map(len, enc))
    prompt = torch.tensor([[tok.pad_token_id] * (width - len(e)) + e for e in enc])
    mask = (prompt != tok.pad_token_id).long()
    cfg = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=True)

    class Actor:  # stands for the actor's DeepSpeed engine: its module and its optimizer step count
        module = model
        global_steps = 0

        def train(self) -> None:
            model.train()

    steps = Actor()
    engines = {name: HybridEngine(steps, tok.pad_token_id, never, backend=name) for name in ("vllm", "dschat", "hf")}

    def sample(name: str) -> torch.Tensor:
        return engines[name].generate(prompt, mask, cfg, generator_seed=0)

    for name in engines:  # warm-up (vLLM: build, first sync)
        sample(name)
    greedy = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False)
    same = torch.equal(engines["vllm"].generate(prompt, mask, greedy), engines["hf"].generate(prompt, mask, greedy))
    times: dict[str, list[float]] = {name: [] for name in engines}
    syncs: list[dict[str, float]] = []
    for _ in range(args.rounds):
        for name in engines:
            t0 = time.perf_counter()
            out = sample(name)
            times[name].append(time.perf_counter() - t0)
            assert out.shape[1] == width + args.new_tokens
        with torch.no_grad():  # an update: every weight changes, so the next vLLM sample syncs first
            for p in model.parameters():
                p.mul_(1.0 + 1e-4)
        steps.global_steps += 1
        engines["vllm"].backend.sync(model, steps)
        syncs.append(engines["vllm"].sync_metrics())
    tokens = args.batch * args.new_tokens
    params = sum(p.numel() for p in model.parameters())
    result = {"shape": args.shape, "params": params, "batch": args.batch, "prompt_width": width,
              "new_tokens": args.new_tokens, "threads": torch.get_num_threads(),
              "device": "cuda" if torch.cuda.is_available() else "cpu", "identical_greedy_vllm_hf": same,
              "tokens_per_s": {n: tokens / statistics.median(ts) for n, ts in times.items()},
              "sync_s": statistics.median(s["time/sync_s"] for s in syncs),
              "probe_s": statistics.median(s["time/probe_s"] for s in syncs),
              "probe_max_logprob_diff": max(s["sync/max_logprob_diff"] for s in syncs)}
    ours = result["tokens_per_s"]["dschat"]
    print(f"{args.shape} ({params / 1e6:.1f}M), batch {args.batch}, prompt width {width}, {args.new_tokens} new "
          f"tokens, fp32, {result['threads']} threads, {result['device']}; identical greedy vLLM/HF: {same}")
    print("| backend | new tokens/s (median) | vs dschat |\n|---|---|---|")
    for name, tps in result["tokens_per_s"].items():
        print(f"| {name} | {tps:.0f} | {tps / ours:.2f}x |")
    print(f"sync after an update: push {result['sync_s']:.3f} s + probe {result['probe_s']:.3f} s; probe max "
          f"log-prob diff {result['probe_max_logprob_diff']:.2g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
