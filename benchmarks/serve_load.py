"""Load test of ``dschat serve`` on 127.0.0.1: concurrent clients posting ``/score`` for a bounded time; then a
small request's latency while four bodies of 8 MB over ``--max-request-tokens`` are parsed (their senders waiting
for the 413, then leaving early); then a burst of connections past ``--max-connections``. Run by hand; the
figures go to docs/serving.md with the commit and machine.

    python benchmarks/serve_load.py --reward-model out/step2/model --clients 16 --seconds 60
    python benchmarks/serve_load.py --url http://127.0.0.1:8000/score --clients 16 --seconds 60   (a running server)

Without ``--url`` it starts ``dschat serve`` in a child process (the tiny preset with a seeded head when no
``--reward-model`` is given), so the server's RSS can be sampled. Every request carries rows whose scores are
known (one request scored alone first); a reply is checked against them, so a request answered with another's
scores, twice or not at all shows up as ``mismatched`` or ``errors``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORDS = "the quick brown fox jumps over a lazy dog while rain falls on quiet hills near the old river".split()


def request_rows(k: int, rows: int) -> dict[str, Any]:
    """Request ``k``: ``rows`` prompt/answer pairs of lengths varying with ``k`` (so packs mix widths)."""
    prompts = [f"Human: question {k}.{i}: " + " ".join(WORDS[: 3 + (k * 7 + i) % 12]) + "\nAssistant:"
               for i in range(rows)]
    answers = [" " + " ".join(WORDS[(k + i) % 5:][: 2 + (k * 3 + i * 5) % 14]) for i in range(rows)]
    return {"prompts": prompts, "completions": answers, "ended": [(k + i) % 3 != 0 for i in range(rows)]}


def post(url: str, body: dict[str, Any], timeout: float = 120, token: str | None = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, None


def run_load(url: str, clients: int = 16, seconds: float = 60.0, rows: int = 8, kinds: int = 32,
             max_requests: int = 100_000) -> dict[str, Any]:
    """``clients`` threads posting for ``seconds`` (at most ``max_requests`` in all): throughput, latency
    percentiles and the count of errors and of replies whose scores differ from the request's own."""
    expected = {}
    for k in range(kinds):  # each request kind scored alone first: the reference a packed reply must equal
        status, reply = post(url, request_rows(k, rows))
        if status != 200:
            raise SystemExit(f"{url}: HTTP {status} on the reference request")
        expected[k] = reply["scores"]
    latencies: list[float] = []
    errors, mismatched, sent = 0, 0, 0
    lock = threading.Lock()
    stop = time.perf_counter() + seconds

    def client(c: int) -> None:
        nonlocal errors, mismatched, sent
        n = 0
        while time.perf_counter() < stop:
            with lock:
                if sent >= max_requests:
                    return
                sent += 1
            k = (c * 11 + n) % kinds
            n += 1
            t0 = time.perf_counter()
            try:
                status, reply = post(url, request_rows(k, rows))
            except OSError:
                status, reply = -1, None
            dt = time.perf_counter() - t0
            with lock:
                if status != 200:
                    errors += 1
                elif reply["scores"] != expected[k]:
                    mismatched += 1
                else:
                    latencies.append(dt)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    wall = time.perf_counter() - t0
    lat = sorted(latencies)

    def pct(p: float) -> float:
        return lat[min(len(lat) - 1, int(p * len(lat)))] * 1000 if lat else float("nan")

    return {"clients": clients, "seconds": round(wall, 1), "requests": sent, "ok": len(lat), "errors": errors,
            "mismatched": mismatched, "requests_per_s": round(len(lat) / wall, 1),
            "rows_per_s": round(len(lat) * rows / wall, 1), "p50_ms": round(pct(0.5), 1),
            "p99_ms": round(pct(0.99), 1), "mean_ms": round(statistics.fmean(lat) * 1000, 1) if lat else None}


def status_of(url: str, body: dict[str, Any], timeout: float = 120) -> str:
    """The HTTP status of a POST as text, or ``none`` when the connection ended without one."""
    try:
        return str(post(url, body, timeout)[0])
    except (OSError, ValueError):
        return "none"


def burst(url: str, requests: int, rows: int) -> dict[str, int]:
    """``requests`` posted at once (past the queue bound and the connection bound): how many got each status,
    ``none`` counting connections closed with no status at all."""
    with ThreadPoolExecutor(requests) as pool:
        codes = list(pool.map(lambda k: status_of(url, request_rows(k, rows)), range(requests)))
    return {code: codes.count(code) for code in sorted(set(codes))}


