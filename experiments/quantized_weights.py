"""The embedded model with its weights in each format (`load_model(weights=...)`): the
bytes its params take, decode tokens/s, TTFT of a short prompt and of a 1,024-token one,
and its greedy tokens against float's.

Side by side in one process: each format loaded once (no prefix cache: every run
prefills), a warm-up round (compiles), then --reps timed rounds alternating between
formats; medians. "native" keeps the GGUF's Q4_1 matrices and Q8_0 embedding as they are;
"int8"/"int4" quantize the float values at load. Decode's products of a few rows run in
the CPU's quantized kernel (`ops/quantized_linear.cc`) where the plan runs the CPU
kernels; a prefill chunk's dequantize the weight for XLA's dot.

Run: python experiments/quantized_weights.py [--out experiments/results] [--reps 3]
     [--quick]
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORMATS = ("float", "native", "int8", "int4")
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "experiments" / "results"))
    ap.add_argument("--reps", type=int, default=3, help="timed runs per format (median)")
    ap.add_argument("--quick", action="store_true", help="few tokens, one run: a smoke test")
    args = ap.parse_args(argv)
    import xlr_jax
    from xlr_jax.bench.run import write_result

    tokens, reps, long = (8, 1, 128) if args.quick else (64, args.reps, 1024)
    models = {f: xlr_jax.load_model("smollm2", weights=f, params_cache=False,
                                    prefix_cache=False) for f in FORMATS}
    # the prompt repeated past `long` tokens (16 tokens a copy at least), cut there
    long_ids = models["float"].encode(" ".join([PROMPT] * (long // 16)))[0][:long]
    runs = {f: [] for f in FORMATS}
    long_ttft = {f: [] for f in FORMATS}
    for rep in range(reps + 1):  # the first round compiles: not timed
        for f, model in models.items():
            result = model.generate(PROMPT, max_tokens=tokens, ignore_eos=True)
            ttft = model.generate(long_ids, max_tokens=1).metrics["ttft_s"]
            if rep:
                runs[f].append(result)
                long_ttft[f].append(ttft)
    float_ids = runs["float"][0].token_ids
    figures = {}
    for f, model in models.items():
        rr, ids = runs[f], runs[f][0].token_ids
        agree = next((i for i, (a, b) in enumerate(zip(float_ids, ids)) if a != b),
                     min(len(float_ids), len(ids)))
        figures[f] = {
            "param_bytes": model.engine.runner.params.nbytes(),
            "decode_tokens_per_s": statistics.median(r.metrics["decode_tokens_per_s"]
                                                     for r in rr),
            "ttft_s": statistics.median(r.metrics["ttft_s"] for r in rr),
            "long_prompt_ttft_s": statistics.median(long_ttft[f]),
            "greedy_tokens_equal_to_float": agree,
        }
    base = figures["float"]
    for f in FORMATS:
        figures[f]["bytes_over_float"] = figures[f]["param_bytes"] / base["param_bytes"]
        figures[f]["decode_over_float"] = (figures[f]["decode_tokens_per_s"]
                                           / base["decode_tokens_per_s"])
        figures[f]["long_prompt_ttft_over_float"] = (figures[f]["long_prompt_ttft_s"]
                                                     / base["long_prompt_ttft_s"])
    result = {"what": "the embedded model's params bytes, decode tokens/s and TTFT (a short "
                      "prompt, a long one) per weight format, and how many greedy tokens "
                      "equal float's",
              "prompt": PROMPT, "tokens": tokens, "long_prompt_tokens": len(long_ids),
              "reps": reps, "formats": figures}
    path = write_result(args.out, "quantized_weights", result, args.quick)
    for f, x in figures.items():
        print(f"{f:>6}: {x['param_bytes'] / 1e6:7.1f} MB ({x['bytes_over_float']:.2f}x)  "
              f"{x['decode_tokens_per_s']:6.1f} tok/s ({x['decode_over_float']:.2f}x)  "
              f"TTFT {x['ttft_s'] * 1e3:6.1f} ms, at {len(long_ids)} tokens "
              f"{x['long_prompt_ttft_s'] * 1e3:6.1f} ms  greedy = float for "
              f"{x['greedy_tokens_equal_to_float']}/{tokens}")
    print({"out": str(path)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
