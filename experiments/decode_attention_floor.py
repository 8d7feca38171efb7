"""What one row's decode attention costs on XLA:CPU (issue 15, target 2): the XLA walk
and the CPU kernel against the cheapest XLA op that reads the same bytes and against
the bandwidth, the step's share of the roofline, and whether XLA:CPU overlaps
independent ops.

At each position, for the embedded model's real KV layout and plan:

1. `attention_s`: one row's decode attention over every layer (a jitted scan) by the XLA
   walk over the row's pages; `kernel_s` by the CPU decode kernel (`ops.cpu_attention`,
   an XLA custom call), when it builds.
2. `read_floor_s`: one `sum` over each layer's K and over its V, the same number of
   pages lying contiguous: the cheapest XLA op that reads those bytes, one per array and
   layer, as the walk must run layer by layer.
3. `at_bandwidth_s`: the same bytes at the read bandwidth measured here (a 1 GiB pass).
4. `step_s`: the compiled 1-row decode step at that position (with the plan's attention,
   `attn_impl`), and its share of the roofline (weights + KV bytes at the measured
   bandwidth), as measured and with its attention at `at_bandwidth_s` instead (the best
   any attention could give).

And the overlap check: one layer's MLP-sized weight product and one layer's page gather,
independent of each other in one scan body, timed alone and together; `overlap_share`
is the part of the shorter one hidden by running them together (0: one after the other).

Variants take turns in every round; figures are medians over rounds. Writes JSON.
Run: python experiments/decode_attention_floor.py [--out experiments/results] [--rounds 15]
     [--quick] [--cache-dir DIR]
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from xlr_jax.bench.load import experiment_model, experiment_parser, experiment_settings
from xlr_jax.bench.step_timing import step_runner, timed

ROOT = Path(__file__).resolve().parent.parent
FULL = dict(positions=[576, 1100, 2000, 4000], rounds=15, bandwidth_runs=5)
QUICK = dict(positions=[64, 200], rounds=2, bandwidth_runs=2)


def calls(fns: dict, args) -> dict:
    """Each jitted fn(*args) as a function of nothing that blocks until it is done."""
    import jax

    return {name: (lambda fn=fn: jax.block_until_ready(fn(*args))) for name, fn in fns.items()}


def attention_fns(model, position: int):
    """(attention over every layer, the read floor of the same bytes), jitted, and their
    arguments: one row at `position` on its own run of pages."""
    import jax
    import jax.numpy as jnp

    from xlr_jax.ops import cpu_kernels, paged_attention

    engine, c = model.engine, model.engine.config
    kv, buckets = engine.runner.kv, engine.runner.steps.buckets
    seen = -(-(position + 1) // kv.page_size)
    table = jnp.asarray((np.arange(buckets.table_width) % (kv.k.shape[1] - 1) + 1)[None],
                        jnp.int32)
    lengths, q_pos = jnp.array([position + 1], jnp.int32), jnp.array([[position]], jnp.int32)
    q = jax.random.normal(jax.random.key(0), (1, 1, c.num_heads, c.head_dim), jnp.float32)

    def over_layers(one_layer):
        def run(q, k, v):
            def body(carry, layer):  # each layer's input depends on the last one's output
                return carry + 1e-3 * one_layer(q + carry, k, v, layer), None
            return jax.lax.scan(body, jnp.zeros_like(q), jnp.arange(c.num_layers))[0]
        return jax.jit(run)

    def attention(impl):
        return lambda q, k, v, layer: paged_attention(
            q, (k, v), table, lengths, q_pos, layer=layer, impl=impl,
            pages_per_block=buckets.attn_block)

    def read_floor(q, k, v, layer):
        size = (1, seen, *k.shape[2:])
        at = (layer, 1, 0, 0, 0)
        return q + 1e-9 * (jax.lax.dynamic_slice(k, at, size).sum()
                           + jax.lax.dynamic_slice(v, at, size).sum())

    args = (q, jnp.array(kv.k), jnp.array(kv.v))  # copies: the step donates the KV
    fns = {"attention": over_layers(attention("xla")), "read_floor": over_layers(read_floor)}
    if cpu_kernels.build_error() is None:
        fns["kernel"] = over_layers(attention("cpu"))
    return fns, args


def overlap(model, position: int, rounds: int) -> dict:
    """A weight product and a page gather per layer, independent, alone and together."""
    import jax
    import jax.numpy as jnp

    from xlr_jax.ops.paged_attention import gather_pages

    c, kv = model.engine.config, model.engine.runner.kv
    seen = -(-(position + 1) // kv.page_size)
    w = jax.random.normal(jax.random.key(1), (c.num_layers, c.hidden_size,
                                              c.intermediate_size), jnp.float32)
    x = jnp.ones((1, c.hidden_size), jnp.float32)
    table = jnp.arange(1, seen + 1, dtype=jnp.int32)

    def make(product: bool, gather: bool):
        def run(x, w, k, v):
            def body(h, layer):
                out = h
                if product:
                    out = out + 1e-3 * (h @ w[layer])[:, :c.hidden_size]
                if gather:
                    pages = gather_pages(k, table, layer) + gather_pages(v, table, layer)
                    out = out + 1e-9 * pages.sum()
                return out, None
            return jax.lax.scan(body, x, jnp.arange(c.num_layers))[0]
        return jax.jit(run)

    fns = {"product": make(True, False), "gather": make(False, True), "both": make(True, True)}
    t = timed(calls(fns, (x, w, kv.k, kv.v)), rounds)
    hidden = (t["product"] + t["gather"] - t["both"]) / min(t["product"], t["gather"])
    return {"position": position, "product_s": t["product"], "gather_s": t["gather"],
            "both_s": t["both"], "overlap_share": hidden}


def main(argv=None) -> dict:
    args = experiment_parser(__doc__, ROOT / "experiments/results").parse_args(argv)
    s = experiment_settings(args, FULL, QUICK)

    from xlr_jax.bench.engines import XlrRunner
    from xlr_jax.bench.run import write_result
    from xlr_jax.planning.hardware import measure_bandwidth

    model = experiment_model(args)
    runner = XlrRunner("xlr-jax", model.engine, {})  # the roofline's byte counts
    bandwidth = measure_bandwidth("read", 1.0, s["bandwidth_runs"])
    gb_s = bandwidth["read_bandwidth_gb_per_s"]
    impl = model.plan.attn_impl
    figures = {}
    for position in s["positions"]:
        fns, fn_args = attention_fns(model, position)
        step = step_runner(model, model.engine.runner.steps, 1, 0, position)
        t = timed({**calls(fns, fn_args), "step": step}, s["rounds"])
        del fns, fn_args  # the KV copies
        kv_bytes = runner.kv_bytes_per_position * (position + 1)
        at_bandwidth = kv_bytes / (gb_s * 1e9)
        roof = (runner.weight_bytes_per_token + kv_bytes) / (gb_s * 1e9)
        in_step = t["kernel" if impl == "cpu" else "attention"]  # the step's attention
        figures[str(position)] = {
            "kv_bytes": kv_bytes, "attention_s": t["attention"],
            **({"kernel_s": t["kernel"], "kernel_over_attention": t["kernel"] / t["attention"],
                "kernel_over_bandwidth": t["kernel"] / at_bandwidth} if "kernel" in t else {}),
            "read_floor_s": t["read_floor"], "at_bandwidth_s": at_bandwidth,
            "attention_over_read_floor": t["attention"] / t["read_floor"],
            "attention_over_bandwidth": t["attention"] / at_bandwidth,
            "step_s": t["step"], "roofline_step_s": roof,
            "roofline_share": roof / t["step"],
            "roofline_share_attention_at_bandwidth":
                roof / (t["step"] - in_step + at_bandwidth)}
    result = {"settings": s, "bandwidth": bandwidth,
              "weight_bytes_per_token": runner.weight_bytes_per_token,
              "kv_bytes_per_position": runner.kv_bytes_per_position,
              "attn_block_pages": model.engine.buckets.attn_block, "attn_impl": impl,
              "positions": figures, "overlap": overlap(model, s["positions"][1], s["rounds"])}
    model.shutdown()
    path = write_result(args.out, "decode_attention_floor", result, quick=args.quick)
    print(f"read bandwidth {gb_s:.1f} GB/s; ms over every layer:")
    print(f"{'position':>8} {'XLA walk':>9} {'kernel':>6} {'floor':>6} {'at bw':>6} "
          f"{'step':>6} {'roofline':>8} {'if attn at bw':>13}   (step: attn_impl {impl})")
    for position, f in figures.items():
        kernel = f"{f['kernel_s'] * 1e3:6.2f}" if "kernel_s" in f else f"{'-':>6}"
        print(f"{position:>8} {f['attention_s'] * 1e3:9.2f} {kernel} {f['read_floor_s'] * 1e3:6.2f} "
              f"{f['at_bandwidth_s'] * 1e3:6.2f} {f['step_s'] * 1e3:6.1f} "
              f"{f['roofline_share']:8.2f} {f['roofline_share_attention_at_bandwidth']:13.2f}")
    o = result["overlap"]
    print(f"overlap: product {o['product_s'] * 1e3:.2f} ms, gather {o['gather_s'] * 1e3:.2f}, "
          f"both {o['both_s'] * 1e3:.2f}: {o['overlap_share']:.0%} hidden")
    print(f"results: {path}")
    return result


if __name__ == "__main__":
    main()
