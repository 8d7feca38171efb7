"""Two choices of the tensor-parallel layout, measured side by side (issue 40 §1): the LM
head replicated or split by vocabulary, and the layer's collectives written out under
`shard_map` or placed by XLA (GSPMD).

On --devices virtual CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count, set
here), the jitted programs of a case taking turns, medians of --reps rounds after a
compile run, for a decode step's rows (1 and 8) and a prefill chunk's (256):

- LM head, f32 [V, d] for two shapes (the embedded model's 49,152 x 576 and a Llama-3-style
  128,256 x 2,048): replicated, every device computing all the logits (today's layout);
  split by vocabulary under shard_map, each device its V / N rows, the logits then
  all-gathered; the same split, only each device's best token and its logit gathered
  (what a greedy row needs); and the split left to XLA's placement (GSPMD: the weight's
  sharding given, the logits asked for replicated).
- One MLP block (d 2,048, FFN 8,192, gate/up split by columns, down by rows): under
  shard_map with one psum (today's layout) and the same shardings left to GSPMD.

Each device's share of the work is 1/N of the whole only where the program splits it;
on the CPU the virtual devices share the same cores, so a replicated head costs N times
the work there, where on N GPUs it costs one head's time on each at once. The GPU
figures the roofline gives are printed beside (`--hardware`, default h200).

Run: python experiments/tensor_parallel_choices.py [--out DIR] [--devices 4] [--reps 10]
[--quick]
"""
from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from pathlib import Path

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    count = sys.argv[sys.argv.index("--devices") + 1] if "--devices" in sys.argv else "4"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={count}").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import shard_map  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

from xlr_jax.bench.step_timing import timed  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HEADS = {"embedded 49152 x 576": (49152, 576), "llama-3 128256 x 2048": (128256, 2048)}
MLP = (2048, 8192)
ROWS = (1, 8, 256)
QUICK_HEADS = {"tiny 4096 x 256": (4096, 256)}
QUICK_MLP = (256, 1024)


def side_by_side(programs: dict, args: dict, reps: int) -> dict:
    """Median seconds of each program on its arguments, the programs taking turns
    (`bench.step_timing.timed`: each compiled first)."""
    return timed({name: partial(lambda fn, a: jax.block_until_ready(fn(*a)), fn, args[name])
                  for name, fn in programs.items()}, reps)


def head_programs(mesh) -> dict:
    """The LM head's layouts: hidden [R, d] replicated, weight [V, d] -> logits (or the
    best token and its logit) on every device."""
    def local(h, w):
        return h @ w.T

    def split_gathered(h, w):
        return jax.lax.all_gather(local(h, w), "model", axis=1, tiled=True)

    def split_best(h, w):
        logits = local(h, w)
        best = jnp.argmax(logits, axis=1)
        value = jnp.take_along_axis(logits, best[:, None], axis=1)[:, 0]
        offset = jax.lax.axis_index("model") * w.shape[0]
        values = jax.lax.all_gather(value, "model", axis=1)  # [R, N]
        ids = jax.lax.all_gather(best + offset, "model", axis=1)
        return jnp.take_along_axis(ids, jnp.argmax(values, axis=1)[:, None], axis=1)[:, 0]

    def on(fn, weight_spec):
        return jax.jit(shard_map(fn, mesh=mesh, in_specs=(P(), weight_spec), out_specs=P(),
                                 check_vma=False))

    return {"replicated": (on(local, P()), P()),
            "vocab split, logits gathered": (on(split_gathered, P("model")), P("model")),
            "vocab split, best token gathered": (on(split_best, P("model")), P("model")),
            "vocab split by XLA (GSPMD)": (jax.jit(
                local, out_shardings=NamedSharding(mesh, P())), P("model"))}


def mlp_programs(mesh) -> dict:
    """One MLP block, hidden [R, d] replicated -> [R, d] replicated: gate and up [d, F]
    split by columns, down [F, d] by rows."""
    def block(h, gate, up, down):
        return (jax.nn.silu(h @ gate) * (h @ up)) @ down

    specs = (P(), P(None, "model"), P(None, "model"), P("model", None))
    summed = shard_map(lambda *a: jax.lax.psum(block(*a), "model"), mesh=mesh,
                       in_specs=specs, out_specs=P(), check_vma=False)
    return {"shard_map + psum": jax.jit(summed),
            "XLA's placement (GSPMD)": jax.jit(block,
                                               out_shardings=NamedSharding(mesh, P()))}, specs


