"""A step's weight products of a few rows on XLA:CPU (issue 15, targets 3 and 4): XLA's
dot, the multiply-sum and the CPU's few-row kernel (`ops.cpu_linear`), and what each
does to the engine's steps.

1. `products`: the embedded model's weight products over every layer (QKV, output,
   gate-up, down) and the LM head, chained as in a step (each product's input comes
   from the one before it) but without attention or norms, for 1 to 128 rows, by the
   three paths: XLA's dot; a multiply-sum (`[out, in, 1] * [1, in, rows]` summed over
   `in`, up to 24 rows: past that it only grows); the kernel (up to its 96 rows). Each
   figure also as a share of one row's dot (reading the weights once), as the weights'
   read rate and as multiply-adds per second.
2. `steps`: the compiled ragged step with the plan's products (`linear_impl` "cpu") and
   with XLA's (`"xla"`: multiply-sums up to 16 rows, dots past that): 1, 8 decode rows,
   and 8 decode rows with a 16-, 32- and 64-token chunk beside them (a newcomer's
   prefill under step budgets of 24, 40 and 72 tokens), at position 576.

Paths take turns in every round; figures are medians over rounds. Writes JSON.
Run: python experiments/few_row_products.py [--out experiments/results] [--rounds 9]
     [--quick] [--cache-dir DIR]
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from xlr_jax.bench.load import experiment_model, experiment_parser, experiment_settings
from xlr_jax.bench.step_timing import time_steps, timed

ROOT = Path(__file__).resolve().parent.parent
FULL = dict(rows=[1, 2, 4, 8, 16, 24, 32, 48, 64, 72, 96, 128], rounds=9, position=576,
            steps=[[1, 0], [8, 0], [8, 16], [8, 32], [8, 64]], bandwidth_runs=5)
QUICK = dict(rows=[1, 2], rounds=2, position=64, steps=[[2, 16]], bandwidth_runs=2)
MULTIPLY_SUM_ROWS = 24


def product_chain(params, config, products):
    """Every layer's four weight products and the LM head, chained, jitted."""
    import jax

    from xlr_jax.model.decoder import lm_head, linear

    @jax.jit
    def run(params, x):
        d = x.shape[-1]
        for lp in params.layers:
            qkv = linear(x, lp.wqkv, products)
            x = x + linear(qkv[:, :lp.wo.shape[1]], lp.wo, products)
            gate_up = linear(x, lp.w_gate_up, products)
            x = x + linear(gate_up[:, :lp.w_down.shape[1]], lp.w_down, products)
        return lm_head(params, x[:, :d], config, products)
    return run


def product_figures(model, s: dict) -> dict:
    """`products` (see the module's doc), per row count and path."""
    import jax
    import jax.numpy as jnp

    from xlr_jax.model.decoder import RowProducts
    from xlr_jax.ops import cpu_linear

    params = model.engine.runner.params
    paths = {"dot": RowProducts(), "kernel": RowProducts(0, cpu_linear.MAX_ROWS)}
    rng = np.random.default_rng(0)
    times = {}
    for rows in s["rows"]:
        x = jnp.asarray(rng.standard_normal((rows, model.config.hidden_size)) * 0.1,
                        jnp.float32)
        chosen = {name: p for name, p in paths.items()
                  if name == "dot" or 2 <= rows <= p.kernel_rows}
        if 2 <= rows <= MULTIPLY_SUM_ROWS:
            chosen["multiply_sum"] = RowProducts(rows, 0)
        fns = {name: (lambda f=product_chain(params, model.config, p):
                      jax.block_until_ready(f(params, x)))
               for name, p in chosen.items()}
        times[str(rows)] = timed(fns, s["rounds"])
    one_row = times[str(s["rows"][0])]["dot"]
    weight_bytes = product_bytes(params)
    return {rows: {name: {"s": t, "over_one_row_dot": t / one_row,
                          "weights_gb_per_s": weight_bytes / t / 1e9,
                          "multiply_adds_per_s": int(rows) * (weight_bytes // 4) / t}
                   for name, t in by_path.items()}
            for rows, by_path in times.items()}


def product_bytes(params) -> int:
    """The weights a step's products read: every layer's and the LM head's (the
    embedding table when it is tied; a lookup otherwise)."""
    return params.nbytes() - params.embed.nbytes * (params.lm_head is not None)


def step_figures(model, s: dict) -> dict:
    """`steps` (see the module's doc): the plan's steps beside steps with XLA's products."""
    from xlr_jax.model.steps import Steps

    plan_steps = model.engine.runner.steps
    xla_steps = Steps(model.engine.config, dataclasses.replace(plan_steps.buckets, kernel_rows=0),
                      plan_steps.attn_impl, plan_steps.compiler_options)
    times = time_steps(model, {"kernel": plan_steps, "xla": xla_steps}, s["steps"],
                       s["position"], s["rounds"])
    return {f"{rows}+{chunk}": {"decode_rows": rows, "chunk": chunk, "kernel_s": t["kernel"],
                                "xla_s": t["xla"], "kernel_over_xla": t["kernel"] / t["xla"]}
            for (rows, chunk), t in times.items()}


def main(argv=None) -> dict:
    args = experiment_parser(__doc__, ROOT / "experiments/results").parse_args(argv)
    s = experiment_settings(args, FULL, QUICK)

    from xlr_jax.bench.run import write_result
    from xlr_jax.planning.hardware import measure_bandwidth

    model = experiment_model(args, kernel="linear_impl")
    bandwidth = measure_bandwidth("read", 1.0, s["bandwidth_runs"])
    gb_s = bandwidth["read_bandwidth_gb_per_s"]
    weight_bytes = product_bytes(model.engine.runner.params)
    products, steps = product_figures(model, s), step_figures(model, s)
    result = {"settings": s, "bandwidth": bandwidth, "weight_bytes": weight_bytes,
              "weights_at_bandwidth_s": weight_bytes / (gb_s * 1e9), "products": products,
              "steps": steps}
    model.shutdown()
    path = write_result(args.out, "few_row_products", result, quick=args.quick)
    print(f"read bandwidth {gb_s:.1f} GB/s: the weights ({weight_bytes / 1e6:.0f} MB) in "
          f"{result['weights_at_bandwidth_s'] * 1e3:.1f} ms")
    print(f"{'rows':>5} {'dot':>7} {'mul-sum':>8} {'kernel':>7}   ms, products of every layer "
          "and the LM head")
    for rows, by_path in products.items():
        cells = [f"{by_path[n]['s'] * 1e3:.1f}" if n in by_path else "-"
                 for n in ("dot", "multiply_sum", "kernel")]
        print(f"{rows:>5} {cells[0]:>7} {cells[1]:>8} {cells[2]:>7}")
    print(f"steps at position {s['position']} (decode rows + chunk), ms: kernel / XLA")
    for name, f in steps.items():
        print(f"{name:>7} {f['kernel_s'] * 1e3:7.1f} {f['xla_s'] * 1e3:7.1f}  "
              f"{f['kernel_over_xla']:.2f}x")
    print(f"results: {path}")
    return result


if __name__ == "__main__":
    main()
