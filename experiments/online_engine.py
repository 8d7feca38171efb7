"""Online serving on the embedded model: Poisson arrivals at several request rates, through the
always-on engine (`model.submit`, streamed) and through the path before it (a thread per request
calling `model.generate` on the commit before issue 13, whose engine served one call at a time),
side by side.

Workload: one seeded set of requests, replayed at every rate (only the arrival times scale with
1/rate, so the rates differ in load alone): inter-arrival gaps exponential (a Poisson process),
prompts log-uniform in 64-2,048 tokens, outputs log-uniform in 16-256 tokens, greedy with EOS
ignored (every request decodes exactly its output length). A prompt is a window of the passage
of experiments/cpu_vs_transformers.toml, tiled, starting at a random offset, as token ids. The
model is loaded with the prefix cache off: both paths prefill every prompt in full, whatever ran
before. Nothing is timed before every shape a path needs is compiled.

Paths, at each rate one after the other:
  engine   this checkout, in this process: one driver thread submits each request at its
           arrival time; a consumer thread per request iterates `handle.tokens()`,
           timestamping every token as it arrives
  threads  the base commit (--base, default the one before issue 13), in a worker process on a
           temporary git worktree with its own cache directory: a thread per request sleeps
           until its arrival time, then calls `generate`; warmed up by running every request
           of the workload once, alone (its engine compiles each shape on first use)
Per request, both paths alike: TTFT = from the scheduled arrival to the first token (the call's
return minus its decode time, metrics total_s - ttft_s, so time a request waited before its
call or for a lock counts), ITL = its mean inter-token gap (metrics["itl_s"]), latency =
arrival to the call's return. Per rate and path: throughput (completion tokens / (last return -
first arrival)), TTFT, ITL and latency p50/p99 over requests, and for the engine path the
p50/p99 of every streamed inter-token gap; the engine/threads ratio of each. Each run is bounded
by --timeout: at the deadline the engine is shut down (requests in flight end "abort" and are
counted, later arrivals are never issued, and the model is loaded again for the next run); a
base worker past its deadline reports what returned and is replaced by a fresh one.

Targets: none; this records the serving curve of both. Duration on a 2-core CPU: ~15 minutes
(with seed 0 the arrivals alone span 7.3 minutes over both paths), plus ~5 minutes compiling
the 14 step shapes on a new cache directory and the base worker's conversion and warm-up.
--quick (tiny shapes, 2 rates of 6 requests) takes about two minutes on a new cache directory,
most of it compiling; it is a smoke test, not a measurement.

Run: python experiments/online_engine.py [--out experiments/results] [--quick] [--base REV]
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PASSAGE = Path(__file__).with_name("cpu_vs_transformers.toml")
BASE = "8a9b053"  # the commit before issue 13 (the always-on engine)
FULL = dict(rates=[0.15, 0.3, 0.6, 1.2], requests=12, prompt=(64, 2048), output=(16, 256),
            timeout=300.0, load={})
# tiny shapes: 5 step executables to compile, 6 short requests per rate
QUICK = dict(rates=[1.0, 4.0], requests=6, prompt=(16, 64), output=(4, 8), timeout=60.0,
             load=dict(max_batch=2, prefill_chunk=16))
PATHS = ("engine", "threads")
RATIOS = ("throughput_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
          "latency_p50_s", "latency_p99_s")
PLAN_KEYS = ("max_context", "max_batch", "prefill_chunk", "page_size", "num_pages",
             "compute_dtype", "attn_impl")


def workload(tokenizer, n: int, prompt: tuple[int, int], output: tuple[int, int],
             seed: int) -> list[dict]:
    """`n` requests over the passage of experiments/cpu_vs_transformers.toml."""
    text = tomllib.loads(PASSAGE.read_text())["prompt"]["passage"]
    return arrivals().poisson_workload(tokenizer, text, n, prompt, output, seed)


@functools.cache
def arrivals():
    """xlr_jax.bench.arrivals of this checkout, by its path: the base worker runs beside an
    old commit's xlr_jax, which lacks it (the module imports numpy and the stdlib only)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "xlr_bench_arrivals", ROOT / "xlr_jax" / "bench" / "arrivals.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_threads(model, requests: list[dict], t0: float, deadline: float,
                records: list) -> list[threading.Thread]:
    """A thread per request: sleep until its arrival, then `generate` (today's path)."""
    from xlr_jax.errors import XlrError

    a = arrivals()

    def call(i, req, arrival):
        a.sleep_until(arrival)
        issued = time.perf_counter()
        try:
            result = model.generate(req["prompt"], max_tokens=req["max_tokens"],
                                    ignore_eos=True)
        except XlrError:  # shut down at the deadline: not issued
            return
        records[i] = a.record(req, arrival, issued, result, t0)

    threads = [threading.Thread(target=call, args=(i, req, t0 + req["arrival"]), daemon=True)
               for i, req in enumerate(requests) if t0 + req["arrival"] < deadline]
    for t in threads:
        t.start()
    return threads


