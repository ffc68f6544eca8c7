"""The weight plane against the weight link it replaced, on this machine, in one run: seconds per MB of a weight
update, and the host memory the trainer's side holds while updates wait behind a busy sampler.

Two processes per measurement, a trainer (core 0) and a sampler (core 1), each one thread, on loopback (gloo):

- ``before``: the previous commit's ``dschat.generation.weight_link`` over ``dschat.engine.Link`` (its tree
  extracted with ``git archive``): a snapshot of the policy into fresh CPU memory, integer checksums in 2^18-element
  chunks, two JSON broadcasts per bucket, then the bucket;
- ``after``: this tree's ``dschat.generation.weight_plane``: buckets packed and checksummed where the weights are
  into reused staging, the layout and the checksums over the control channel, the buckets on the weight group.

Each round times ``--updates`` updates of the same model (random Llama-layout weights, saved once), from the
trainer's first touch of its weights to the sampler's verdict, interleaving before and after. Then the memory: the
trainer takes three updates in a row while the sampler sleeps (``--max-staleness 2``: K + 1 updates in flight): the
link kept one snapshot per update, the plane keeps one update's staging and makes the next wait for its buffers.
The trainer's RSS growth and the bytes the weight path holds are reported.

    python benchmarks/bench_weight_plane.py                      # ~200 MB model, 3 rounds
    python benchmarks/bench_weight_plane.py --hidden 256 --layers 2 --rounds 1 --updates 2    # a smoke run

Linux only (cores pinned with ``os.sched_setaffinity``).
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

ROOT = Path(__file__).resolve().parent.parent
SECRET = "bench-weight-plane-secret-0123456789"
SLEEP_S = 6.0  # the sampler's "busy" time in the memory measurement


def rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def model(path: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def nudge(m: Any) -> None:
    """A training step's worth of change: every weight moves."""
    import torch

    with torch.no_grad():
        for p in m.parameters():
            p.mul_(1.0001)


# ------------------------------------------------------------------------------------------------- before
def before(role: str, port: int, path: str, updates: int, memory: bool) -> dict[str, Any]:

    from dschat import engine as E
    from dschat.generation import weight_link as W

    rank = 0 if role == "send" else 1
    link = E.Link("127.0.0.1", port, rank, 2, 300)
    m = model(path)
    out: dict[str, Any] = {}
    if rank == 1:
        for i in range(updates + (3 if memory else 0)):
            if memory and i == updates:  # busy while the trainer takes its next three updates
                time.sleep(SLEEP_S)
            W.receive_weights(link, m)
        return out
    times = []
    for v in range(updates):
        nudge(m)
        t0 = time.perf_counter()
        metrics = W.send_weights(link, m, v)
        times.append(time.perf_counter() - t0)
        out["bytes"] = metrics["sync/bytes"]
    out["seconds"] = times
    if memory:  # three updates taken while the sampler sleeps: each a snapshot, kept until it is sent
        base = rss()
        snaps = [W.take_snapshot(m) for _ in range(3)]
        out["held_bytes"] = sum(s.bytes for s in snaps)
        out["held_count"] = len(snaps)
        out["rss_growth"] = rss() - base
        for v, s in enumerate(snaps):
            W.send_snapshot(link, s, 100 + v)
    return out


# -------------------------------------------------------------------------------------------------- after
def after(role: str, port: int, path: str, updates: int, memory: bool) -> dict[str, Any]:

    from dschat import engine as E
    from dschat.generation import channel as C
    from dschat.generation import weight_plane as W

    m = model(path)
    out: dict[str, Any] = {}
    if role == "recv":
        ch = C.accept(C.listen("127.0.0.1", port), SECRET, 300, print)
        host, store_port = ch.recv()[0]["store"]
        receiver = W.ModuleReceiver(m)
        receiver.group = W.join_group({"store": [host, store_port], "prefix": "b", "rank": 1, "size": 2,
                                       "nccl": False, "timeout": 300}, 0)
        for i in range(updates + (3 if memory else 0)):
            if memory and i == updates:  # busy while the trainer takes its next three updates
                time.sleep(SLEEP_S)
            W.take_update(ch, receiver, ch.recv()[0])
        return out
    ch = C.connect("127.0.0.1", port, SECRET, 300)
    store = E.WeightStore("127.0.0.1", 300)
    ch.send({"store": [store.host, store.port]})
    group = E.WeightGroup(store.store, "b", 0, 2, 300)
    sender = W.Sender(m, True, streaming=False)  # K > 0: a whole update may wait while the sampler samples
    from concurrent.futures import ThreadPoolExecutor

    courier = ThreadPoolExecutor(1)
    times = []
    for v in range(updates):
        nudge(m)
        t0 = time.perf_counter()
        update = W.Update(v, sender.layout("full"), "torch.float32")
        sent = courier.submit(sender.send, update, [ch], group, 300)
        sender.pack(update)
        metrics = sent.result()
        times.append(time.perf_counter() - t0)
        out["bytes"] = metrics["sync/bytes"]
    out["seconds"] = times
    if memory:  # three updates in a row while the sampler sleeps: the first staged, the next wait for buffers
        base = rss()
        sends = []
        packed = threading.Event()

        def train_thread() -> None:
            for v in range(3):
                update = W.Update(100 + v, sender.layout("full"), "torch.float32")
                sends.append(courier.submit(sender.send, update, [ch], group, 300))
                sender.pack(update)
                packed.set()

        t = threading.Thread(target=train_thread)
        t.start()
        packed.wait()
        time.sleep(1.0)  # the second update is waiting for its buffers by now
        out["held_bytes"] = sender.staging_bytes
        out["held_count"] = 1
        out["rss_growth"] = rss() - base
        t.join()
        for f in sends:
            f.result()
    return out


