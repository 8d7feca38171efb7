"""Serving benchmark (issue 16 §4): `xlr serve` beside llama.cpp's OpenAI server on the same
GGUF (the embedded SmolLM2-135M-Instruct Q4_1) and the same CPU, through HTTP, timed by the
client.

Workloads, all greedy and streamed:
  agent     one agent: a ~1.9k-token system prompt (rules and 8 tool schemas), then 8 turns, each
            a tool's output (~90 tokens) and a request, the reply appended to the history; TTFT,
            ITL and cached prompt tokens per turn. Through xlr serve, xlr serve
            --no-prefix-cache and llama.cpp.
  agents    --agents agents at once (threads), sharing another system prompt but not their
            histories: end-to-end time per conversation and of the whole. xlr serve,
            llama.cpp, and llama.cpp with its prompt-state cache (--cache True: it restores
            the saved state with the longest common prefix, so an agent's history is not
            prefilled again after another agent's turn).
  overhead  --rounds interleaved max_tokens=1 requests on one cached chat prompt, through the
            in-process API (`Model.chat`, in this process) and through xlr serve (a whole
            JSON response), alternating which goes first: the server's cost per request is
            the median of their differences.
  rates     a request-rate sweep: Poisson arrivals (seeded) at each --rates, over a local prompt
            set built here (short questions; passages of experiments/cpu_vs_transformers.toml
            with a question; one-off agent requests on the agent system prompt); TTFT and ITL
            p50/p99, throughput, prompt tokens found cached. xlr serve and llama.cpp.
The first xlr serve answers a warm-up (other system prompts and prompts: it compiles its step
shapes on first use and stores them under --cache-dir), then agents at once, the overhead and
the sweep. The one-agent runs, with and without the prefix cache, each start a fresh server on
that cache directory and measure at once, as a restarted server meets its first agent.
llama.cpp answers one short request first. Nothing measured shares a prefix with a warm-up
beyond the chat template; the system prompts carry a fresh run id, so no tier an earlier run
left in --cache-dir hits. Servers run one at a time. llama.cpp is `pip install
"llama-cpp-python[server]"`, started as `python -m llama_cpp.server --n_threads 2 --n_ctx 8192
--interrupt_requests False` (its default cuts off a streaming answer when the next request
comes); without it (or with --no-llama-cpp) its parts are skipped and the JSON says so.

Targets (issue 16 §4): agent turns >= 2 have TTFT >= 10x lower than with --no-prefix-cache
(median of the per-turn ratios); the server adds < 5 ms a request over the in-process API; with
4 agents at once, conversations end sooner than through llama.cpp, with and without its cache
(mean and slowest). Writes JSON and a PNG. Duration on a 2-core CPU: ~25 minutes.

Run: python experiments/serve_bench.py [--out experiments/results] [--quick] [--no-llama-cpp]
(--quick: 2 turns, 2 agents, 10 rounds, one rate of 4 requests, 4 tokens, no llama.cpp; a
smoke test, not a measurement)
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import secrets
import statistics
import tempfile
import time
import tomllib
from pathlib import Path

import numpy as np

from xlr_jax.bench.serving import (QUESTIONS, TURNS, ServerProcess, agent_system_prompt,
                                   httpx, llama_cpp_available, llama_cpp_server, on_threads,
                                   percentiles, run_agent, stream_chat, xlr_server)

PASSAGE = Path(__file__).with_name("cpu_vs_transformers.toml")  # its [prompt] passage


def prompt_set(n: int, seed: int, system: str) -> list[list[dict]]:
    """`n` chat prompts, a third each: a short question; a passage window (100-600 words)
    with a question on it; a one-off agent request on the system prompt `system`."""
    rng = np.random.default_rng(seed)
    words = tomllib.loads(PASSAGE.read_text())["prompt"]["passage"].split()
    prompts = []
    for i in range(n):
        question = QUESTIONS[int(rng.integers(len(QUESTIONS)))]
        if i % 3 == 0:
            prompts.append([{"role": "user", "content": question}])
        elif i % 3 == 1:
            size = int(rng.integers(100, 600))
            start = int(rng.integers(0, max(1, len(words) - size)))
            text = " ".join((words * (1 + size // len(words)))[start:start + size])
            prompts.append([{"role": "user", "content": f"{text}\n\nSummarize this in one "
                                                        "sentence."}])
        else:
            prompts.append([{"role": "system", "content": system},
                            {"role": "user", "content": TURNS[int(rng.integers(len(TURNS)))]}])
    return prompts


def agents_at_once(server: ServerProcess, system: str, agents: range, turns: int,
                   max_tokens: int, usage: bool) -> dict:
    """Each agent's conversation on its own thread and connection, all started together."""
    out = {}

    def agent(a: int):
        with httpx.Client(base_url=server.base_url, timeout=1800) as http:
            out[a] = run_agent(http, server.model, system, a, turns, max_tokens, usage)

    start = time.perf_counter()
    on_threads(agent, agents)
    ends = [out[a]["end_to_end_s"] for a in agents]
    return {"wall_s": time.perf_counter() - start, "end_to_end_mean_s": statistics.mean(ends),
            "end_to_end_max_s": max(ends), "conversations": [out[a] for a in agents]}


