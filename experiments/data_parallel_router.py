"""Replicas behind a cache-aware router (issue 40 §2): `xlr serve --data-parallel 2` with
sglang-router's cache_aware policy against its round_robin, on serve_bench's agent workload,
the embedded model, this CPU.

Workloads, greedy and streamed, --agents agents at once (threads, a connection each), each
a conversation of --turns turns (a tool's output and a request, the reply appended):
  shared  the agents share one system prompt (~1.9k tokens: serve_bench's "agents"); their
          histories differ
  own     each agent has a system prompt of its own (four kinds of agent)
From the client, per turn: TTFT, prompt and cached tokens, the response id. From the
replicas' request logs (--request-log, one folder a replica), joined by that id: which
replica answered, and the stable and context tiers' tokens and cached tokens. Per policy
and workload: the stable- and context-tier hit rates of turns >= 2 (cached / prompt tokens
of the tier), turn-2 TTFT and the TTFT of turns >= 2 (medians over agents and rounds), the
turns that went to another replica than the agent's previous turn, requests per replica.

One warm-up server (round_robin) first answers both workloads on other system prompts, so
every step shape is compiled into the cache folder; then the measured servers, one at a
time, alternating policies over --rounds, each answering a warm-up conversation of its own
first. Every round's system prompts carry a fresh id: no stable tier an earlier server
wrote to the shared cache folder hits. The replicas share it, so a replica can restore
a stable tier another wrote (counted as cached, as a restarted server's would be).

On 2 cores the two replicas and the router share the CPU: this measures where requests
go and what that does to the prefix cache, not a speedup from the second replica.

Run: python experiments/data_parallel_router.py [--out experiments/results] [--quick]
(--quick: 2 agents, 2 turns, 4 tokens, one round; a smoke test, not a measurement)
"""
from __future__ import annotations

import argparse
import json
import secrets
import statistics
import tempfile
from collections import Counter
from pathlib import Path

from xlr_jax.bench.serving import (agent_system_prompt, httpx, on_threads, run_agent,
                                   xlr_server)

POLICIES = ("round_robin", "cache_aware")
WORKLOADS = ("shared", "own")


def run_workload(server, workload: str, tag: str, agents: range, turns: int,
                 max_tokens: int) -> list[dict]:
    """Every agent's conversation, all at once; a record per turn."""
    out = {}

    def agent(a: int):
        system = agent_system_prompt(f"{tag}" if workload == "shared" else f"{tag}-agent{a}")
        with httpx.Client(base_url=server.base_url, timeout=1800) as http:
            out[a] = run_agent(http, server.model, system, a, turns, max_tokens)

    on_threads(agent, agents)
    return [{"agent": a, "turn": t, "id": r["id"], "ttft_s": r["ttft_s"],
             "prompt_tokens": r["prompt_tokens"], "cached_tokens": r["cached_tokens"]}
            for a in agents for t, r in enumerate(out[a]["turns"])]


def replica_logs(folder: Path) -> dict[str, dict]:
    """Each request-log record by response id, with the replica that wrote it."""
    found = {}
    for path in sorted(folder.glob("replica-*/requests.jsonl")):
        replica = int(path.parent.name.split("-")[1])
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "id" in record:  # (not the router's probes of routes xlr serve has not)
                found[record["id"]] = {**record, "replica": replica}
    return found


