"""Start-up cost of the CLI, the server and a restarted agent, in fresh processes (issue 12,
section 4; issue 36, target 5).

Every figure is taken from a new process, as a user meets it:
  generate, cold  `xlr generate --chat PROMPT --json` on an empty cache directory and an
                  empty kernels directory, as on a fresh install: the CPU kernels are built,
                  the GGUF is parsed and converted, every step compiled (median of
                  --repeats, each on its own empty directories)
  generate, warm  the same command run again on the first cold run's directory, no warm-up
                  step: wall time, TTFT, decode rate; the overhead is the wall time minus the
                  decode time at the in-process rate (completion tokens - 1 over that rate)
  in-process      the decode rate of the same request in one process that already ran it
  agent           the prefix cache's warm start: a process runs the first turn of the agent
                  conversation of experiments/prefix_cache_agent.py (its stable tier goes to
                  disk), then fresh processes run that first turn with no warm-up turns
  chat            `xlr chat` fed short messages: TTFT of each turn, in processes started after
                  a first `xlr chat` session with the same messages (on the warm directory)
  kv pool         the time to allocate (zero-fill) the KV pool the default plan sizes, and the
                  one `xlr generate` sizes to its request (median of 3, compile excluded)
  serve           `xlr serve` started on the warm directory (a server has run there once):
                  seconds until /health answers 200
Targets (issue 12): warm overhead <= 1.5 s, warm TTFT <= 150 ms, warm decode >= 0.9x the
in-process rate, cold wall <= 20 s, agent warm-start first-turn TTFT <= 0.5 s, chat turns 2+
TTFT <= 150 ms. Issue 36: the first answer after install (the cold wall) <= 30 s, every
later `xlr generate` <= 3 s beyond its decode time (the warm overhead), `xlr serve` ready
in <= 5 s on a warm cache. The JSON's environment holds the CPU's flags and whether the
CPU kernels ran.

Run: python experiments/startup.py --out experiments/results/ [--repeats 3] [--quick]
(--quick: one repeat, short answers and a short agent prompt; a smoke test, not a measurement)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from xlr_jax.bench.serving import TURNS, agent_system_prompt, xlr_server

PROMPT = "Give me three facts about the Moon."
CHAT_TURNS = ["Hi!", "What is the capital of France?", "Thanks, and of Italy?"]
AGENT_LOAD = dict(max_context=4096, max_batch=1)  # as prefix_cache_agent.py loads it


def _run(cmd: list[str], stdin: str | None = None,
         env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, input=stdin, timeout=1800,
                         env=None if env is None else {**os.environ, **env})
    wall = time.perf_counter() - start
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed:\n{out.stderr[-3000:]}")
    return out, wall


def _xlr(*args: str) -> list[str]:
    return [sys.executable, "-m", "xlr_jax.cli", *args]


def generate(model: str, cache_dir: str, max_tokens: int | None,
             kernel_dir: str | None = None) -> dict:
    """One `xlr generate --chat` process: its wall time and what it reports (`kernel_dir`:
    its CPU kernels' directory, else the experiment's)."""
    limit = ["--max-tokens", str(max_tokens)] if max_tokens else []
    out, wall = _run(_xlr("generate", "--chat", "--json", "--model", model,
                          "--cache-dir", cache_dir, *limit, PROMPT),
                     env=kernel_dir and {"XLR_KERNEL_DIR": kernel_dir})
    r = json.loads(out.stdout)
    return {"wall_s": wall, "load_s": r["load"]["load_s"], "load": r["load"],
            "max_context": r["max_context"], "kv_pages": r["kv_pages"],
            "ttft_s": r["metrics"]["ttft_s"],
            "decode_tokens_per_s": r["metrics"]["decode_tokens_per_s"],
            "completion_tokens": r["metrics"]["completion_tokens"], "token_ids": r["token_ids"]}


def chat(model: str, cache_dir: str, max_tokens: int | None) -> dict:
    limit = ["--max-tokens", str(max_tokens)] if max_tokens else []
    out, wall = _run(_xlr("chat", "--model", model, "--cache-dir", cache_dir, *limit),
                     stdin="\n".join(CHAT_TURNS) + "\n/exit\n")
    ttft = [float(ms) / 1e3 for ms in re.findall(r"TTFT (\d+) ms", out.stderr)]
    if len(ttft) != len(CHAT_TURNS):
        raise SystemExit(f"xlr chat reported {len(ttft)} turns:\n{out.stderr[-3000:]}")
    return {"wall_s": wall, "ttft_s": ttft}


# ---------------------------------------------------------------- child processes

def in_process(model: str, cache_dir: str, max_tokens: int | None, repeats: int) -> dict:
    """The decode rate of the generate request in a process that already ran it."""
    import xlr_jax

    m = xlr_jax.load_model(model, cache_dir=cache_dir)
    prompt = m.chat_prompt([{"role": "user", "content": PROMPT}])
    kwargs = {"max_tokens": max_tokens} if max_tokens else {}
    m.generate(prompt, **kwargs)
    runs = [m.generate(prompt, **kwargs).metrics for _ in range(repeats)]
    return {"decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in runs),
            "ttft_s": statistics.median(r["ttft_s"] for r in runs)}


def agent_turn(model: str, cache_dir: str, max_tokens: int, quick: bool) -> dict:
    """The agent conversation's first turn in this (fresh) process, no warm-up."""
    import xlr_jax

    start = time.perf_counter()
    m = xlr_jax.load_model(model, cache_dir=cache_dir, **AGENT_LOAD)
    load_s = time.perf_counter() - start
    system = agent_system_prompt("Hermes")[:600 if quick else None]
    r = m.chat([{"role": "system", "content": system}, {"role": "user", "content": TURNS[0]}],
               max_tokens=max_tokens)
    m.engine.kv.flush()  # the next process must find the tier on disk
    return {"load_s": load_s, "ttft_s": r.metrics["ttft_s"],
            "prompt_tokens": r.metrics["prompt_tokens"],
            "cached_tokens": r.metrics["cached_tokens"], "token_ids": r.token_ids}


