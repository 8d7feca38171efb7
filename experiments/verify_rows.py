"""Where exact drafts are verified (issue 13 §4): rows of the ragged step, or own cycle.

An exact speculating request can verify its last token and gamma drafts either as
gamma + 1 decode rows of the engine's ragged step (beside the plain requests' rows: one
target pass for all) or in its own speculative cycle after that step. This times, in
one process with the runs interleaved, one loop iteration each way for a few mixes of
plain streams and one speculating request (its drafts all real), at a few context
lengths, for the n-gram draft or a device draft (--draft self:K):

- rows:     [a device draft's proposal pass, then] one ragged step of plain + gamma + 1
            rows (capped at the largest bucket) [, then the judgement of its drafts]
- separate: a ragged step of the plain rows (none when alone) + the cycle

The engine's policy (Engine._loop) follows these figures: rows whenever the ragged step
runs for other requests anyway, the request's own cycle when it is alone.

Run: python experiments/verify_rows.py --out experiments/results/ [--contexts 300 1000]
     [--draft self:20]
(--quick: one context, few repetitions; a smoke test, not a measurement)
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import numpy as np

MIXES = [(0, 4), (0, 8), (1, 4), (3, 4), (6, 4)]  # (plain streams, gamma)


def timers(model, context: int, draft_name: str):
    """Functions that run one loop iteration's parts on a sequence holding `context`
    tokens: a ragged step of some rows (its logits), the rows' verification around it
    (a device draft's proposal pass and judgement; nothing for n-gram), and a cycle."""
    from xlr_jax.model.sampling_params import SamplingParams
    from xlr_jax.speculative.config import resolve_draft

    e = model.engine
    runner = e.runner
    draft = resolve_draft(draft_name, e.config)
    seq = e.kv.new_sequence()
    e.kv.reserve(seq, context + 16)
    seq.length = context
    width = runner.steps.buckets.table_width
    params = SamplingParams()
    sampling, sampler = runner.sampling([params], [1], 1)
    tables = e.kv.block_tables([seq], 1, e.buckets.pages)

    def inputs(num_draft: int) -> SimpleNamespace:  # a cycle's rows (PassInputs)
        return SimpleNamespace(last=np.full(1, 5, np.int32),
                               positions=np.full(1, context, np.int32),
                               num_draft=np.full(1, num_draft, np.int32),
                               salt=np.zeros(1, np.int32), sampling=sampling,
                               sampler=sampler, block_tables=tables)

    def step(rows: int):
        if not rows:
            return None
        build = runner.steps.builder(rows, 0)
        for j in range(rows):
            build.decode(5, context + j, seq.block_table(width), params, j + 1)
        tokens, logits = runner.run_step(build.build())
        np.asarray(tokens)
        return logits

    def rows_iteration(plain: int, gamma: int, rows: int):
        drafts_in_rows = rows - plain - 1
        if draft.kind == "tokens":
            return step(rows)
        # as the engine does: the draft runs gamma steps, the rows' room caps what counts
        x = inputs(drafts_in_rows)
        drafts, q = runner.propose(draft, x, gamma=gamma)
        np.asarray(drafts)  # the host builds the step's rows from them
        logits = step(rows)
        index = (plain + np.minimum(np.arange(gamma + 1), drafts_in_rows))[None]
        accepted, *_ = runner.judge(logits, index.astype(np.int32), drafts, q, x,
                                    method="exact")
        np.asarray(accepted)

    def cycle(gamma: int):
        accepted, *_ = runner.cycle(draft, inputs(gamma), np.full((1, gamma), 7, np.int32),
                                    gamma=gamma, method="exact")
        np.asarray(accepted)

    return step, rows_iteration, cycle, seq


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
    ap.add_argument("--draft", default="ngram",
                    help='the exact draft: "ngram" or a device draft "self:K"')
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
        step, rows_iteration, cycle, seq = timers(model, context, args.draft)
        for plain, gamma in MIXES:
            rows = min(top, plain + gamma + 1)
            split = {"rows": [], "separate": []}
            for _ in range(rounds):  # interleaved: each round times both ways
                split["rows"].append(median_ms(lambda: rows_iteration(plain, gamma, rows), reps))
                split["separate"].append(median_ms(
                    lambda: (step(plain), cycle(gamma)), reps))
            med = {k: statistics.median(v) for k, v in split.items()}
            figures.append({"context": context, "plain_streams": plain, "gamma": gamma,
                            "rows": rows, "drafts_in_rows": rows - plain - 1,
                            "rows_ms": med["rows"], "separate_ms": med["separate"],
                            "rows_over_separate": med["rows"] / med["separate"],
                            "runs_ms": split})
        seq.release()
    result = {"what": f"one loop iteration: {args.draft} drafts verified as rows of the "
                      "ragged step vs a plain step and the request's own cycle (ms, medians)",
              "draft": args.draft, "figures": figures}
    name = "verify_rows" + ("" if args.draft == "ngram" else "-" + args.draft.replace(":", ""))
    path = write_result(args.out, name, result, args.quick)
    for f in figures:
        print(f"context {f['context']:5d}  plain {f['plain_streams']}  gamma {f['gamma']}  "
              f"rows {f['rows_ms']:6.1f} ms  separate {f['separate_ms']:6.1f} ms  "
              f"ratio {f['rows_over_separate']:.2f}")
    print(json.dumps({"out": str(path)}))
    return json.loads(path.read_text())


if __name__ == "__main__":
    main()
