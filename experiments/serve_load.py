"""`xlr serve` under load: streaming clients against the HTTP server, and the event loop's
largest stall (issue 14 §4).

Two server processes on one cache directory, one after the other: the first compiles and
stores every step shape the workload needs (the whole workload run once, then SIGTERM); the
second, measured one starts warm, as a restarted server would. Against it, at each concurrency level,
C client threads each send R streaming chat completions one after another (greedy, at most
--max-tokens tokens, over 24 short prompts), timing on the client side: TTFT (request sent to
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
import tempfile
import threading
import time
from pathlib import Path

from xlr_jax.bench.serving import (QUESTIONS, ServerProcess, httpx, on_threads, percentiles,
                                   stream_chat, xlr_server)



def serve(cache_dir: Path, log: Path) -> ServerProcess:
    return xlr_server(cache_dir, log, "--max-waiting", "256")


def stall(server: ServerProcess) -> float:
    return server.get("/health")["event_loop_max_stall_s"]


def level(server: ServerProcess, clients: int, requests: int, max_tokens: int) -> dict:
    """C clients, each sending R requests in turn; figures over all of them."""
    records, lock = [], threading.Lock()

    def client(c: int):
        with httpx.Client(base_url=server.base_url, timeout=600) as http:
            for k in range(requests):
                messages = [{"role": "user",
                             "content": QUESTIONS[(c * requests + k) % len(QUESTIONS)]}]
                r = stream_chat(http, server.model, messages, max_tokens)
                with lock:
                    records.append(r)

    start = time.perf_counter()
    on_threads(client, range(clients))
    wall = time.perf_counter() - start
    return {"clients": clients, "requests": len(records), "wall_s": wall,
            "throughput_tokens_per_s": sum(r["completion_tokens"] for r in records) / wall,
            **percentiles([r["ttft_s"] for r in records], "ttft"),
            **percentiles([g for r in records for g in r["gaps_s"]], "itl"),
            "event_loop_max_stall_s": stall(server)}


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
        warm = serve(cache, tmp / "warm.log")  # compiles and stores every shape used
        try:
            for c in args.clients:
                level(warm, c, args.requests, args.max_tokens)
        finally:
            warm.stop()
        server = serve(cache, tmp / "measured.log")
        try:
            startup_stall = stall(server)
            levels = [level(server, c, args.requests, args.max_tokens) for c in args.clients]
        finally:
            server.stop()
    result = {"what": "streaming chat clients against xlr serve (warm start); client-side "
                      "TTFT and chunk gaps; the server's event-loop stall",
              "config": {"clients": args.clients, "requests_per_client": args.requests,
                         "max_tokens": args.max_tokens, "prompts": len(QUESTIONS)},
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