def kv_pool(model: str, cache_dir: str, one_shot_context: int) -> dict:
    """Seconds to create the KV pool of the default plan and of the one-shot plan."""
    import jax

    from xlr_jax import Workload, plan, probe
    from xlr_jax.kv.paged_kv import PagedKV
    from xlr_jax.loading.registry import resolve_model
    from xlr_jax.loading.weights import open_source

    config = open_source(resolve_model(model), cache_dir).config
    out = {}
    for name, context in (("default", None), ("one_shot", one_shot_context)):
        p = plan(probe(), config, Workload(max_context=context))
        create = lambda: jax.block_until_ready(PagedKV.create(  # noqa: E731
            num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim, num_pages=p.num_pages, page_size=p.page_size,
            dtype=p.kv_dtype))
        create()  # compiles the fill; what follows times the allocation alone
        times = []
        for _ in range(3):
            start = time.perf_counter()
            create()
            times.append(time.perf_counter() - start)
        out[name] = {"num_pages": p.num_pages, "bytes": p.num_pages * p.memory.page_bytes,
                     "create_s": statistics.median(times)}
    return out


def _child(kind: str, *args: str) -> dict:
    out, wall = _run([sys.executable, __file__, "--child", kind, *args])
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "wall_s": wall}


# ---------------------------------------------------------------- the experiment

def _target(value, limit, at_most=True) -> dict:
    ok = value <= limit if at_most else value >= limit
    return {"value": value, "max" if at_most else "min": limit, "pass": bool(ok)}


def serve_ready(cache_dir: str, log: Path) -> float:
    """Seconds from starting `xlr serve` on `cache_dir` until /health answers 200."""
    start = time.perf_counter()
    server = xlr_server(Path(cache_dir), log)
    ready = time.perf_counter() - start
    server.stop()
    return ready