def measure(n: int, heads: dict, mlp: tuple, reps: int) -> dict:
    mesh = jax.make_mesh((n,), ("model",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:n])
    rng = np.random.default_rng(0)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    out = {"head": {}, "mlp": {}, "agree": True}  # every layout gives the same output
    for name, (vocab, d) in heads.items():
        w = rng.standard_normal((vocab, d), np.float32) * 0.02
        placed = {spec: put(w, spec) for spec in (P(), P("model"))}
        for rows in ROWS:
            h = put(rng.standard_normal((rows, d), np.float32), P())
            programs = head_programs(mesh)
            out["head"][f"{name}, {rows} rows"] = side_by_side(
                {layout: fn for layout, (fn, _) in programs.items()},
                {layout: (h, placed[spec]) for layout, (_, spec) in programs.items()}, reps)
            results = {k: np.asarray(fn(h, placed[spec])) for k, (fn, spec) in programs.items()}
            logits = results.pop("replicated")
            best = results.pop("vocab split, best token gathered")
            out["agree"] &= bool((best == logits.argmax(1)).all()) and all(
                np.allclose(r, logits, rtol=1e-4, atol=1e-4) for r in results.values())
        del placed
    d, f = mlp
    programs, specs = mlp_programs(mesh)
    weights = [put(rng.standard_normal(shape, np.float32) * 0.02, spec)
               for shape, spec in zip(((d, f), (d, f), (f, d)), specs[1:])]
    for rows in ROWS:
        h = put(rng.standard_normal((rows, d), np.float32), P())
        out["mlp"][f"{rows} rows"] = side_by_side(
            programs, {name: (h, *weights) for name in programs}, reps)
        a, b = (np.asarray(fn(h, *weights)) for fn in programs.values())
        out["agree"] &= bool(np.allclose(a, b, rtol=1e-4, atol=1e-4))
    return out


def gpu_head(heads: dict, n: int, hardware: str) -> dict:
    """What the roofline gives a decode row's head on N GPUs, bf16: replicated (one
    head's bytes on each), split (a 1/N share each, then the logits all-gathered)."""
    from xlr_jax.planning.hardware import preset
    from xlr_jax.planning.roofline import ALLREDUCE_LATENCY_S

    hw = preset(hardware)
    out = {}
    for name, (vocab, d) in heads.items():
        read = vocab * d * 2 / (hw.peak_bandwidth_gb_s * 1e9)
        gather = (n - 1) / n * vocab * 4 / (hw.interconnect_gb_s * 1e9) + ALLREDUCE_LATENCY_S
        out[name] = {"replicated_s": read, "vocab_split_s": read / n + gather}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "experiments" / "results"))
    ap.add_argument("--devices", type=int, default=4, help="virtual CPU devices (2 and N)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--hardware", default="h200", help="the GPU the roofline figures are for")
    ap.add_argument("--quick", action="store_true", help="tiny shapes: a smoke test")
    args = ap.parse_args(argv)
    heads, mlp = (QUICK_HEADS, QUICK_MLP) if args.quick else (HEADS, MLP)
    reps = 3 if args.quick else args.reps

    from xlr_jax.bench.run import write_result

    splits = sorted({2, min(args.devices, jax.device_count())})
    figures = {f"tp{n}": measure(n, heads, mlp, reps) for n in splits}
    result = {"what": "LM head replicated or split by vocabulary; shard_map or GSPMD",
              "reps": reps, "rows": list(ROWS), "heads": heads, "mlp": mlp,
              "figures": figures,
              "gpu_roofline": {f"tp{n}": gpu_head(heads, n, args.hardware) for n in splits},
              "hardware": args.hardware}
    path = write_result(args.out, "tensor_parallel_choices", result, args.quick)
    for split, f in figures.items():
        for part in ("head", "mlp"):
            for case, layouts in f[part].items():
                row = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in layouts.items())
                print(f"{split} {part} {case}: {row} ms")
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