def serve(model, path: str, requests: list[dict], rate: float, timeout: float) -> dict:
    """One run of the workload at `rate` through `path`; True in "timed_out" when the
    deadline passed: the engine was shut down (the caller loads it again), or, on the base
    commit (no shutdown), calls are still running (the worker exits after reporting)."""
    a = arrivals()
    if path == "engine":
        return a.replay(model, requests, rate, timeout)
    scaled = [{**r, "arrival": r["arrival"] / rate} for r in requests]
    records = [None] * len(scaled)
    t0 = time.perf_counter() + 0.05  # the threads are started before the first arrival
    deadline = t0 + timeout
    threads = run_threads(model, scaled, t0, deadline, records)
    for t in threads:
        t.join(max(0.0, deadline - time.perf_counter()))
    return a.summary(len(scaled), records, None, any(t.is_alive() for t in threads))


class BaseWorker:
    """The threads path on the base commit: this script in `--threads-worker` mode, in its own
    process with the base tree first on the path, loaded and warmed up once; then one run of
    the workload per rate asked."""

    def __init__(self, tree: Path, spec: Path, log: Path):
        self.log = log
        env = {**os.environ, "PYTHONPATH": str(tree)}
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--threads-worker", str(spec)],
            cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=log.open("a"), text=True)
        self._read("READY")

    def _read(self, tag: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(tag):
                return line[len(tag):].strip()
        raise SystemExit(f"the base worker died:\n{self.log.read_text()[-3000:]}")

    def serve(self, rate: float) -> dict:
        self.proc.stdin.write(f"{rate}\n")
        self.proc.stdin.flush()
        return json.loads(self._read("RESULT "))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def threads_worker(spec_path: str) -> None:
    """Worker mode (the base commit's xlr_jax on the path): load, run every request once,
    then serve the threads path at each rate read from stdin, a RESULT line each."""
    import xlr_jax

    spec = json.loads(Path(spec_path).read_text())
    model = xlr_jax.load_model("smollm2", **spec["load"])
    for r in spec["requests"]:  # each shape compiled on first use, as a call would alone
        model.generate(r["prompt"], max_tokens=r["max_tokens"], ignore_eos=True)
    print("READY", flush=True)
    for line in sys.stdin:
        result = serve(model, "threads", spec["requests"], float(line), spec["timeout"])
        print("RESULT " + json.dumps(result), flush=True)
        if result["timed_out"]:  # calls still running, and no way to stop them
            os._exit(0)


def warm_up(model, requests: list[dict]) -> None:
    """Compile every step shape, then run two requests together (host-side first-call
    costs), before anything is timed."""
    model.warmup(progress=False)
    model.generate([r["prompt"] for r in requests[:2]], max_tokens=2, ignore_eos=True)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogFormatter, NullLocator

    rates = [r["rate_per_s"] for r in result["rates"]]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    panels = (("throughput (tokens/s)", 1, "linear", ["throughput_tokens_per_s"]),
              ("TTFT (s, log)", 1, "log", ["ttft_p50_s", "ttft_p99_s"]),
              ("ITL (ms, log)", 1e3, "log", ["itl_p50_s", "itl_p99_s"]))
    for ax, (label, scale, yscale, keys) in zip(axes, panels):
        for name, marker, color in zip(PATHS, "os", ("C0", "C1")):
            for key, style in zip(keys, ("-", "--")):
                values = [np.nan if r[name][key] is None else r[name][key] * scale
                          for r in result["rates"]]
                suffix = f" {key.split('_')[1]}" if len(keys) > 1 else ""
                ax.plot(rates, values, style, marker=marker, color=color, label=name + suffix)
        ax.set_xscale("log")
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_yscale(yscale)
        if yscale == "log":  # plain numbers, not powers of ten
            ax.yaxis.set_major_formatter(LogFormatter())
            ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
        else:
            ax.set_ylim(bottom=0)
        ax.set_xlabel("request rate (requests/s, log)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M online serving, {result['config']['requests_per_rate']} "
                 f"Poisson requests per rate ({result['environment']['device_kind']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def _row(rate: float, path: str, f: dict) -> str:
    return (f"rate {rate:g}/s {path:<8} finished {f['finished']}/{f['requests']} "
            f"{f['throughput_tokens_per_s']:.1f} tok/s  TTFT p50/p99 {_ms(f['ttft_p50_s'])}/"
            f"{_ms(f['ttft_p99_s'])} ms  ITL p50/p99 {_ms(f['itl_p50_s'])}/"
            f"{_ms(f['itl_p99_s'])} ms")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="experiments/results", help="directory for JSON and PNG")
    ap.add_argument("--quick", action="store_true", help="tiny shapes and 2 rates: a smoke test")
    ap.add_argument("--rates", type=float, nargs="+", help="requests per second")
    ap.add_argument("--requests", type=int, help="requests per rate")
    ap.add_argument("--timeout", type=float, help="seconds per rate and path before aborting")
    ap.add_argument("--seed", type=int, default=0, help="the workload's generator seed")
    ap.add_argument("--cache-dir", help="the model cache (default: xlr-jax's); the base "
                    "worker's is its base-REV folder (default: a temporary one)")
    ap.add_argument("--base", default=BASE,
                    help=f"the commit whose generate the threads path calls (default {BASE})")
    ap.add_argument("--threads-worker", metavar="SPEC", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.threads_worker:
        return threads_worker(args.threads_worker)
    preset = QUICK if args.quick else FULL
    rates, n = args.rates or preset["rates"], args.requests or preset["requests"]
    timeout = args.timeout or preset["timeout"]
    # the longest prompt plus its longest output fits the context
    load = {**preset["load"], "max_context": preset["prompt"][1] + preset["output"][1],
            "prefix_cache": False, "cache_dir": args.cache_dir}

    import xlr_jax
    from xlr_jax.bench.run import environment, git_state, git_worktree

    model = xlr_jax.load_model("smollm2", **load)
    requests = workload(model.tokenizer, n, preset["prompt"], preset["output"], args.seed)
    with tempfile.TemporaryDirectory(prefix="xlr-online-") as tmp, \
            git_worktree(ROOT, args.base, Path(tmp) / "base") as (tree, base_sha):
        tmp = Path(tmp)
        base_cache = (Path(args.cache_dir) / f"base-{args.base}" if args.cache_dir
                      else tmp / "cache")
        spec = tmp / "worker.json"
        spec.write_text(json.dumps({"load": {**load, "cache_dir": str(base_cache)},
                                    "requests": requests, "timeout": timeout}))
        worker = BaseWorker(tree, spec, tmp / "worker.log")
        warm_up(model, requests)
        runs = []
        for rate in rates:  # the two paths side by side at each rate
            run = {"rate_per_s": rate, "engine": serve(model, "engine", requests, rate, timeout)}
            if run["engine"]["timed_out"]:  # shut down at the deadline: a fresh model goes on
                model = xlr_jax.load_model("smollm2", **load)
                warm_up(model, requests)
            run["threads"] = worker.serve(rate)
            if run["threads"]["timed_out"]:  # its calls still run: a fresh worker goes on
                worker = BaseWorker(tree, spec, tmp / "worker.log")
            run["engine_over_threads"] = {
                k: run["engine"][k] / run["threads"][k] if run["engine"][k] and run["threads"][k]
                else None for k in RATIOS}
            runs.append(run)
            for path in PATHS:
                print(_row(rate, path, run[path]), flush=True)
        worker.close()
    plan = model.plan.to_dict()
    model.shutdown()

    result = {"experiment": "online_engine",
              "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "environment": environment(uses_torch=False), "git": git_state(),
              "quick": args.quick, "base": {"rev": args.base, "sha": base_sha},
              "config": {"rates_per_s": rates, "requests_per_rate": n, "seed": args.seed,
                         "prompt_tokens": list(preset["prompt"]),
                         "output_tokens": list(preset["output"]), "timeout_s": timeout,
                         "text": PASSAGE.name + " [prompt].passage",
                         "load": {k: v for k, v in load.items() if k != "cache_dir"},
                         "plan": {k: plan[k] for k in PLAN_KEYS}},
              "load": model.load_info,
              "workload": [{"arrival_in_mean_gaps": r["arrival"],
                            "prompt_tokens": len(r["prompt"]), "max_tokens": r["max_tokens"]}
                           for r in requests],
              "rates": runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = out / f"online_engine-{stamp}.json"
    path.write_text(json.dumps(result, indent=2))
    plot(result, path.with_suffix(".png"))
    print(json.dumps({"out": str(path)}))
    return result


if __name__ == "__main__":
    main()
