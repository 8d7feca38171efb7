"""Where n-gram drafts are verified (issue 13 §4): rows of the ragged step, or own cycle.

An exact n-gram request can verify its last token and gamma drafts either as gamma + 1
decode rows of the engine's ragged step (beside the plain requests' rows: one target
pass for all) or in its own speculative cycle after that step. This times, in one
process with the runs interleaved, one loop iteration each way for a few mixes of
plain streams and one n-gram request (its drafts all real), at a few context lengths:

- rows:     one ragged step of plain + gamma + 1 rows (capped at the largest bucket)
- separate: a ragged step of the plain rows (none when alone) + the cycle

The engine's policy (Engine._loop) follows these figures: rows whenever the ragged step
runs for other requests anyway, the request's own cycle when it is alone.

Run: python experiments/verify_rows.py --out experiments/results/ [--contexts 300 1000]
(--quick: one context, few repetitions; a smoke test, not a measurement)
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

MIXES = [(0, 4), (0, 8), (1, 4), (3, 4), (6, 4)]  # (plain streams, gamma)


class _Row:
    """What the engine's sampling and block-table helpers read of a request."""

    def __init__(self, params, seq):
        self.params, self.seq = params, seq


def timers(model, context: int):
    """Functions that run one step of each kind on a sequence holding `context` tokens."""
    from xlr_jax.kv.paged_kv import SequencePages
    from xlr_jax.model.sampling import SamplingParams
    from xlr_jax.speculative.cycle import NgramDraft

    e = model.engine
    seq = SequencePages(e.pool)
    seq.reserve(context + 16)
    seq.length = context
    width = e.steps.buckets.table_width
    params = SamplingParams()

    def step(rows: int):
        if not rows:
            return
        build = e.steps.builder(rows, 0)
        for j in range(rows):
            build.decode(5, context + j, seq.block_table(width), params, j + 1)
        tokens, _, _, e.kv = e.steps.step(e.params, e.kv, build.build())
        np.asarray(tokens)

    def cycle(gamma: int):
        row = [_Row(params, seq)]
        sampling, sampler = e.sampling(row, 1, [1])
        out = e.spec_steps.cycle(
            e.params, e.kv, NgramDraft(), None, np.full(1, 5, np.int32),
            np.full(1, context, np.int32), np.full((1, gamma), 7, np.int32),
            np.full(1, gamma, np.int32), e.block_tables(row, 1), sampling,
            np.zeros(1, np.int32), gamma=gamma, method="exact", sampler=sampler)
        e.kv = out[6]
        np.asarray(out[0])

    return step, cycle, seq


def median_ms(fn, reps: int) -> float:
    fn()  # compiled and warm before timing
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="experiments/results", help="directory for the JSON")
    ap.add_argument("--contexts", type=int, nargs="+", default=[300, 1000],
                    help="tokens in the KV of every row")
    ap.add_argument("--reps", type=int, default=15, help="timed iterations per figure")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    ap.add_argument("--cache-dir", default=None, help="xlr-jax cache directory")
    ap.add_argument("--quick", action="store_true", help="one context, few repetitions")
    args = ap.parse_args(argv)
    contexts, reps, rounds = (([64], 2, 1) if args.quick
                              else (args.contexts, args.reps, args.rounds))

    import xlr_jax
    from xlr_jax.bench.run import write_result

    model = xlr_jax.load_model("smollm2", dtype="float32", cache_dir=args.cache_dir)
    model.shutdown()  # its loop stops: this process drives the engine's steps itself
    top = model.engine.buckets.batch[-1]
    figures = []
    for context in contexts:
        step, cycle, seq = timers(model, context)
        for plain, gamma in MIXES:
            rows = min(top, plain + gamma + 1)
            split = {"rows": [], "separate": []}
            for _ in range(rounds):  # interleaved: each round times both ways
                split["rows"].append(median_ms(lambda: step(rows), reps))
                split["separate"].append(median_ms(
                    lambda: (step(plain), cycle(gamma)), reps))
            med = {k: statistics.median(v) for k, v in split.items()}
            figures.append({"context": context, "plain_streams": plain, "gamma": gamma,
                            "rows": rows, "drafts_in_rows": rows - plain - 1,
                            "rows_ms": med["rows"], "separate_ms": med["separate"],
                            "rows_over_separate": med["rows"] / med["separate"],
                            "runs_ms": split})
        seq.release()
    result = {"what": "one loop iteration: n-gram verify as rows of the ragged step vs "
                      "a plain step and the request's own cycle (ms, medians)",
              "figures": figures}
    path = write_result(args.out, "verify_rows", result, args.quick)
    for f in figures:
        print(f"context {f['context']:5d}  plain {f['plain_streams']}  gamma {f['gamma']}  "
              f"rows {f['rows_ms']:6.1f} ms  separate {f['separate_ms']:6.1f} ms  "
              f"ratio {f['rows_over_separate']:.2f}")
    print(json.dumps({"out": str(path)}))
    return json.loads(path.read_text())


if __name__ == "__main__":
    main()