def summarize(records: list[dict]) -> dict:
    later = [r for r in records if r["turn"] >= 1]

    def rate(tier: str) -> float | None:
        total = sum(r[f"{tier}_tokens"] for r in later)
        return sum(r[f"{tier}_cached_tokens"] for r in later) / total if total else None

    previous = {(r["agent"], r["turn"]): r["replica"] for r in records}
    moved = sum(previous[(r["agent"], r["turn"] - 1)] != r["replica"] for r in later)
    return {"stable_hit_rate": rate("stable"), "context_hit_rate": rate("context"),
            "cached_share": sum(r["cached_tokens"] for r in later)
            / max(1, sum(r["prompt_tokens"] for r in later)),
            "turn2_ttft_s": statistics.median(r["ttft_s"] for r in records if r["turn"] == 1),
            "later_ttft_s": statistics.median(r["ttft_s"] for r in later),
            "turns_moved": moved, "turns_after_first": len(later),
            "requests_per_replica": dict(sorted(Counter(r["replica"] for r in records).items()))}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="experiments/results", help="directory for the JSON")
    ap.add_argument("--agents", type=int, default=4, help="agents at once")
    ap.add_argument("--turns", type=int, default=4, help="turns of each conversation")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens per reply at most")
    ap.add_argument("--replicas", type=int, default=2, help="--data-parallel of each server")
    ap.add_argument("--rounds", type=int, default=2, help="servers of each policy, alternating")
    ap.add_argument("--cache-dir", help="xlr-jax's cache folder (default: a new temporary one)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one round")
    args = ap.parse_args(argv)
    if args.quick:
        args.agents, args.turns, args.max_tokens, args.rounds = 2, 2, 4, 1
    agents = range(1, args.agents + 1)

    from xlr_jax.bench.run import write_result

    records = {p: {w: [] for w in WORKLOADS} for p in POLICIES}
    with tempfile.TemporaryDirectory(prefix="xlr-dp-router-") as tmp:
        tmp = Path(tmp)
        cache = Path(args.cache_dir) if args.cache_dir else tmp / "cache"

        def start(name: str, policy: str):
            print(f"{name}: {args.replicas} replicas, router {policy}", flush=True)
            return xlr_server(cache, tmp / f"{name}.log", "--data-parallel",
                              str(args.replicas), "--router", policy, "--request-log",
                              str(tmp / name))

        server = start("warm-up", "round_robin")
        try:
            for workload in WORKLOADS:
                run_workload(server, workload, f"Warm-{secrets.token_hex(3)}", agents,
                             args.turns, args.max_tokens)
        finally:
            server.stop()
        for k in range(args.rounds):
            for policy in POLICIES if k % 2 == 0 else POLICIES[::-1]:
                name = f"{policy}-{k}"
                server = start(name, policy)
                try:
                    run_workload(server, "own", f"Pre-{secrets.token_hex(3)}", agents[:1],
                                 args.turns, args.max_tokens)
                    got = {w: run_workload(server, w, f"{w}-{secrets.token_hex(3)}", agents,
                                           args.turns, args.max_tokens) for w in WORKLOADS}
                finally:
                    server.stop()  # drained: the request logs are whole
                logs = replica_logs(tmp / name)
                for workload, turns in got.items():
                    for r in turns:
                        log = logs[r["id"]]
                        records[policy][workload].append(
                            {**r, "agent": f"{k}-{r['agent']}", "replica": log["replica"],
                             **{key: log[key] for key in (
                                 "stable_tokens", "stable_cached_tokens", "context_tokens",
                                 "context_cached_tokens")}})

    summary = {p: {w: summarize(records[p][w]) for w in WORKLOADS} for p in POLICIES}
    result = {"config": vars(args), "summary": summary, "records": records}
    path = write_result(args.out, "data_parallel_router", result, quick=args.quick)
    for workload in WORKLOADS:
        for policy in POLICIES:
            s = summary[policy][workload]
            print(f"{workload:>6} {policy:>11}: stable tier hit {s['stable_hit_rate']:.2f}, "
                  f"context hit {s['context_hit_rate']:.2f}, turn-2 TTFT "
                  f"{s['turn2_ttft_s'] * 1e3:.0f} ms, later TTFT "
                  f"{s['later_ttft_s'] * 1e3:.0f} ms, moved {s['turns_moved']}/"
                  f"{s['turns_after_first']}, per replica {s['requests_per_replica']}")
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
