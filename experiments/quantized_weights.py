"""The embedded model with its weights in each format (`load_model(weights=...)`) beside
llama.cpp on the same GGUF file: the bytes its params take, decode tokens/s against the
roofline at the format's bytes a token, TTFT of a short prompt and of a 1,024-token one,
and its greedy tokens against float's and llama.cpp's.

Side by side in one process: each format loaded once (no prefix cache: every run
prefills), llama.cpp (llama-cpp-python, 2 threads; left out where it is not installed), a
warm-up round (compiles), then --reps timed rounds alternating between engines; medians.
"native" keeps the GGUF's Q4_1 matrices and Q8_0 embedding as they are; "int8"/"int4"/
"fp8" quantize the float values at load. Decode's products of a few rows and a prefill
chunk's run in the CPU's quantized kernel (`ops/quantized_linear.cc`: a chunk's down a
dequantized tile of the weight) where the plan runs the CPU kernels. Greedy agreement: on
each of PROMPTS, how many of --agree-tokens tokens each engine shares with float and with
llama.cpp before the first difference.

An AVX2 machine without one: XLR_CPU_TARGET=x86-64-v3 XLA_FLAGS=--xla_cpu_max_isa=AVX2
(the kernels and XLA's own code both capped at AVX2) with --no-llama-cpp (its build is
the machine's own).

Run: python experiments/quantized_weights.py [--out experiments/results] [--reps 3]
     [--formats float,native,...] [--no-llama-cpp] [--quick]
(--quick: float, native and int4 only, without llama.cpp)
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORMATS = ("float", "native", "int8", "int4", "fp8")
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
PROMPTS = ["The capital of France is", PROMPT, "def fibonacci(n):",
           "Here are three facts about the Moon:",
           "Translate to French: The weather is nice today.",
           "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n"
           "<|im_start|>assistant\n",
           "The most important inventions of the 20th century were",
           "Once upon a time, in a small village by the sea,"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "experiments" / "results"))
    ap.add_argument("--reps", type=int, default=3, help="timed runs per engine (median)")
    ap.add_argument("--agree-tokens", type=int, default=32,
                    help="greedy tokens compared on each of PROMPTS")
    ap.add_argument("--formats", default=",".join(FORMATS),
                    help="weight formats to load (float is always among them)")
    ap.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out")
    ap.add_argument("--quick", action="store_true", help="few tokens, one run: a smoke test")
    args = ap.parse_args(argv)
    formats = ["float"] + [f for f in args.formats.split(",") if f in FORMATS and f != "float"]
    if args.quick:  # a smoke test: the file's own format and one quantized at load
        formats, args.no_llama_cpp = ["float", "native", "int4"], True
    from xlr_jax.bench.engines import LlamaCppRunner, leading_agreement, load_xlr, roofline
    from xlr_jax.bench.run import write_result
    from xlr_jax.planning.hardware import measure_bandwidth

    tokens, reps, long, agree = ((8, 1, 128, 8) if args.quick
                                 else (64, args.reps, 1024, args.agree_tokens))
    engines = {f: load_xlr({"model": "smollm2", "weights": f, "label": f}) for f in formats}
    if not args.no_llama_cpp and importlib.util.find_spec("llama_cpp") is not None:
        engines["llama.cpp"] = LlamaCppRunner({"model": "smollm2", "threads": 2})
    ids = engines["float"].encode(PROMPT)
    # the prompt repeated past `long` tokens (16 tokens a copy at least), cut there
    long_ids = engines["float"].encode(" ".join([PROMPT] * (long // 16)))[:long]
    runs = {name: [] for name in engines}
    long_ttft = {name: [] for name in engines}
    for rep in range(reps + 1):  # the first round compiles: not timed
        for name, engine in engines.items():
            result = engine.generate(ids, tokens)
            ttft = engine.generate(long_ids, 1).ttft_s
            if rep:
                runs[name].append(result)
                long_ttft[name].append(ttft)
    greedy = {name: [engine.generate(engines["float"].encode(p), agree).tokens
                     for p in PROMPTS] for name, engine in engines.items()}
    bandwidth = measure_bandwidth("read", 0.5 if args.quick else 1.0, 3 if args.quick else 10)
    gb_per_s = bandwidth["read_bandwidth_gb_per_s"]

    figures = {}
    for name, engine in engines.items():
        decode = statistics.median(r.decode_tokens_per_s for r in runs[name])
        figures[name] = {
            **engine.info,
            "weight_bytes_per_token": engine.weight_bytes_per_token,
            "decode_tokens_per_s": decode,
            "decode_tokens_per_s_runs": [r.decode_tokens_per_s for r in runs[name]],
            "ttft_s": statistics.median(r.ttft_s for r in runs[name]),
            "long_prompt_ttft_s": statistics.median(long_ttft[name]),
            "greedy_tokens_equal_to_float": leading_agreement(runs["float"][0].tokens,
                                                              runs[name][0].tokens),
            "roofline": roofline(engine, len(ids), tokens, gb_per_s, decode),
            "prompts_greedy_agreement": {
                other: [leading_agreement(a, b) for a, b in zip(greedy[name], greedy[other])]
                for other in ("float", "llama.cpp") if other in greedy},
        }
    base = figures["float"]
    for name, x in figures.items():
        x["bytes_over_float"] = x["weight_bytes_per_token"] / base["weight_bytes_per_token"]
        x["decode_over_float"] = x["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        x["long_prompt_ttft_over_float"] = x["long_prompt_ttft_s"] / base["long_prompt_ttft_s"]
        if "llama.cpp" in figures:
            x["decode_over_llama_cpp"] = (x["decode_tokens_per_s"]
                                          / figures["llama.cpp"]["decode_tokens_per_s"])
    result = {"what": "the embedded model's weight bytes, decode tokens/s (and roofline) and "
                      "TTFT (a short prompt, a long one) per weight format and for llama.cpp "
                      "on the same file, and greedy agreement with float and llama.cpp",
              "prompt": PROMPT, "tokens": tokens, "long_prompt_tokens": len(long_ids),
              "prompts": PROMPTS, "agree_tokens": agree, "reps": reps, **bandwidth,
              "engines": figures}
    path = write_result(args.out, "quantized_weights", result, args.quick)
    for name, x in figures.items():
        agreement = x["prompts_greedy_agreement"].get("llama.cpp", [])
        print(f"{name:>9}: {x['weight_bytes_per_token'] / 1e6:6.1f} MB/token "
              f"({x['bytes_over_float']:.2f}x)  {x['decode_tokens_per_s']:6.1f} tok/s "
              f"({x['decode_over_float']:.2f}x float, "
              f"{x.get('decode_over_llama_cpp', float('nan')):.2f}x llama.cpp, "
              f"{x['roofline']['roofline_fraction']:.0%} of roofline)  TTFT "
              f"{x['ttft_s'] * 1e3:6.1f} ms, at {len(long_ids)} tokens "
              f"{x['long_prompt_ttft_s'] * 1e3:6.1f} ms  greedy = llama.cpp's for "
              f"{sum(a >= agree for a in agreement)}/{len(agreement)} prompts")
    print({"out": str(path)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