def measure(model: str, repeats: int, max_tokens: int | None, quick: bool, root: Path) -> dict:
    med = statistics.median
    caches = [str(root / f"cold{i}") for i in range(repeats)]
    # the warm runs below share the first cold run's kernels
    os.environ["XLR_KERNEL_DIR"] = str(Path(caches[0], "kernels"))
    cold = [generate(model, d, max_tokens, str(Path(d, "kernels"))) for d in caches]
    warm = [generate(model, caches[0], max_tokens) for _ in range(repeats)]
    rate = _child("in-process", model, caches[0], str(max_tokens or 0), str(repeats))
    for run in warm:
        run["overhead_s"] = (run["wall_s"] - max(run["completion_tokens"] - 1, 0)
                             / rate["decode_tokens_per_s"])
        run["decode_vs_in_process"] = run["decode_tokens_per_s"] / rate["decode_tokens_per_s"]

    agent_dir, turn_tokens = str(root / "agent"), "8" if quick else "24"
    agent_cold = _child("agent", model, agent_dir, turn_tokens, str(int(quick)))
    agent_warm = [_child("agent", model, agent_dir, turn_tokens, str(int(quick)))
                  for _ in range(repeats)]

    pool = _child("kv-pool", model, caches[0], str(warm[0]["max_context"]))

    chat_first = chat(model, caches[0], max_tokens)  # params converted, chat shapes compiled
    chat_warm = [chat(model, caches[0], max_tokens) for _ in range(repeats)]
    later_turns = [t for run in chat_warm for t in run["ttft_s"][1:]]

    serve_first = serve_ready(caches[0], root / "serve-first.log")  # its KV pool, its plan
    serve_warm = [serve_ready(caches[0], root / f"serve-{i}.log") for i in range(repeats)]

    same = all(r["token_ids"] == cold[0]["token_ids"] for r in cold + warm) and all(
        r["token_ids"] == agent_cold["token_ids"] for r in agent_warm)
    targets = {
        "warm_generate_overhead_s": _target(med(r["overhead_s"] for r in warm), 1.5),
        "warm_generate_ttft_s": _target(med(r["ttft_s"] for r in warm), 0.15),
        "warm_decode_vs_in_process": _target(med(r["decode_vs_in_process"] for r in warm),
                                             0.9, at_most=False),
        "cold_generate_wall_s": _target(med(r["wall_s"] for r in cold), 20.0),
        "agent_warm_first_turn_ttft_s": _target(med(r["ttft_s"] for r in agent_warm), 0.5),
        "chat_warm_later_turns_ttft_s": _target(med(later_turns), 0.15),
        "first_answer_wall_s": _target(med(r["wall_s"] for r in cold), 30.0),
        "later_generate_overhead_s": _target(med(r["overhead_s"] for r in warm), 3.0),
        "serve_ready_warm_s": _target(med(serve_warm), 5.0),
        "outputs_identical": {"value": same, "equals": True, "pass": same},
    }
    return {"generate": {"cold": cold, "warm": warm, "in_process": rate}, "kv_pool": pool,
            "agent": {"cold": agent_cold, "warm": agent_warm},
            "chat": {"first": chat_first, "warm": chat_warm},
            "serve": {"first_ready_s": serve_first, "warm_ready_s": serve_warm},
            "targets": targets}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="experiments/results", help="directory for the JSON")
    ap.add_argument("--model", default="smollm2", help="'smollm2', a .gguf file or an HF dir")
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per figure")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="answer length (default: the CLI's, as a user runs it)")
    ap.add_argument("--quick", action="store_true", help="one repeat, short answers")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:  # a child process: JSON on the last line
        kind, model, cache_dir, *rest = args.child
        if kind == "in-process":
            print(json.dumps(in_process(model, cache_dir, int(rest[0]) or None, int(rest[1]))))
        elif kind == "kv-pool":
            print(json.dumps(kv_pool(model, cache_dir, int(rest[0]))))
        else:
            print(json.dumps(agent_turn(model, cache_dir, int(rest[0]), bool(int(rest[1])))))
        return {}

    from xlr_jax.bench.run import environment, git_state

    repeats = 1 if args.quick else args.repeats
    max_tokens = args.max_tokens or (16 if args.quick else None)
    with tempfile.TemporaryDirectory(prefix="xlr-startup-") as root:
        figures = measure(args.model, repeats, max_tokens, args.quick, Path(root))
        env = environment(uses_torch=False)  # the CPU kernels as the runs found them
    result = {"experiment": "startup",
              "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "environment": env, "git": git_state(),
              "model": args.model, "prompt": PROMPT, "chat_turns": CHAT_TURNS,
              "repeats": repeats, "max_tokens": max_tokens, "quick": args.quick, **figures}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = out / f"startup{'-quick' if args.quick else ''}-{stamp}.json"
    path.write_text(json.dumps(result, indent=2))
    for name, t in figures["targets"].items():
        bound = f"<= {t['max']}" if "max" in t else f">= {t['min']}" if "min" in t else "= True"
        value = f"{t['value']:.3f}" if isinstance(t["value"], float) else t["value"]
        print(f"{name:<32} {value:>8} {bound:<10} {'pass' if t['pass'] else 'FAIL'}")
    print(json.dumps({"out": str(path)}))
    return result


if __name__ == "__main__":
    main()
