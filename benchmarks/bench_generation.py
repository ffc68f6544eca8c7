"""Generation throughput: dschat's decode loop against HF ``generate`` and the naive alternatives.

Measured in one process, on the same weights and prompts, interleaved (each variant once per round, rounds
repeated), so the ratios are what matter (absolute numbers depend on the machine and its load):

* ``dschat``: the hybrid engine's default: eval mode, ZeRO-3 parameters gathered once per call, dschat's decode
  loop (preallocated KV cache, lean per-token forward for Llama-architecture models).
* ``hf``: the same, with transformers' ``generate`` as the loop (``--generation-backend hf``): the bare ceiling.
* ``dschat, one product per weight``: the dschat loop with the lean step's column split off (``LeanLlama.split``
  = 1; CPU only, where the split applies): what multiplying by column blocks on torch's threads gains.
* ``hf, ZeRO-3 per-token gathers``: ``generate`` on the partitioned module without the single gather.
* ``hf, no KV cache``: the single gather, ``use_cache=False`` (recomputes the prefix per token).

Sampling is seeded and both loops draw identical tokens, and EOS is disabled, so every variant generates exactly
``--new-tokens`` tokens per row: equal work per call.

    python benchmarks/bench_generation.py --model tiny --batch 8 --new-tokens 64 --rounds 5
    deepspeed --num_gpus 2 benchmarks/bench_generation.py ...      (ZeRO-3 shards over 2 ranks: real gathers)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dschat import engine as E  # noqa: E402
from dschat.config import EngineArgs, OptimArgs  # noqa: E402
from dschat.generation.decode import GenerationConfig  # noqa: E402
from dschat.generation.hybrid_engine import HybridEngine  # noqa: E402
from dschat.generation.lean_llama import LeanLlama  # noqa: E402
from dschat.models.loading import create_causal_lm, load_tokenizer, resolve_model  # noqa: E402

PROMPTS = ["\n\nHuman: 我的订单什么时候发货？\n\nAssistant:", "\n\nHuman: Where is my refund?\n\nAssistant:",
           "\n\nHuman: 这个耳机支持降噪吗？能连两台设备吗？\n\nAssistant:",
           "\n\nHuman: Can I change the delivery address of an order that has shipped?\n\nAssistant:"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--zero-stage", type=int, default=3)
    ap.add_argument("--skip-slow", action="store_true", help="only dschat vs hf (no per-token gathers, no-cache)")
    ap.add_argument("--local_rank", type=int, default=-1)  # set by the deepspeed launcher
    args = ap.parse_args()

    E.setup_distributed()
    path = resolve_model(args.model)
    tok = load_tokenizer(path)
    engine = E.build_train_engine(create_causal_lm(path), engine=EngineArgs(zero_stage=args.zero_stage),
                                  optim=OptimArgs(learning_rate=1e-5, per_device_train_batch_size=args.batch),
                                  dtype=torch.float32, total_steps=1)
    module = E.unwrap(engine)
    never = len(tok) + 7  # an EOS id no row can sample: every call generates exactly new_tokens per row
    ours = HybridEngine(engine, tok.pad_token_id, never, backend="dschat")
    hf = HybridEngine(engine, tok.pad_token_id, never, backend="hf")
    texts = [PROMPTS[i % len(PROMPTS)] for i in range(args.batch)]
    enc = [tok(t)["input_ids"] for t in texts]
    width = max(map(len, enc))
    prompt = torch.tensor([[tok.pad_token_id] * (width - len(e)) + e for e in enc])
    mask = (prompt != tok.pad_token_id).long()
    cfg = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=True)
    common = dict(max_new_tokens=args.new_tokens, do_sample=True, top_k=0, pad_token_id=tok.pad_token_id,
                  eos_token_id=never)

    def hf_per_token() -> torch.Tensor:
        module.eval()
        with torch.no_grad():
            out = module.generate(prompt, attention_mask=mask, **common)
        module.train()
        return out

    def hf_no_cache() -> torch.Tensor:
        module.eval()
        with torch.no_grad(), E.gathered_parameters(module):
            out = module.generate(prompt, attention_mask=mask, use_cache=False, **common)
        module.train()
        return out

    def dschat_single() -> torch.Tensor:
        split = LeanLlama.__dict__["default_split"]
        LeanLlama.default_split = staticmethod(lambda model: 1)  # type: ignore[method-assign]
        try:
            return ours.generate(prompt, mask, cfg, generator_seed=0)
        finally:
            LeanLlama.default_split = split  # type: ignore[method-assign]

    variants = [("dschat", lambda: ours.generate(prompt, mask, cfg, generator_seed=0)),
                ("hf", lambda: hf.generate(prompt, mask, cfg, generator_seed=0))]
    if not torch.cuda.is_available():
        variants.append(("dschat, one product per weight", dschat_single))
    if not args.skip_slow:
        variants += [("hf, ZeRO-3 per-token gathers", hf_per_token), ("hf, no KV cache", hf_no_cache)]
    for _, fn in variants[:2]:  # warm-up
        fn()
    greedy = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False)
    same = torch.equal(ours.generate(prompt, mask, greedy), hf.generate(prompt, mask, greedy))
    times: dict[str, list[float]] = {name: [] for name, _ in variants}
    for _ in range(args.rounds):
        for name, fn in variants:
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    if not E.is_main():
        return
    tokens = args.batch * args.new_tokens
    hf_tps = tokens / statistics.median(times["hf"])
    print(f"world size {E.world_size()}; model {args.model}, batch {args.batch}, prompt width {width}, "
          f"{args.new_tokens} new tokens, ZeRO-{args.zero_stage}, {torch.get_num_threads()} threads, "
          f"{'CUDA' if torch.cuda.is_available() else 'CPU'}; identical greedy tokens: {same}")
    print("| loop | new tokens/s (median of rounds) | vs hf generate |\n|---|---|---|")
    for name, ts in times.items():
        tps = tokens / statistics.median(ts)
        print(f"| {name} | {tps:.0f} | {tps / hf_tps:.2f}x |")


if __name__ == "__main__":
    main()
