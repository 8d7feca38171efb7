"""A mixture of experts on the CPU: what XLA:CPU does with the grouped product, what a
decode step reads, and a small MoE's speed against a dense model with the same active
parameters.

Side by side in one process, medians of --reps after a warm-up (compile) run:

1. One layer's experts over N tokens (d 512, 8 experts of width 1024, top 2):
   gathered (each token reads its experts' weights), grouped (`jax.lax.ragged_dot` over
   the assignments sorted by expert) and a dense loop over experts (every token through
   every expert, the unchosen weighed 0: what running all experts costs), with the bytes
   XLA's cost analysis counts for each compiled program.
2. The bytes one decode step of the whole model reads (XLA's count for the compiled
   step), MoE against the dense model with the same active parameters (FFN width
   2 x 1024) and against the MoE's own weights.
3. Decode tokens/s and prefill time of the two models (random weights, f32) through the
   engine.

Run: python experiments/moe_products.py [--out experiments/results] [--reps 20] [--quick]
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
D, EXPERTS, TOP, WIDTH = 512, 8, 2, 1024


def shape(d: int, width: int, experts: int, layers: int) -> dict:
    """The ModelConfig fields of the MoE (`experts` > 0) or its dense equivalent."""
    moe = dict(num_experts=experts, experts_per_token=TOP, moe_intermediate_size=width,
               norm_topk_prob=True) if experts else {}
    return dict(architecture="mixtral" if experts else "llama", vocab_size=4096,
                hidden_size=d, num_layers=layers,
                num_heads=8, num_kv_heads=4, head_dim=d // 8,
                intermediate_size=width if experts else TOP * width, rms_norm_eps=1e-6,
                rope_theta=10000.0, max_context=1024, tie_embeddings=True, **moe)


def bytes_accessed(fn, *args) -> float:
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["bytes accessed"])


def median_ms(fn, args, reps: int) -> float:
    jax.block_until_ready(fn(*args))  # compiled and warm
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def layer_products(d: int, width: int, token_counts, reps: int) -> list[dict]:
    from xlr_jax.model.decoder import LayerParams, gathered_experts, grouped_experts

    rng = np.random.default_rng(0)
    w = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.02, jnp.float32)  # noqa: E731
    lp = LayerParams(attn_norm=None, wqkv=None, bqkv=None, wo=None, mlp_norm=None,
                     router=w(EXPERTS, d), w_experts_gate_up=w(EXPERTS, d, 2 * width),
                     w_experts_down=w(EXPERTS, width, d))

    def dense_loop(h, chosen, lp):
        outs = []
        for e in range(EXPERTS):  # every token through expert e
            gate, up = jnp.split(h @ lp.w_experts_gate_up[e], 2, axis=-1)
            outs.append((jax.nn.silu(gate) * up) @ lp.w_experts_down[e])
        every = jnp.stack(outs, 1)  # [N, E, d]
        return jnp.take_along_axis(every, chosen[..., None], 1)

    ways = {"gathered": gathered_experts, "grouped": grouped_experts, "dense_loop": dense_loop}
    figures = []
    for n in token_counts:
        h = w(n, d)
        chosen = jnp.asarray(np.stack([rng.choice(EXPERTS, TOP, replace=False)
                                       for _ in range(n)]), jnp.int32)
        row = {"tokens": n, "weight_bytes": float(lp.w_experts_gate_up.nbytes
                                                  + lp.w_experts_down.nbytes)}
        for name, fn in ways.items():
            row[f"{name}_ms"] = median_ms(jax.jit(fn), (h, chosen, lp), reps)
            row[f"{name}_bytes"] = bytes_accessed(fn, h, chosen, lp)
        figures.append(row)
    return figures


def decode_step_bytes(moe: dict, dense: dict) -> dict:
    """XLA's count of the bytes one decode step (one row) reads, for each model."""
    from xlr_jax.bench.engines import random_params
    from xlr_jax.kv.paged_kv import PagedKV
    from xlr_jax.model.config import ModelConfig
    from xlr_jax.model.decoder import forward

    out = {}
    for name, fields in (("moe", moe), ("dense", dense)):
        c = ModelConfig(**fields)
        params = random_params(c, jnp.float32, 0)
        kv = PagedKV.create(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
                            head_dim=c.head_dim, num_pages=8, page_size=16, dtype=jnp.float32)
        args = (params, kv, jnp.zeros((1, 1), jnp.int32), jnp.full((1, 1), 20, jnp.int32),
                jnp.ones((1, 1), bool), jnp.arange(8, dtype=jnp.int32)[None])

        def step(params, kv, tokens, positions, valid, tables, c=c):
            return forward(params, kv, tokens, positions, valid, tables, config=c,
                           attn_impl="xla")
        out[name] = {"step_bytes": bytes_accessed(step, *args),
                     "param_bytes": float(params.nbytes())}
    return out


