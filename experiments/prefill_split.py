"""Prefill apart from decode (issue 40 §4): running streams' inter-token latency while long
prompts arrive, with prefill in the decode steps (chunked, today's default) and with
prefill on a device of its own (`load_model(prefill_devices=1)`), side by side.

Two virtual CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=2, set here):
the baseline runs everything on device 0; the split decodes on device 0 and prefills on
device 1, a finished prompt's KV pages moved to device 0 (jax.device_put) before its first
decode step. Both load the embedded model with the prefix cache off (the split turns it
off), are warmed up (every step shape compiled) and then run the same workload, the two
alternating over --rounds:

  streams  --streams requests of a short prompt, each decoding --stream-tokens tokens
           (greedy, EOS ignored), all submitted at t = 0
  prompts  --prompts long prompts (--prompt-tokens tokens of experiments/
           cpu_vs_transformers.toml's passage, tiled; 4 tokens each), one every --gap
           seconds from t = --first

A consumer thread per request timestamps every streamed token. Figures per setup (medians
over rounds): the streams' inter-token gaps (p50, p90, p99, max) over the whole run and
over the windows in which a long prompt was waiting for its first token, the long
prompts' TTFT, the streams' decode tokens/s, and whether both setups gave the same tokens.

On a 2-core CPU the two virtual devices share the same two cores (XLA:CPU runs each
device's programs on one thread pool): a prefill on device 1 slows device 0's decode
steps while it runs; what the split removes is a decode step waiting for a chunk.

Run: python experiments/prefill_split.py [--out DIR] [--rounds 2] [--quick] [--model M]
"""
from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=2")

import argparse  # noqa: E402
import statistics  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import tomllib  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PASSAGE = Path(__file__).with_name("cpu_vs_transformers.toml")
FULL = dict(streams=4, stream_tokens=512, prompts=3, prompt_tokens=1500, first=1.0, gap=2.5,
            load={})
QUICK = dict(streams=2, stream_tokens=24, prompts=1, prompt_tokens=96, first=0.2, gap=1.0,
             load=dict(max_batch=4, prefill_chunk=32, max_context=256))


