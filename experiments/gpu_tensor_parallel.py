"""GPU check of tensor parallel, in one call: decode of a Llama-3-8B-shaped model (random
bf16 weights: d 4096, 32 query heads, 8 KV heads of 128, FFN 14,336, vocab 128,256,
--layers layers) split over 1, 2, 4 and 8 GPUs (as many as there are), against the
roofline's prediction for each split (issue 40).

Every split, 1 included, runs the split code: the decoder per device under `shard_map`
on a 1 x N mesh, two all-reduces a layer. Each split: one warm-up run (compiles), then
--reps runs of one stream, 128-token prompt, --tokens greedy tokens; median decode
tokens/s and TTFT, the speedup over one device, the roofline's ITL for that split
(`roofline.estimate(tensor_parallel=N)`: a device's share of the bytes and FLOPs, the
all-reduces over the hardware table's interconnect) and the measured fraction of it.
JSON out. (The random weights are laid out as each split reads them, so the splits'
tokens differ; that the split model gives one device's tokens is tested on real weights,
tests/tensor_parallel_devices.py.)

Run (GPU):  PYTHONPATH=. python3 experiments/gpu_tensor_parallel.py --out experiments/results/
Smoke (CPU: a tiny shape in f32 on 4 virtual devices; what the tests run): ... --smoke
"""
from __future__ import annotations

import argparse
import gc
import os
import sys

if "--smoke" in sys.argv and "xla_force_host_platform_device_count" not in os.environ.get(
        "XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=4").strip()

LLAMA3_8B = dict(architecture="llama", vocab_size=128256, hidden_size=4096, num_heads=32,
                 num_kv_heads=8, head_dim=128, intermediate_size=14336, rms_norm_eps=1e-5,
                 rope_theta=500000.0, max_context=2048, tie_embeddings=False)
TINY = dict(architecture="llama", vocab_size=1024, hidden_size=256, num_heads=8,
            num_kv_heads=2, head_dim=32, intermediate_size=512, rms_norm_eps=1e-5,
            rope_theta=10000.0, max_context=512, tie_embeddings=False)
PROMPT_TOKENS = 128


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="experiments/results", help="directory for the JSON")
    ap.add_argument("--layers", type=int, default=32, help="layers of the 8B shape (32: all)")
    ap.add_argument("--tokens", type=int, default=128, help="greedy tokens a run")
    ap.add_argument("--reps", type=int, default=3, help="timed runs a split (median)")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny shape in f32 on the CPU's virtual devices, 2 layers")
    args = ap.parse_args(argv)

    import jax

    from xlr_jax.bench.engines import measure, random_xlr
    from xlr_jax.bench.run import write_result
    from xlr_jax.model.config import ModelConfig
    from xlr_jax.planning.hardware import probe
    from xlr_jax.planning.roofline import estimate

    shape = {**(TINY if args.smoke else LLAMA3_8B), "num_layers": 2 if args.smoke
             else args.layers}
    dtype = "float32" if args.smoke else "bfloat16"
    tokens, reps = (8, 1) if args.smoke else (args.tokens, args.reps)
    splits = [n for n in (1, 2, 4, 8) if n <= jax.device_count()]
    hw, config = probe(), ModelConfig(**shape)
    ids = [int(t) for t in range(1, PROMPT_TOKENS + 1)]
    figures = {}
    for n in splits:
        runner = random_xlr({"shape": shape, "dtype": dtype, "tensor_parallel": n,
                             "label": f"tp{n}"})
        got = measure(runner, ids, tokens, reps, warmup=1)
        width = 2 if dtype == "bfloat16" else 4  # bytes a weight and a KV value
        predicted = estimate(config, hw, prompt=PROMPT_TOKENS, weight_bytes=width,
                             kv_bytes=width, context=PROMPT_TOKENS + tokens,
                             tensor_parallel=n)
        figures[f"tp{n}"] = {
            "mesh": runner.info["mesh"], "param_bytes": runner.info["param_bytes"],
            "decode_tokens_per_s": got["decode_tokens_per_s"], "ttft_s": got["ttft_s"],
            "decode_tokens_per_s_runs": got["decode_tokens_per_s_runs"],
            "warmup_ttft_s": got["warmup_ttft_s"], "token_ids": got["token_ids"],
            "roofline_itl_s": predicted["itl_s"],
            # the predicted ITL over the measured one
            "roofline_fraction": predicted["itl_s"] * got["decode_tokens_per_s"]}
        del runner
        gc.collect()
    one = figures["tp1"]
    for f in figures.values():
        f["speedup_vs_one_device"] = f["decode_tokens_per_s"] / one["decode_tokens_per_s"]
    result = {"what": "decode of an 8B-shaped Llama split over 1..8 devices (each split on a "
                      "mesh, 1 included) against the roofline per split",
              "shape": shape, "dtype": dtype, "devices": jax.device_count(),
              "device": hw.device_name, "prompt_tokens": PROMPT_TOKENS, "tokens": tokens,
              "reps": reps, "figures": figures}
    path = write_result(args.out, "gpu_tensor_parallel", result, quick=args.smoke)
    for name, f in figures.items():
        print(f"{name}: decode {f['decode_tokens_per_s']:8.1f} tok/s "
              f"({f['speedup_vs_one_device']:.2f}x one device), roofline ITL "
              f"{f['roofline_itl_s'] * 1e3:.2f} ms ({f['roofline_fraction']:.0%} reached)")
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
