"""Latency under load and the step budget (issue 15, target 4): the running streams'
inter-token latency (ITL) against a newcomer's time to first token (TTFT), at several step
budgets (`max_step_tokens`: a step's decode rows plus the prefill chunk beside them).

Workload, the same at every budget: `streams` requests start together (short prompts) and
each decodes `stream_tokens` tokens, EOS ignored. Once all of them decode, a newcomer
arrives every `gap_s` seconds with a `newcomer_prompt`-token prompt and decodes
`newcomer_tokens`: `streams` to `streams` + 2 decode at any time (6-8 by default), and
every newcomer's prefill runs in the steps the running streams decode in. Each prompt is
the passage of experiments/cpu_vs_transformers.toml, its sentences reshuffled with
--seed + its index (`xlr bench`'s text prompts); the prefix cache is off, so every prompt
is prefilled in full. Nothing is timed before every step shape has compiled.

Figures per budget: every inter-token gap of the running streams from the first
newcomer's arrival to the last newcomer's first token, p50 and p99, and p99 over the
unloaded ITL (one stream decoding alone, the median gap, measured in the same process
before the budgets, and again after, to show drift; and the running streams decoding
together with no newcomer, what batching alone costs them); the newcomers' TTFT (arrival
to first token), p50 and p99; tokens per second over the loaded span. Budgets take turns
in each round; figures are medians over rounds.
Target: the p99 gap <= 3x the unloaded ITL at the plan's default budget.
Writes JSON (environment, git sha, plan) and a PNG of p99 and p50 ITL against TTFT p50.

Run: python experiments/load_budget.py [--out experiments/results] [--budgets 24 40 ...]
     [--rounds 3] [--streams 6] [--seed 0] [--quick] [--cache-dir DIR]
(--quick: 3 streams, 2 newcomers, 2 budgets, one round; a smoke test, not a measurement)
"""
from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np

from xlr_jax.bench.load import experiment_model, experiment_parser, experiment_settings

ROOT = Path(__file__).resolve().parent.parent
PASSAGE = Path(__file__).with_name("cpu_vs_transformers.toml")  # its [prompt] passage
FULL = dict(streams=6, stream_prompt=64, stream_tokens=224, newcomers=6, newcomer_prompt=512,
            newcomer_tokens=16, gap_s=1.5, budgets=[24, 40, 72, 136, 264], rounds=3,
            unloaded_tokens=48)
# on the default plan too: a test's quick run loads the steps its session compiled
QUICK = dict(streams=3, stream_prompt=16, stream_tokens=32, newcomers=2, newcomer_prompt=48,
             newcomer_tokens=4, gap_s=0.2, budgets=[24, 72], rounds=1, unloaded_tokens=8)
MAX_RATIO = 3.0


def figures(raw: dict, unloaded: float) -> dict:
    """Running streams' gaps while newcomers arrive, and the newcomers' TTFT."""
    start = raw["arrivals"][0]
    end = max(times[0] for times in raw["newcomers"])
    gaps = [b - a for times in raw["streams"] for a, b in zip(times, times[1:])
            if a >= start and b <= end]
    ttft = [times[0] - t for times, t in zip(raw["newcomers"], raw["arrivals"])]
    tokens = sum(start <= t <= end for times in raw["streams"] + raw["newcomers"]
                 for t in times)
    p99 = float(np.percentile(gaps, 99))
    return {"streams_decoding_at_end": sum(times[-1] >= end for times in raw["streams"]),
            "itl_p50_s": float(np.percentile(gaps, 50)), "itl_p99_s": p99,
            "itl_p99_over_unloaded": p99 / unloaded, "gaps": len(gaps),
            "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
            "tokens_per_s": tokens / (end - start)}