def overcap_body(max_body_bytes: int = 8_000_000, rows: int = 1024) -> bytes:
    """A body just under ``max_body_bytes`` of ``rows`` long prompts: within the body and row bounds, far over the
    default ``--max-request-tokens`` (each row is cut to ``--max-seq-len``: 1024 x 512 tokens)."""
    per_row = (max_body_bytes - 200) // rows - 40
    text = (" ".join(WORDS) + " ") * (per_row // (len(" ".join(WORDS)) + 1) + 1)
    body = {"prompts": ["Human: " + text[:per_row - 20] + "\nAssistant:"] * rows, "completions": [" ok"] * rows}
    raw = json.dumps(body).encode()
    assert len(raw) <= max_body_bytes, len(raw)
    return raw


def send_raw(url: str, raw: bytes, leave_after: float | None, timeout: float = 300) -> str:
    """POST ``raw``; read the status line, or (``leave_after``) close the connection that many seconds after
    sending, without reading."""
    host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(raw) + raw)
        if leave_after is not None:
            time.sleep(leave_after)
            return "left"
        head = sock.recv(64)
    return head[9:12].decode() if head.startswith(b"HTTP/1.1 ") else "none"


def small_latency_during(url: str, rows: int, work: Any, settle: float = 0.0) -> dict[str, Any]:
    """A small request posted over and over (one at a time) while ``work()`` runs, and ``settle`` seconds after:
    the latency percentiles, and what ``work`` returned."""
    lat: list[float] = []
    codes: list[int] = []
    stop = threading.Event()

    def probe() -> None:
        k = 0
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                status, _ = post(url, request_rows(k % 32, rows), timeout=60)
            except OSError:
                status = -1
            lat.append(time.perf_counter() - t0)
            codes.append(status)
            k += 1
            time.sleep(0.02)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    t0 = time.perf_counter()
    result = work()
    took = time.perf_counter() - t0
    time.sleep(settle)
    stop.set()
    prober.join(120)
    ordered = sorted(lat)

    def pct(p: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(p * len(ordered)))] * 1000, 1) if ordered else float("nan")

    return {"work_s": round(took, 1), "result": result, "small_requests": len(lat),
            "small_not_200": sum(c != 200 for c in codes), "small_p50_ms": pct(0.5), "small_p99_ms": pct(0.99),
            "small_max_ms": round(max(lat) * 1000, 1) if lat else None}


def overcap(url: str, bodies: int = 4, rows: int = 8, leave_after: float = 1.0,
            settle: float = 5.0) -> dict[str, Any]:
    """``bodies`` over-cap 8 MB requests at once, twice: first their senders wait for their answers (413), then
    they leave ``leave_after`` seconds after sending; a small request's latency meanwhile (and ``settle`` seconds
    after the second round, while nothing is left to do: the parsing of a sender that left stops)."""
    raw = overcap_body()

    def round_of(leave: float | None) -> Any:
        def work() -> list[str]:
            with ThreadPoolExecutor(bodies) as pool:
                return list(pool.map(lambda _: send_raw(url, raw, leave), range(bodies)))
        return work

    return {"body_bytes": len(raw),
            "senders_wait": small_latency_during(url, rows, round_of(None)),
            "senders_leave": small_latency_during(url, rows, round_of(leave_after), settle)}


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="", help="a running server's /score (default: start one)")
    ap.add_argument("--reward-model", default="", help="served reward model (default: tiny, seeded head)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--rows", type=int, default=8, help="completions per request")
    ap.add_argument("--max-requests", type=int, default=100_000)
    ap.add_argument("--max-queue", type=int, default=32, help="the started server's --max-queue")
    ap.add_argument("--burst", type=int, default=150, help="requests posted at once at the end")
    ap.add_argument("--overcap", type=int, default=4, help="over-cap 8 MB bodies at once (0: skip that part)")
    ap.add_argument("--port", type=int, default=8765)
    args = ap.parse_args()
    proc = None
    url = args.url
    if not url:
        model = args.reward_model
        if not model:
            sys.path.insert(0, str(ROOT / "tests"))
            from tests.dschat.serving_fixtures import save_tiny_reward_model

            model = str(save_tiny_reward_model(Path(tempfile.mkdtemp(prefix="serve-load-")) / "rm"))
        proc = subprocess.Popen([sys.executable, "-c", "from dschat.cli.main import cli; cli()", "serve",
                                 "--reward-model", model, "--port", str(args.port), "--max-queue",
                                 str(args.max_queue)], cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        url = f"http://127.0.0.1:{args.port}/score"
        deadline = time.time() + 300
        while True:
            try:
                with urllib.request.urlopen(url.rsplit("/", 1)[0] + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.time() > deadline or proc.poll() is not None:
                raise SystemExit("the server did not come up")
            time.sleep(0.5)
    try:
        samples: list[float] = []
        sampling = threading.Event()

        def sample() -> None:
            while proc is not None and not sampling.wait(1.0):
                samples.append(rss_mib(proc.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        report = run_load(url, args.clients, args.seconds, args.rows, max_requests=args.max_requests)
        sampling.set()
        sampler.join()
        if samples:
            tenth = max(1, len(samples) // 10)
            report["rss_mib_first_10pct"] = round(statistics.fmean(samples[:tenth]), 1)
            report["rss_mib_last_10pct"] = round(statistics.fmean(samples[-tenth:]), 1)
        if args.overcap:
            report["overcap"] = overcap(url, args.overcap, args.rows)
        report["burst"] = burst(url, args.burst, args.rows)
        report["alive_after_burst"] = post(url, request_rows(0, args.rows))[0] == 200
        print(json.dumps(report, indent=1))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    main()
