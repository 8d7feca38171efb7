"""What an XLA:CPU compile option costs and saves: compile time against run time (issue 12, cold start).

Each option set runs in fresh processes, interleaved with the others round by round, on the
embedded model (f32, one decode row, a 2,048-token context, params from the cache, no
compile cache):
  compile_s   the first request's wall time (38-token chat prompt, 3 tokens): it compiles a
              prefill step and a decode step, which is what a cold `xlr generate` waits for
  decode      decode tokens/s of a 60-token answer, median of 3 after that
  ttft_1000   TTFT of a 1,000-token prompt (prefilled in chunks), median of 3 after a first
Medians over --rounds; the ratios are against XLA's defaults (the first set) of the same rounds.

Run: python experiments/compile_options.py --out experiments/results/ [--rounds 3] [--quick]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

OPTION_SETS = [{}, {"xla_backend_optimization_level": 1}]
PROMPT = "Give me three facts about the Moon."


def child(options: dict, quick: bool) -> dict:
    import xlr_jax

    model = xlr_jax.load_model("smollm2", compile_cache=False, prefix_cache=False,
                               max_batch=1, max_context=2048, compiler_options=options)
    prompt = model.chat_prompt([{"role": "user", "content": PROMPT}])
    start = time.perf_counter()
    model.generate(prompt, max_tokens=3, ignore_eos=True)
    compile_s = time.perf_counter() - start
    runs = 1 if quick else 3
    decode = [model.generate(prompt, max_tokens=8 if quick else 60, ignore_eos=True)
              .metrics["decode_tokens_per_s"] for _ in range(runs)]
    long = list(range(1000, 1100 if quick else 2000))
    model.generate(long, max_tokens=2, ignore_eos=True)  # compiles the chunk steps it needs
    ttft = [model.generate(long, max_tokens=2, ignore_eos=True).metrics["ttft_s"]
            for _ in range(runs)]
    return {"compile_s": compile_s, "decode_tokens_per_s": statistics.median(decode),
            "ttft_1000_s": statistics.median(ttft)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="experiments/results/")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one short round (a smoke test)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(json.loads(args.child), args.quick)))
        return
    rounds = 1 if args.quick else args.rounds
    runs: dict[str, list[dict]] = {json.dumps(o): [] for o in OPTION_SETS}
    for r in range(rounds):
        for options in OPTION_SETS:
            cmd = [sys.executable, __file__, "--child", json.dumps(options)]
            out = subprocess.run(cmd + (["--quick"] if args.quick else []), capture_output=True,
                                 text=True, timeout=1800)
            if out.returncode:
                raise SystemExit(f"{options} failed:\n{out.stderr[-3000:]}")
            runs[json.dumps(options)].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}: {options} {runs[json.dumps(options)][-1]}", file=sys.stderr)
    medians = {key: {m: statistics.median(x[m] for x in rs) for m in rs[0]}
               for key, rs in runs.items()}
    base = medians[json.dumps(OPTION_SETS[0])]
    summary = {key: {**m, **{f"{k}_vs_default": m[k] / base[k] for k in m}}
               for key, m in medians.items()}
    from xlr_jax.bench.run import write_result

    path = write_result(args.out, "compile_options",
                        {"rounds": rounds, "runs": runs, "medians": summary}, args.quick)
    for key, m in summary.items():
        print(f"{key:45} compile {m['compile_s']:6.2f} s ({m['compile_s_vs_default']:.2f}x)  "
              f"decode {m['decode_tokens_per_s']:5.1f} tok/s "
              f"({m['decode_tokens_per_s_vs_default']:.3f}x)  TTFT@1000 {m['ttft_1000_s']:.2f} s "
              f"({m['ttft_1000_s_vs_default']:.2f}x)")
    print(json.dumps({"out": str(path)}))


if __name__ == "__main__":
    main()