def medians(runs: list[dict]) -> dict:
    return {k: float(np.median([r[k] for r in runs])) for k in runs[0]} | {"runs": runs}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = result["budgets"]
    x = [budgets[b]["ttft_p50_s"] for b in budgets]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for key, label, marker in (("itl_p99_s", "ITL p99", "o"), ("itl_p50_s", "ITL p50", "s")):
        ax.plot(x, [budgets[b][key] * 1e3 for b in budgets], marker=marker, label=label)
    for b, xi in zip(budgets, x):
        ax.annotate(b, (xi, budgets[b]["itl_p99_s"] * 1e3), textcoords="offset points",
                    xytext=(4, 4), fontsize=8)
    ax.axhline(MAX_RATIO * result["unloaded_itl_s"] * 1e3, color="gray", ls="--",
               label=f"{MAX_RATIO:g}x unloaded ITL")
    ax.axhline(result["streams_alone_itl"]["p99_s"] * 1e3, color="gray", ls=":",
               label=f"ITL p99, {result['settings']['streams']} streams, no newcomer")
    ax.set_xlabel("newcomer TTFT p50 (s)")
    ax.set_ylabel("running streams' ITL (ms)")
    ax.set_title(f"step budget (tokens per step, labelled): default {result['default_budget']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = experiment_parser(__doc__, ROOT / "experiments/results")
    ap.add_argument("--budgets", type=int, nargs="+", help="max_step_tokens values to run")
    ap.add_argument("--streams", type=int, help="running streams (default 6; 3 with --quick)")
    args = ap.parse_args(argv)
    s = {**experiment_settings(args, FULL, QUICK), "seed": args.seed}
    s["budgets"] = args.budgets or s["budgets"]
    s["streams"] = args.streams or s["streams"]

    from xlr_jax.bench.load import decode_gaps, run_load, text_prompts
    from xlr_jax.bench.run import write_result

    model = experiment_model(args)
    default = model.plan.max_step_tokens
    passage = tomllib.loads(PASSAGE.read_text())["prompt"]["passage"]
    prompts = text_prompts(model, passage, [s["stream_prompt"]] * s["streams"]
                           + [s["newcomer_prompt"]] * s["newcomers"], s["seed"])
    streams, newcomers = prompts[:s["streams"]], prompts[s["streams"]:]
    warm = dict(s, newcomers=1, gap_s=0.0)
    for budget in s["budgets"]:  # compiles every shape the runs take (chunk sizes differ)
        model.engine.scheduler.set_budget(budget)
        run_load(model, streams, newcomers[:1], warm)
    decode_gaps(model, streams[:1], s["unloaded_tokens"])  # one row's shapes, if not yet
    unloaded = decode_gaps(model, streams[:1], s["unloaded_tokens"])["p50_s"]
    runs = {b: [] for b in s["budgets"]}
    for r in range(s["rounds"]):
        for budget in s["budgets"] if r % 2 == 0 else reversed(s["budgets"]):
            model.engine.scheduler.set_budget(budget)
            runs[budget].append(figures(run_load(model, streams, newcomers, s), unloaded))
            print(f"round {r + 1} budget {budget}: ITL p99 "
                  f"{runs[budget][-1]['itl_p99_s'] * 1e3:.0f} ms, TTFT p50 "
                  f"{runs[budget][-1]['ttft_p50_s']:.2f} s", flush=True)
    unloaded_after = decode_gaps(model, streams[:1], s["unloaded_tokens"])["p50_s"]
    batch = decode_gaps(model, streams, s["unloaded_tokens"])
    model.engine.scheduler.set_budget(default)
    budgets = {str(b): medians(runs[b]) for b in s["budgets"]}
    at_default = budgets.get(str(default))
    plan = model.plan
    result = {"settings": s, "plan": {"max_batch": plan.max_batch,
                                      "prefill_chunk": plan.prefill_chunk,
                                      "max_step_tokens": plan.max_step_tokens,
                                      "compute_dtype": plan.compute_dtype,
                                      "reason": plan.reasons["max_step_tokens"]},
              "default_budget": default, "unloaded_itl_s": unloaded,
              "unloaded_itl_after_s": unloaded_after, "streams_alone_itl": batch,
              "budgets": budgets,
              "targets": {"itl_p99_over_unloaded_at_default": None if at_default is None else {
                  "value": at_default["itl_p99_over_unloaded"], "max": MAX_RATIO,
                  "pass": at_default["itl_p99_over_unloaded"] <= MAX_RATIO}}}
    model.shutdown()
    path = write_result(args.out, "load_budget", result, quick=args.quick)
    plot(result, path.with_suffix(".png"))
    print(f"unloaded ITL {unloaded * 1e3:.1f} ms (after: {unloaded_after * 1e3:.1f} ms); "
          f"{s['streams']} streams alone: p50 {batch['p50_s'] * 1e3:.1f}, "
          f"p99 {batch['p99_s'] * 1e3:.1f} ms")
    print(f"{'budget':>8} {'ITL p50':>9} {'ITL p99':>9} {'p99/unl':>8} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'tok/s':>7}")
    for b, f in budgets.items():
        print(f"{b:>8} {f['itl_p50_s'] * 1e3:8.0f}m {f['itl_p99_s'] * 1e3:8.0f}m "
              f"{f['itl_p99_over_unloaded']:8.2f} {f['ttft_p50_s']:8.2f}s {f['ttft_p99_s']:8.2f}s "
              f"{f['tokens_per_s']:7.1f}")
    print(f"results: {path}")
    return result


if __name__ == "__main__":
    main()