def engine_speed(moe: dict, dense: dict, prompt: int, tokens: int, reps: int) -> dict:
    from xlr_jax.bench.engines import random_xlr

    runners = {name: random_xlr({"shape": fields, "dtype": "float32", "page_size": 16,
                                 "prefill_chunk": 128, "label": name})
               for name, fields in (("moe", moe), ("dense", dense))}
    ids = [int(t) for t in np.random.default_rng(1).integers(0, 4096, prompt)]
    runs = {name: [] for name in runners}
    for name, runner in runners.items():
        runner.generate(ids, tokens)  # compile
    for _ in range(reps):  # interleaved
        for name, runner in runners.items():
            runs[name].append(runner.generate(ids, tokens))
    return {name: {"decode_tokens_per_s": statistics.median(r.decode_tokens_per_s for r in rr),
                   "ttft_s": statistics.median(r.ttft_s for r in rr),
                   "decode_runs": [r.decode_tokens_per_s for r in rr]}
            for name, rr in runs.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "experiments" / "results"))
    ap.add_argument("--reps", type=int, default=20, help="timed runs per figure (median)")
    ap.add_argument("--quick", action="store_true", help="small sizes, few runs: a smoke test")
    args = ap.parse_args(argv)
    from xlr_jax.bench.run import write_result

    d, width, layers, reps = (64, 32, 2, 2) if args.quick else (D, WIDTH, 4, args.reps)
    counts = (1, 16) if args.quick else (1, 2, 4, 16, 64, 256)
    moe, dense = shape(d, width, EXPERTS, layers), shape(d, width, 0, layers)
    result = {
        "what": "a mixture of experts on this CPU: one layer's experts over N tokens three "
                "ways (ms, XLA's bytes accessed), a decode step's bytes, and the engine's "
                "speed of a MoE and a dense model with the same active parameters",
        "layer": {"hidden": d, "experts": EXPERTS, "top": TOP, "expert_width": width,
                  "figures": layer_products(d, width, counts, reps)},
        "decode_step": decode_step_bytes(moe, dense),
        "engine": {"layers": layers, "prompt": 128 if not args.quick else 16,
                   "tokens": 64 if not args.quick else 4,
                   **engine_speed(moe, dense, 128 if not args.quick else 16,
                                  64 if not args.quick else 4, max(reps // 4, 1))},
    }
    path = write_result(args.out, "moe_products", result, args.quick)
    for f in result["layer"]["figures"]:
        print(f"{f['tokens']:4d} tokens  gathered {f['gathered_ms']:7.3f} ms "
              f"({f['gathered_bytes'] / 1e6:6.2f} MB)  grouped {f['grouped_ms']:7.3f} ms "
              f"({f['grouped_bytes'] / 1e6:6.2f} MB)  dense loop {f['dense_loop_ms']:7.3f} ms "
              f"({f['dense_loop_bytes'] / 1e6:6.2f} MB)")
    step = result["decode_step"]
    print(f"decode step reads: MoE {step['moe']['step_bytes'] / 1e6:.2f} MB of "
          f"{step['moe']['param_bytes'] / 1e6:.2f} MB params; dense equivalent "
          f"{step['dense']['step_bytes'] / 1e6:.2f} MB")
    eng = result["engine"]
    print(f"engine: MoE {eng['moe']['decode_tokens_per_s']:.1f} tok/s, TTFT "
          f"{eng['moe']['ttft_s'] * 1e3:.1f} ms; dense {eng['dense']['decode_tokens_per_s']:.1f}"
          f" tok/s, TTFT {eng['dense']['ttft_s'] * 1e3:.1f} ms")
    print({"out": str(path)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
