"""SFT tokens/s of the training batch layouts, in one process: padded rows (the default), ``--packing``,
``--group-by-length``, and a bare packed shape (batch x max_seq_len of the same rows' tokens run together, plain
causal attention, as a bare PyTorch loop trains). One DeepSpeed engine (ZeRO 0, torch AdamW) takes one optimizer
step of each kind in turn, so a busy machine slows them alike; the result is the median tokens/s of each kind and
the median of the per-round ratios.

    python benchmarks/bench_batching.py --model tiny --threads 1 --rounds 24
    python benchmarks/bench_batching.py --model /path/policy --data /path/pref_ds --max-seq-len 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--data", action="append", default=[], help="SFT data (default: the demo corpus)")
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=24)
    a = ap.parse_args()

    import torch

    torch.set_num_threads(a.threads)
    from dschat import engine as E
    from dschat.config import DataArgs, EngineArgs, OptimArgs
    from dschat.data import DataCollatorSFT, load_phase
    from dschat.data.packing import real_tokens, sft_inputs
    from dschat.demo import demo_data
    from dschat.models.loading import create_causal_lm, load_tokenizer, resolve_model
    from dschat.training.stage import resumable_batches, training_loader

    E.setup_distributed()
    path = resolve_model(a.model)
    tok = load_tokenizer(path)
    data = DataArgs(data=a.data, data_split="10,0,0", max_seq_len=a.max_seq_len, eval_fraction=0.0)
    rows = load_phase(data, 1, tok, 1234, log=lambda _: None, default_data=demo_data).train
    collator = DataCollatorSFT(tok.pad_token_id)

    def batches(**flags: bool) -> list:
        loader = training_loader(rows, a.batch, collator, 1234, DataArgs(**{**data.__dict__, **flags}))
        return [b for _, _, b in resumable_batches(loader, 2)]

    kinds = {"padded": batches(), "packed": batches(packing=True), "grouped": batches(group_by_length=True)}
    stream = [t for r in rows for t in r["input_ids"]]
    size = a.batch * a.max_seq_len
    bare = [torch.tensor(stream[i * size: (i + 1) * size]).view(a.batch, a.max_seq_len)
            for i in range(len(stream) // size)]
    kinds["bare"] = [{"input_ids": x, "labels": x, "attention_mask": torch.ones_like(x)} for x in bare]
    engine = E.build_train_engine(create_causal_lm(path), engine=EngineArgs(), dtype=torch.float32, total_steps=10**6,
                                  optim=OptimArgs(learning_rate=1e-5, per_device_train_batch_size=a.batch,
                                                  max_grad_norm=0.0, lr_scheduler_type="constant", num_warmup_steps=0))
    engine.train()
    rates: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(a.rounds + 2):  # two warm-up rounds
        for kind in list(kinds) if r % 2 == 0 else list(kinds)[::-1]:
            b = kinds[kind][r % len(kinds[kind])]
            t = time.perf_counter()
            loss = engine(**sft_inputs(engine, b), use_cache=False).loss
            engine.backward(loss)
            engine.step()
            if r >= 2:
                rates[kind].append(real_tokens(b) / (time.perf_counter() - t))
    out = {"tokens_per_s": {k: round(statistics.median(v)) for k, v in rates.items()},
           "ratio_to_bare": {k: round(statistics.median(x / y for x, y in zip(v, rates["bare"], strict=True)), 3)
                             for k, v in rates.items()},
           "ratio_to_padded": {k: round(statistics.median(x / y for x, y in zip(v, rates["padded"], strict=True)), 3)
                               for k, v in rates.items()},
           "tokens_per_step": {k: round(statistics.mean(real_tokens(b) for b in v)) for k, v in kinds.items()},
           "slots_per_step": {k: round(statistics.mean(b["input_ids"].numel() for b in v)) for k, v in kinds.items()},
           "threads": a.threads, "rounds": a.rounds, "load_average": os.getloadavg()[0]}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
