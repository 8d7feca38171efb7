"""The CPU's attention kernel on the engine's steps (issue 15, targets 1, 3 and 4): the
compiled ragged step with the plan's attention (`attn_impl` "cpu": the kernel for decode
rows and for prefill chunks, in tiles of 16 query vectors) against the same step with the
XLA walk throughout (`"xla"`), side by side.

Shapes: 8 decode rows alone and with a 16-, 32- or 64-token chunk beside them (a
newcomer's prefill under step budgets of 24, 40 and 72 tokens), and a 256-token chunk
alone (a long prompt's prefill), each at positions 576, 3,840 and 7,680. Both take turns
in every round; figures are medians. Writes JSON.
Run: python experiments/chunk_attention.py [--out experiments/results] [--rounds 5]
     [--quick] [--cache-dir DIR]
"""
from __future__ import annotations

from pathlib import Path

from xlr_jax.bench.load import experiment_model, experiment_parser, experiment_settings
from xlr_jax.bench.step_timing import time_steps

ROOT = Path(__file__).resolve().parent.parent
FULL = dict(rounds=5, positions=[576, 3840, 7680],
            steps=[[8, 0], [8, 16], [8, 32], [8, 64], [0, 256]])
QUICK = dict(rounds=2, positions=[64], steps=[[2, 16]])


def step_figures(model, s: dict) -> dict:
    """Each shape's step by the plan's attention and by the XLA walk, side by side."""
    from xlr_jax.model.steps import Steps

    kernel = model.engine.runner.steps
    walk = Steps(model.engine.config, kernel.buckets, "xla", kernel.compiler_options)
    figures = {}
    for position in s["positions"]:
        times = time_steps(model, {"kernel": kernel, "walk": walk}, s["steps"], position,
                           s["rounds"])
        for (rows, chunk), t in times.items():
            figures[f"{rows}+{chunk}@{position}"] = {
                "decode_rows": rows, "chunk": chunk, "position": position,
                "kernel_s": t["kernel"], "walk_s": t["walk"],
                "kernel_over_walk": t["kernel"] / t["walk"]}
            print(f"{rows} rows + {chunk} at {position}: {t['kernel'] * 1e3:.1f} ms against "
                  f"the walk's {t['walk'] * 1e3:.1f} ({t['kernel'] / t['walk']:.2f}x)",
                  flush=True)
    return figures


def main(argv=None) -> dict:
    from xlr_jax.bench.run import write_result

    args = experiment_parser(__doc__, ROOT / "experiments/results").parse_args(argv)
    s = experiment_settings(args, FULL, QUICK)
    model = experiment_model(args, kernel="attn_impl")
    try:
        figures = step_figures(model, s)
    finally:
        model.shutdown()
    result = {"settings": s, "steps": figures}
    path = write_result(args.out, "chunk_attention", result, quick=args.quick)
    print(f"results: {path}")
    return result


if __name__ == "__main__":
    main()