def long_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """`n` different windows of `length` tokens of the passage, tiled."""
    text = tomllib.loads(PASSAGE.read_text())["prompt"]["passage"]
    base = tokenizer.encode(text, add_special_tokens=False)
    tiled = base * (length // len(base) + n + 2)
    return [tiled[7 * i:7 * i + length] for i in range(n)]


def run(model, w: dict, prompts: list[list[int]]) -> dict:
    """One pass of the workload (see the module docstring): every request's token times
    and ids, relative to its start."""
    times: dict[str, list] = {}
    ids: dict[str, list] = {}

    def consume(name, handle, t0):
        times[name], ids[name] = [], []
        for token in handle.tokens():
            times[name].append(time.perf_counter() - t0)
            ids[name].append(token)

    t0 = time.perf_counter()
    threads = []
    for i in range(w["streams"]):
        handle = model.submit(f"Story {i}: once upon a time", max_tokens=w["stream_tokens"],
                              ignore_eos=True)
        threads.append(threading.Thread(target=consume, args=(f"stream{i}", handle, t0)))
        threads[-1].start()
    arrivals = {}
    for i, prompt in enumerate(prompts):
        arrivals[f"prompt{i}"] = w["first"] + i * w["gap"]
        time.sleep(max(0.0, t0 + arrivals[f"prompt{i}"] - time.perf_counter()))
        handle = model.submit(prompt, max_tokens=4, ignore_eos=True)
        threads.append(threading.Thread(target=consume, args=(f"prompt{i}", handle, t0)))
        threads[-1].start()
    for t in threads:
        t.join(600)
    return {"times": times, "ids": ids, "arrivals": arrivals}


def figures(passes: list[dict]) -> dict:
    """The setup's figures, medians over its passes."""
    def per_pass(p):
        streams = [np.diff(t) for name, t in p["times"].items() if name.startswith("stream")]
        gaps = np.concatenate(streams)
        ends = [np.array(t[1:]) for name, t in p["times"].items() if name.startswith("stream")]
        # a gap ending while a long prompt waits for its first token
        windows = [(a, p["times"][name][0]) for name, a in p["arrivals"].items()]
        during = np.concatenate([g[[any(a <= e <= b for a, b in windows) for e in end]]
                                 for g, end in zip(streams, ends)])
        tokens = sum(len(t) for name, t in p["times"].items() if name.startswith("stream"))
        span = max(t[-1] for name, t in p["times"].items() if name.startswith("stream"))
        return {"itl_p50_s": float(np.percentile(gaps, 50)),
                "itl_p90_s": float(np.percentile(gaps, 90)),
                "itl_p99_s": float(np.percentile(gaps, 99)), "itl_max_s": float(gaps.max()),
                "itl_during_prefill_mean_s": float(during.mean()) if len(during) else None,
                "itl_during_prefill_max_s": float(during.max()) if len(during) else None,
                "prompt_ttft_s": statistics.median(p["times"][name][0] - a
                                                   for name, a in p["arrivals"].items()),
                "stream_tokens_per_s": tokens / span}
    each = [per_pass(p) for p in passes]
    return {**{k: statistics.median(e[k] for e in each if e[k] is not None)
               for k in each[0] if any(e[k] is not None for e in each)},
            "passes": each}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "experiments" / "results"))
    ap.add_argument("--rounds", type=int, default=2, help="passes of each setup, alternating")
    ap.add_argument("--quick", action="store_true", help="a tiny workload: a smoke test")
    ap.add_argument("--model", default="smollm2",
                    help="the model both setups load (default: the embedded one)")
    args = ap.parse_args(argv)
    w = QUICK if args.quick else FULL
    rounds = 1 if args.quick else args.rounds

    from xlr_jax import load_model
    from xlr_jax.bench.run import write_result

    models = {"prefill in the decode steps": load_model(args.model, prefix_cache=False,
                                                        **w["load"]),
              "prefill on a device of its own": load_model(args.model, prefill_devices=1,
                                                           **w["load"])}
    for model in models.values():
        model.warmup(progress=False)
    prompts = long_prompts(next(iter(models.values())).tokenizer, w["prompts"],
                           w["prompt_tokens"])
    passes: dict[str, list] = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            passes[name].append(run(model, w, prompts))
    figs = {name: figures(p) for name, p in passes.items()}
    ids = [p[0]["ids"] for p in passes.values()]
    base, split = figs.values()
    result = {"what": "running streams' ITL while long prompts prefill, with prefill in the "
                      "decode steps and on a device of its own", "model": args.model,
              "workload": {k: v for k, v in w.items() if k != "load"}, "load": w["load"],
              "rounds": rounds, "plan_max_step_tokens": next(
                  iter(models.values())).plan.max_step_tokens,
              "figures": figs, "same_tokens": ids[0] == ids[1],
              "split_over_base": {k: split[k] / base[k] for k in base
                                  if k != "passes" and base[k]}}
    for model in models.values():
        model.shutdown()
    path = write_result(args.out, "prefill_split", result, args.quick)
    for name, f in figs.items():
        print(f"{name:>32}: ITL p50 {f['itl_p50_s'] * 1e3:6.1f} ms, p99 "
              f"{f['itl_p99_s'] * 1e3:6.1f} ms, max {f['itl_max_s'] * 1e3:6.1f} ms; during "
              f"prefill mean {(f.get('itl_during_prefill_mean_s') or 0) * 1e3:6.1f} ms; "
              f"prompt TTFT {f['prompt_ttft_s']:.2f} s; streams "
              f"{f['stream_tokens_per_s']:.1f} tok/s")
    print(f"same tokens: {result['same_tokens']}; wrote {path}")
    return result


if __name__ == "__main__":
    main()
