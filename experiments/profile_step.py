"""Where one step's time goes: a jax.profiler trace of the ragged step, summarized.

Loads a model (the embedded one by default) with its default plan and runs one chunk
of `--chunk` random tokens from position `--start` (its attention reads every earlier
page: the cache holds whatever the pages hold, which does not change the cost), or with
`--rows N --chunk 0` N decode rows at position `--start`, each on pages of its own. It
runs the step warm, then traces one run and sums the XLA ops' time by kind
(`ynn_fusion.12` and `ynn_fusion.40` are one kind: YNNPACK's matrix products and
reductions). The text goes to stdout and, with --out, to a file, committed beside the
benchmark JSON it explains.

Run: python experiments/profile_step.py --start 3840 [--out experiments/results/X.txt]
     python experiments/profile_step.py --rows 8 --chunk 0 --start 576
"""
from __future__ import annotations

import argparse
import collections
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax

from xlr_jax.api import load_model
from xlr_jax.bench.run import git_state
from xlr_jax.bench.step_timing import step_batch


def summarize(trace_dir: str) -> list[tuple[str, int, float]]:
    """(op kind, count, ms) of the XLA ops a trace holds, largest first. Ops run on the
    CPU's compute threads and on the client's (small ones, inline); a `while` holds its
    body's ops, which are counted too."""
    path = next(Path(trace_dir).rglob("*.xplane.pb"))
    data = jax.profiler.ProfileData.from_file(str(path))
    total, count = collections.Counter(), collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            # the Python calls, not XLA's ops: a line named after the interpreter's
            # executable ("python", "python3", "python3.11")
            if line.name.startswith("python"):
                continue
            for event in line.events:
                if event.name.startswith(("ThunkExecutor", "ThreadpoolListener",
                                          "SlinkyThreadPool", "end:")):
                    continue
                kind = re.sub(r"\.\d+$", "", event.name)
                total[kind] += event.duration_ns
                count[kind] += 1
    return [(kind, count[kind], ns / 1e6) for kind, ns in total.most_common()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="a model name or path (see xlr models)")
    p.add_argument("--start", type=int, default=3840, help="the chunk's first position")
    p.add_argument("--chunk", type=int, default=256,
                   help="chunk tokens (a chunk bucket; 0: none)")
    p.add_argument("--rows", type=int, default=0, help="decode rows (a batch bucket)")
    p.add_argument("--runs", type=int, default=5, help="timed runs before the traced one")
    p.add_argument("--attn-impl", default="auto", help="the plan's attention, or this one")
    p.add_argument("--linear-impl", default="auto",
                   help="the plan's few-row products, or these (\"xla\": before the kernel)")
    p.add_argument("--weights", default=None,
                   help="the weight format (float, native, int8, int4, fp8; the plan's if unset)")
    p.add_argument("--out", help="also write the summary to this file")
    args = p.parse_args(argv)

    model = load_model(args.model, prefix_cache=False, attn_impl=args.attn_impl,
                       linear_impl=args.linear_impl, weights=args.weights)
    runner = model.engine.runner
    batch = step_batch(model, runner.steps, args.rows, args.chunk, args.start)

    times = []
    for _ in range(args.runs + 1):  # the first compiles
        t = time.perf_counter()
        jax.block_until_ready(runner.run_step(batch))
        times.append(time.perf_counter() - t)
    with tempfile.TemporaryDirectory() as trace:
        with jax.profiler.trace(trace):
            jax.block_until_ready(runner.run_step(batch))
        ops = summarize(trace)

    ops_ms = sum(ms for kind, _, ms in ops if kind != "while")
    what = " and ".join(([f"{args.rows} decode rows at"] if args.rows else [])
                        + ([f"a {args.chunk}-token chunk from"] if args.chunk else []))
    lines = [f"# {what} position {args.start}, {args.model}, "
             f"{jax.default_backend()} plan (attn_impl {model.plan.attn_impl}, linear_impl "
             f"{model.plan.linear_impl}, weights {model.plan.weights}); git {git_state()}",
             f"# step wall time, median of {args.runs}: "
             f"{statistics.median(times[1:]) * 1e3:.1f} ms;"
             f" ops (summed over XLA's threads, `while` not added): {ops_ms:.1f} ms",
             f"{'ms':>10} {'share':>6} {'count':>6}  op kind"]
    for kind, n, ms in ops[:20]:
        lines.append(f"{ms:10.2f} {100 * ms / ops_ms:5.1f}% {n:6d}  {kind}")
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