# ----------------------------------------------------------------------------------------------- the driver
def role_main(args: argparse.Namespace) -> None:
    os.sched_setaffinity(0, {0 if args.role == "send" else 1})
    import torch

    torch.set_num_threads(1)
    fn = before if args.tree == "before" else after
    result = fn(args.role, args.port, args.model, args.updates, args.memory)
    if args.role == "send":
        Path(args.out).write_text(json.dumps(result))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(tree: str, root: Path, path: str, updates: int, memory: bool, work: Path) -> dict[str, Any]:
    port, out = free_port(), work / f"{tree}.json"
    env = {**os.environ, "PYTHONPATH": str(root)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--tree", tree, "--port", str(port), "--model", path,
           "--updates", str(updates), "--out", str(out)] + (["--memory"] if memory else [])
    procs = [subprocess.Popen([*cmd, "--role", r], env=env, cwd=work, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for r in ("recv", "send")]
    for p in procs:
        _, err = p.communicate(timeout=1800)
        if p.returncode:
            raise SystemExit(f"{tree} failed:\n{err[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=("send", "recv"))
    ap.add_argument("--tree", choices=("before", "after"), default="after")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--model", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--memory", action="store_true")
    ap.add_argument("--before", default="481453f", help="the commit whose weight link is 'before'")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.role:
        role_main(args)
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    work = Path(tempfile.mkdtemp(prefix="bench-plane-"))
    old = work / "before-tree"
    old.mkdir()
    archive = subprocess.run(["git", "archive", args.before, "dschat"], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                      num_key_value_heads=args.hidden // 64, max_position_embeddings=512)
    path = str(work / "model")
    LlamaForCausalLM(cfg).save_pretrained(path)
    mb = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters()) * 4 / 1e6
    per_mb: dict[str, list[float]] = {"before": [], "after": []}
    for r in range(args.rounds):
        for tree in ("before", "after") if r % 2 == 0 else ("after", "before"):
            got = measure(tree, old if tree == "before" else ROOT, path, args.updates, False, work)
            per_mb[tree] += [s / (got["bytes"] / 1e6) for s in got["seconds"][1:] or got["seconds"]]
    mem = {tree: measure(tree, old if tree == "before" else ROOT, path, 1, True, work) for tree in ("before", "after")}
    b, a = statistics.median(per_mb["before"]), statistics.median(per_mb["after"])
    print(f"model: {mb:.0f} MB in fp32 ({args.hidden} hidden, {args.layers} layers); {args.rounds} rounds of "
          f"{args.updates} updates; trainer on core 0, sampler on core 1, gloo on loopback")
    print("| | before (weight link) | after (weight plane) | after / before |")
    print("|---|---|---|---|")
    print(f"| update, ms per MB (median) | {1000 * b:.2f} | {1000 * a:.2f} | {a / b:.2f} |")
    for key, what in (("held_count", "updates held while the sampler is busy (K = 2)"),
                      ("held_bytes", "bytes the weight path holds then, MB"),
                      ("rss_growth", "trainer RSS growth then, MB")):
        scale = 1 if key == "held_count" else 1e6
        x, y = mem["before"][key] / scale, mem["after"][key] / scale
        print(f"| {what} | {x:.0f} | {y:.0f} | {y / x if x else float('nan'):.2f} |")


if __name__ == "__main__":
    main()
