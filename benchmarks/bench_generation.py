"""Experience-generation throughput of the hybrid engine's fallback path, against the naive alternatives.

Measured in one process, on the same weights and prompts, so the ratios are what matter (absolute numbers depend
on the machine):

* ``hybrid``: dschat's path: eval mode, KV-cache ``generate``, ZeRO-3 parameters gathered once per call.
* ``zero3-per-step``: ``generate`` on the ZeRO-3-partitioned module without the single gather, so every layer's
  parameters are fetched for every generated token (what a plain ``engine.module.generate`` does).
* ``no-kv-cache``: the single gather, but ``use_cache=False`` (recomputes the whole prefix per token).

    python benchmarks/bench_generation.py --batch 16 --new-tokens 64 --repeats 3
    deepspeed --num_gpus 2 benchmarks/bench_generation.py ...      (ZeRO-3 shards over 2 ranks: real gathers)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dschat import engine as E  # noqa: E402
from dschat.config import EngineArgs, OptimArgs  # noqa: E402
from dschat.generation import GenerationConfig  # noqa: E402
from dschat.hybrid_engine import HybridEngine  # noqa: E402
from dschat.models import create_causal_lm, load_tokenizer, resolve_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--local_rank", type=int, default=-1)  # set by the deepspeed launcher
    args = ap.parse_args()

    E.setup_distributed()
    path = resolve_model(args.model)
    tok = load_tokenizer(path)
    engine = E.build_train_engine(create_causal_lm(path), engine=EngineArgs(zero_stage=3),
                                  optim=OptimArgs(learning_rate=1e-5, per_device_train_batch_size=args.batch),
                                  dtype=torch.float32, total_steps=1)
    module = E.unwrap(engine)
    hybrid = HybridEngine(engine, tok.pad_token_id, tok.eos_token_id)
    text = "\n\nHuman: 我的订单什么时候发货？\n\nAssistant:"
    prompt = torch.tensor([tok(text)["input_ids"]] * args.batch)
    mask = torch.ones_like(prompt)
    # min_new_tokens keeps every variant generating exactly new_tokens tokens: equal work per call.
    common = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)

    def hybrid_call() -> None:
        hybrid.generate(prompt, mask, GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False))

    def per_step_call() -> None:
        module.eval()
        with torch.no_grad():
            module.generate(prompt, attention_mask=mask, **common)
        module.train()

    def no_cache_call() -> None:
        module.eval()
        with torch.no_grad(), E.gathered_parameters(module):
            module.generate(prompt, attention_mask=mask, use_cache=False, **common)
        module.train()

    # The hybrid path stops at EOS; force the same length for a fair comparison.
    hybrid_kwargs_patch(hybrid, args.new_tokens)
    rows = []
    for name, fn in (("hybrid (1 gather, KV cache)", hybrid_call), ("ZeRO-3 per-step gathers", per_step_call),
                     ("1 gather, no KV cache", no_cache_call)):
        fn()  # warm-up
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            fn()
        dt = (time.perf_counter() - t0) / args.repeats
        rows.append((name, args.batch * args.new_tokens / dt))
    base = rows[0][1]
    if not E.is_main():
        return
    print(f"world size {E.world_size()}; ", end="")
    print(f"model {args.model}, batch {args.batch}, {args.new_tokens} new tokens, ZeRO-3, "
          f"{torch.get_num_threads()} threads, {'CUDA' if torch.cuda.is_available() else 'CPU'}")
    print("| path | tokens/s | hybrid speed-up |\n|---|---|---|")
    for name, tps in rows:
        print(f"| {name} | {tps:.0f} | {base / tps:.2f}x |")


def hybrid_kwargs_patch(hybrid: HybridEngine, n: int) -> None:
    """Make the hybrid engine generate exactly ``n`` tokens (benchmark only)."""
    module = hybrid.module
    original = module.generate

    def generate(*a, **kw):  # type: ignore[no-untyped-def]
        kw["min_new_tokens"] = n
        return original(*a, **kw)

    module.generate = generate  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