def rate_sweep(server: ServerProcess, prompts: list[list[dict]], rates: list[float],
               requests: int, max_tokens: int, usage: bool, seed: int) -> list[dict]:
    """At each rate, `requests` prompts (cycling through the set) sent at Poisson arrival
    times, a thread each; figures per rate."""
    levels = []
    gaps = np.random.default_rng(seed).exponential(1.0, requests)
    for rate in rates:
        arrivals = np.cumsum(gaps) / rate
        records = [None] * requests

        def send(i: int, t0: float):
            time.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
            with httpx.Client(base_url=server.base_url, timeout=1800) as http:
                records[i] = stream_chat(http, server.model, prompts[i % len(prompts)],
                                         max_tokens, usage)
                records[i]["done"] = time.perf_counter()

        t0 = time.perf_counter()
        on_threads(lambda i: send(i, t0), range(requests))
        span = max(r["done"] for r in records) - (t0 + arrivals[0])
        prompt_tokens = [r["prompt_tokens"] for r in records]
        cached = [r["cached_tokens"] for r in records]
        levels.append({
            "rate_per_s": rate, "requests": requests, "span_s": span,
            "completion_tokens": sum(r["completion_tokens"] for r in records),
            "throughput_tokens_per_s": sum(r["completion_tokens"] for r in records) / span,
            **percentiles([r["ttft_s"] for r in records], "ttft"),
            **percentiles([g for r in records for g in r["gaps_s"]], "itl"),
            **percentiles([r["latency_s"] for r in records], "latency"),
            "prompt_tokens": None if None in prompt_tokens else sum(prompt_tokens),
            "cached_prompt_fraction": None if None in cached + prompt_tokens
            else sum(cached) / sum(prompt_tokens)})
    return levels


def server_overhead(server: ServerProcess, cache_dir: Path, messages: list[dict],
                    rounds: int) -> dict:
    """Interleaved max_tokens=1 requests on one cached prompt: `Model.chat` in this process
    against a whole (non-streamed) response of the server, the order alternating."""
    import xlr_jax

    model = xlr_jax.load_model("smollm2", cache_dir=cache_dir)
    body = {"model": server.model, "messages": messages, "max_tokens": 1, "temperature": 0}

    def in_process() -> float:
        t = time.perf_counter()
        model.chat(messages, max_tokens=1)
        return time.perf_counter() - t

    def over_http() -> float:
        t = time.perf_counter()
        r = server.http.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        return time.perf_counter() - t

    try:
        for _ in range(3):  # both prefill the prompt, then find it cached
            in_process(), over_http()
        api, http = [], []
        for i in range(rounds):
            if i % 2:
                http.append(over_http())
                api.append(in_process())
            else:
                api.append(in_process())
                http.append(over_http())
    finally:
        model.shutdown()
    diffs = [h - a for h, a in zip(http, api)]
    return {"rounds": rounds, "in_process_p50_s": statistics.median(api),
            "http_p50_s": statistics.median(http), "difference_p50_s": statistics.median(diffs),
            **percentiles(diffs, "difference"), "in_process_s": api, "http_s": http}


