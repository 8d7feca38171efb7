"""`xlr serve` under load: streaming clients against the HTTP server, and the event loop's
largest stall (issue 14 §4).

Two server processes on one cache directory, one after the other: the first compiles and
stores every step shape the workload needs (the whole workload run once, then SIGTERM); the
second, measured one starts warm, as a restarted server would. Against it, at each concurrency level,
C client threads each send R streaming chat completions one after another (greedy, at most
--max-tokens tokens, over 16 short prompts), timing on the client side: TTFT (request sent to
the first content chunk), every gap between content chunks (ITL), and completion tokens from
the usage chunk. After each level the server's /health reports its event loop's largest stall
since it started (how late a 50 ms sleep woke up: time the loop spent not serving sockets).

Per level: throughput (completion tokens / wall time of the level), TTFT and ITL p50/p99, and
the stall so far. The stall is the figure of interest: tokenization and chat templating run
in a worker pool and the engine on its own thread, so it should stay in the tens of ms.

Run: python experiments/serve_load.py [--out experiments/results] [--clients 1 8 32]
     [--requests 2] [--max-tokens 32] [--cache-dir DIR]
(--quick: levels 1 and 4, one request each, 4 tokens; a smoke test, not a measurement)
"""
from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

try:
    import httpx
except ImportError:  # the openai client's own HTTP library, where it is httpx2
    import httpx2 as httpx

PROMPTS = [f"{ask} {topic}." for ask in ("Explain briefly", "Give one fact about",
                                        "Write a short line on", "Name a use of")
           for topic in ("the Moon", "rivers", "bread", "prime numbers")]


class Server:
    """An `xlr serve` subprocess on a free loopback port."""

    def __init__(self, cache_dir: Path, log: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "xlr_jax.cli", "serve", "--port", str(self.port),
             "--cache-dir", str(cache_dir), "--max-waiting", "256"],
            stdout=subprocess.DEVNULL, stderr=log.open("w"))
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=600)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"xlr serve exited:\n{log.read_text()[-3000:]}")
            try:
                if self.http.get("/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.5)
        raise SystemExit("xlr serve did not come up within 600 s")

    def stall(self) -> float:
        return self.http.get("/health").json()["event_loop_max_stall_s"]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(120)


def stream_one(http, prompt: str, max_tokens: int) -> dict:
    """One streaming chat completion; client-side TTFT, content-chunk gaps and tokens."""
    body = {"model": "smollm2", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    arrivals, tokens = [], 0
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if event["choices"] and event["choices"][0]["delta"].get("content"):
                arrivals.append(time.perf_counter())
    return {"ttft_s": arrivals[0] - sent if arrivals else None,
            "gaps_s": list(np.diff(arrivals)), "completion_tokens": tokens}


def level(server: Server, clients: int, requests: int, max_tokens: int) -> dict:
    """C clients, each sending R requests in turn; figures over all of them."""
    records, lock = [], threading.Lock()

    def client(c: int):
        with httpx.Client(base_url=server.http.base_url, timeout=600) as http:
            for k in range(requests):
                r = stream_one(http, PROMPTS[(c * requests + k) % len(PROMPTS)], max_tokens)
                with lock:
                    records.append(r)

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ttft = [r["ttft_s"] for r in records if r["ttft_s"] is not None]
    gaps = [g for r in records for g in r["gaps_s"]]
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else None  # noqa: E731
    return {"clients": clients, "requests": len(records), "wall_s": wall,
            "throughput_tokens_per_s": sum(r["completion_tokens"] for r in records) / wall,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "itl_p50_s": pct(gaps, 50), "itl_p99_s": pct(gaps, 99),
            "event_loop_max_stall_s": server.stall()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="experiments/results", help="directory for the JSON")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32],
                    help="concurrency levels")
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per answer at most")
    ap.add_argument("--cache-dir", default=None,
                    help="xlr-jax cache directory (default: a fresh temporary one)")
    ap.add_argument("--quick", action="store_true", help="levels 1 and 4, tiny answers")
    args = ap.parse_args(argv)
    if args.quick:
        args.clients, args.requests, args.max_tokens = [1, 4], 1, 4

    from xlr_jax.bench.run import write_result

    with tempfile.TemporaryDirectory(prefix="xlr-serve-load-") as tmp:
        tmp = Path(tmp)
        cache = Path(args.cache_dir) if args.cache_dir else tmp / "cache"
        warm = Server(cache, tmp / "warm.log")  # compiles and stores every shape used
        try:
            for c in args.clients:
                level(warm, c, args.requests, args.max_tokens)
        finally:
            warm.stop()
        server = Server(cache, tmp / "measured.log")
        try:
            startup_stall = server.stall()
            levels = [level(server, c, args.requests, args.max_tokens) for c in args.clients]
        finally:
            server.stop()
    result = {"what": "streaming chat clients against xlr serve (warm start); client-side "
                      "TTFT and chunk gaps; the server's event-loop stall",
              "config": {"clients": args.clients, "requests_per_client": args.requests,
                         "max_tokens": args.max_tokens, "prompts": len(PROMPTS)},
              "startup_event_loop_max_stall_s": startup_stall, "levels": levels}
    path = write_result(args.out, "serve_load", result, args.quick)
    for f in levels:
        print(f"clients {f['clients']:3d}  {f['throughput_tokens_per_s']:6.1f} tok/s  "
              f"TTFT p50 {f['ttft_p50_s']:.3f} p99 {f['ttft_p99_s']:.3f} s  "
              f"ITL p50 {f['itl_p50_s'] or 0:.3f} p99 {f['itl_p99_s'] or 0:.3f} s  "
              f"loop stall so far {f['event_loop_max_stall_s'] * 1e3:.0f} ms")
    print(json.dumps({"out": str(path)}))
    return json.loads(path.read_text())


if __name__ == "__main__":
    main()