def ttft_ratio(off: dict, on: dict) -> float:
    """Median over turns >= 2 of the per-turn TTFT ratio off/on."""
    return statistics.median(a["ttft_s"] / b["ttft_s"]
                             for a, b in zip(off["turns"][1:], on["turns"][1:]))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, run in result["agent"].items():
        ttft = [t["ttft_s"] * 1e3 for t in run["turns"]]
        a1.semilogy(range(1, len(ttft) + 1), ttft, marker="o", label=name)
    a1.set(xlabel="turn", ylabel="TTFT (ms, log)", title="one agent")
    servers = list(result["agents"])
    width = 0.8 / len(servers)
    for k, name in enumerate(servers):
        ends = [c["end_to_end_s"] for c in result["agents"][name]["conversations"]]
        a2.bar(np.arange(len(ends)) + width * (k - (len(servers) - 1) / 2), ends, width=width,
               label=name)
    agents = result["config"]["agents"]
    a2.set(xlabel="conversation", ylabel="end to end (s)", title=f"{agents} agents at once",
           xticks=range(agents), xticklabels=range(1, agents + 1))
    for k, (name, levels) in enumerate(result["rates"].items()):
        rates, color = [f["rate_per_s"] for f in levels], f"C{k}"
        a3.plot(rates, [f["ttft_p50_s"] for f in levels], marker="o", color=color,
                label=f"{name} p50")
        a3.plot(rates, [f["ttft_p99_s"] for f in levels], marker="^", ls="--", color=color,
                label=f"{name} p99")
    a3.set(xlabel="requests / s", ylabel="TTFT (s)", title="request-rate sweep", yscale="log")
    for ax in (a1, a2, a3):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct (Q4_1 GGUF) on this CPU, client-side timings")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="experiments/results", help="directory for JSON and PNG")
    ap.add_argument("--turns", type=int, default=8, help="turns of each agent conversation")
    ap.add_argument("--agents", type=int, default=4, help="agents at once")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per reply at most")
    ap.add_argument("--rounds", type=int, default=200, help="overhead rounds (each server's)")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0],
                    help="request rates of the sweep (per second)")
    ap.add_argument("--requests", type=int, default=24, help="requests per rate")
    ap.add_argument("--seed", type=int, default=0, help="the sweep's arrivals and prompts")
    ap.add_argument("--cache-dir", help="xlr-jax's cache folder (default: a new temporary one)")
    ap.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp's server")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, no llama.cpp")
    args = ap.parse_args(argv)
    if args.quick:
        args.turns, args.agents, args.max_tokens, args.rounds = 2, 2, 4, 10
        args.rates, args.requests, args.no_llama_cpp = [2.0], 4, True
    agents = range(1, args.agents + 1)
    run_id = secrets.token_hex(3)  # tiers an earlier run left on disk must not hit

    def system(variant: str) -> str:
        return agent_system_prompt(f"{variant}-{run_id}")
    llama = None if args.no_llama_cpp else llama_cpp_available()

    from xlr_jax.bench.run import write_result

    result = {"agent": {}, "agents": {}, "rates": {}}
    with tempfile.TemporaryDirectory(prefix="xlr-serve-bench-") as tmp:
        tmp = Path(tmp)
        cache = Path(args.cache_dir) if args.cache_dir else tmp / "cache"

        def warm_up(server: ServerProcess) -> None:  # every step shape the parts use
            with httpx.Client(base_url=server.base_url, timeout=1800) as http:
                run_agent(http, server.model, system("Athena"), 0, args.turns,
                          args.max_tokens, True)
            agents_at_once(server, system("Selene"), agents, args.turns, args.max_tokens, True)
            rate_sweep(server, prompt_set(args.requests, args.seed + 1, system("Warm")),
                       args.rates[-1:], args.requests, args.max_tokens, True, args.seed + 1)

        def measure(name: str, server: ServerProcess, usage: bool,
                    parts=("agent", "agents", "rates")) -> None:
            if "agent" in parts:
                with httpx.Client(base_url=server.base_url, timeout=1800) as http:
                    result["agent"][name] = run_agent(http, server.model, system("Hermes"), 0,
                                                      args.turns, args.max_tokens, usage)
            if "agents" in parts:
                result["agents"][name] = agents_at_once(server, system("Iris"), agents,
                                                        args.turns, args.max_tokens, usage)
            if "rates" in parts:
                prompts = prompt_set(args.requests, args.seed, system("Agent"))
                result["rates"][name] = rate_sweep(server, prompts, args.rates, args.requests,
                                                   args.max_tokens, usage, args.seed)

        print("xlr serve: warm-up, agents at once, overhead, rate sweep", flush=True)
        server = xlr_server(cache, tmp / "xlr.log")
        try:
            warm_up(server)
            measure("xlr-jax", server, True, parts=("agents", "rates"))
            result["overhead"] = server_overhead(
                server, cache, [{"role": "system", "content": system("Overhead")},
                                {"role": "user", "content": TURNS[0]}], args.rounds)
        finally:
            server.stop()
        # one agent in fresh processes, as a restarted server meets it: the steps the
        # first server compiled are on disk, nothing else is warm
        for name, flags in (("xlr-jax", ()), ("xlr-jax --no-prefix-cache", ("--no-prefix-cache",))):
            print(f"{name}: a fresh server, one agent", flush=True)
            server = xlr_server(cache, tmp / f"{name.split()[-1]}.log", *flags)
            try:
                measure(name, server, True, parts=("agent",))
            finally:
                server.stop()
        if llama:
            print("llama.cpp server: warm-up, agent, agents at once, rate sweep", flush=True)
            server = llama_cpp_server(tmp / "llama.log")
            try:
                stream_chat(server.http, server.model, [{"role": "user", "content": "Hi."}],
                            args.max_tokens, usage=False)
                measure("llama.cpp", server, False)
            finally:
                server.stop()
            print("llama.cpp server --cache True: agents at once", flush=True)
            server = llama_cpp_server(tmp / "llama-cache.log", "--cache", "True")
            try:
                stream_chat(server.http, server.model, [{"role": "user", "content": "Hi."}],
                            args.max_tokens, usage=False)
                measure("llama.cpp --cache", server, False, parts=("agents",))
            finally:
                server.stop()

    on, off = result["agent"]["xlr-jax"], result["agent"]["xlr-jax --no-prefix-cache"]
    overhead_ms = result["overhead"]["difference_p50_s"] * 1e3
    targets = {"turn_2_plus_ttft_off_over_on": {"value": ttft_ratio(off, on), "min": 10.0},
               "server_overhead_ms": {"value": overhead_ms, "max": 5.0}}
    mine = result["agents"]["xlr-jax"]
    for name in ("llama.cpp", "llama.cpp --cache") if llama else ():
        theirs, key = result["agents"][name], name.replace(".", "_").replace(" --", "_")
        targets[f"agents_end_to_end_mean_over_{key}"] = {
            "value": mine["end_to_end_mean_s"] / theirs["end_to_end_mean_s"], "max": 1.0}
        targets[f"agents_end_to_end_max_over_{key}"] = {
            "value": mine["end_to_end_max_s"] / theirs["end_to_end_max_s"], "max": 1.0}
    for t in targets.values():
        t["pass"] = bool(t["value"] <= t["max"] if "max" in t else t["value"] >= t["min"])
    result = {"config": {"turns": args.turns, "agents": args.agents,
                         "max_tokens": args.max_tokens, "rounds": args.rounds,
                         "rates_per_s": args.rates, "requests_per_rate": args.requests,
                         "seed": args.seed},
              "llama_cpp": f"llama-cpp-python {importlib.metadata.version('llama-cpp-python')}"
              if llama else
              ("skipped: --no-llama-cpp" if args.no_llama_cpp else
               "skipped: llama-cpp-python[server] is not installed"),
              **result, "targets": targets}
    path = write_result(args.out, "serve_bench", result, args.quick)
    plot(result, path.with_suffix(".png"))
    print(f"{'turn':>4}" + "".join(f"{name:>28}" for name in result["agent"]))
    for i in range(args.turns):
        print(f"{i + 1:>4}" + "".join(f"{run['turns'][i]['ttft_s'] * 1e3:>25.0f} ms"
                                      for run in result["agent"].values()))
    for name, run in result["agents"].items():
        print(f"{args.agents} agents, {name}: end to end mean {run['end_to_end_mean_s']:.1f} s, "
              f"slowest {run['end_to_end_max_s']:.1f} s")
    for name, levels in result["rates"].items():
        for f in levels:
            print(f"{name:>10} {f['rate_per_s']:5.2f}/s  {f['throughput_tokens_per_s']:6.1f} "
                  f"tok/s  TTFT p50 {f['ttft_p50_s']:.3f} p99 {f['ttft_p99_s']:.3f} s  "
                  f"ITL p50 {f['itl_p50_s'] or 0:.3f} p99 {f['itl_p99_s'] or 0:.3f} s")
    print(json.dumps({"out": str(path), **{k: (v["value"], v["pass"])
                                          for k, v in targets.items()}}))
    return json.loads(path.read_text())


if __name__ == "__main__":
    main()
