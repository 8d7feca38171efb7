"""Streams under load, timed token by token: requests submitted to a loaded `Model`
from threads, as a server's clients would, each token's arrival time recorded."""
from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from xlr_jax.bench.engines import prompt_ids


def experiment_parser(doc: str, out: Path) -> argparse.ArgumentParser:
    """An experiment script's command line (its module `doc`, first paragraph as the
    description): --out (default `out`), --rounds, --seed, --quick and --cache-dir."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(out), help="the folder for the JSON (and PNG)")
    ap.add_argument("--rounds", type=int, help="interleaved rounds (figures are medians)")
    ap.add_argument("--seed", type=int, default=0, help="the prompts' sentence order")
    ap.add_argument("--quick", action="store_true", help="tiny shapes: a smoke test")
    ap.add_argument("--cache-dir", help="xlr-jax's cache folder (default ~/.cache/xlr-jax)")
    return ap


def experiment_settings(args, full: dict, quick: dict) -> dict:
    """An experiment's settings: `quick` with --quick, else `full`; --rounds overrides."""
    return {**(quick if args.quick else full), **({"rounds": args.rounds} if args.rounds else {})}


def experiment_model(args, kernel: str | None = None):
    """The embedded model in f32 with the prefix cache off (every prompt computed), from
    --cache-dir's cache; `kernel`: the plan choice ("attn_impl", "linear_impl") that must
    be the CPU kernel, else the experiment exits saying why it is off."""
    import xlr_jax

    model = xlr_jax.load_model("smollm2", dtype="float32", prefix_cache=False,
                               cache_dir=args.cache_dir)
    if kernel and getattr(model.plan, kernel) != "cpu":
        model.shutdown()
        raise SystemExit(f"the CPU kernel is off: {model.plan.reasons[kernel]}")
    return model


def text_prompts(model, passage: str, lengths: list[int], seed: int) -> list[list[int]]:
    """A prompt of each length: `passage` with its sentences reshuffled (`xlr bench`'s
    text prompts), seed + i for the i-th."""
    encoder = SimpleNamespace(encode=lambda text: model.tokenizer.encode(
        text, add_special_tokens=False))
    return [prompt_ids({"kind": "text", "passage": passage, "seed": seed + i}, n, encoder)
            for i, n in enumerate(lengths)]


def token_times(handle, times: list[float]) -> None:
    """Each token's arrival time, appended to `times` as it comes."""
    for _ in handle.tokens():
        times.append(time.perf_counter())


def run_load(model, streams: list[list[int]], newcomers: list[list[int]], s: dict,
             stream_kwargs: list[dict] | None = None) -> dict:
    """Every token's time: `streams` submitted at once, `s["stream_tokens"]` tokens each
    (with `stream_kwargs[i]`, further `Model.submit` arguments, for stream i), then once
    all of them decode a newcomer every `s["gap_s"]` seconds, `s["newcomer_tokens"]`
    each; and each newcomer's arrival. EOS is ignored."""
    stream_times = [[] for _ in streams]
    newcomer_times, arrivals = [[] for _ in newcomers], []
    threads = []

    def start(times: list, ids: list[int], max_tokens: int, kwargs: dict) -> None:
        handle = model.submit(ids, max_tokens=max_tokens, ignore_eos=True, **kwargs)
        threads.append(threading.Thread(target=token_times, args=(handle, times)))
        threads[-1].start()

    for times, ids, kwargs in zip(stream_times, streams, stream_kwargs or [{}] * len(streams)):
        start(times, ids, s["stream_tokens"], kwargs)
    while not all(stream_times):  # until every stream decodes
        time.sleep(0.005)
    for times, ids in zip(newcomer_times, newcomers):
        arrivals.append(time.perf_counter())
        start(times, ids, s["newcomer_tokens"], {})
        time.sleep(s["gap_s"])
    for t in threads:
        t.join()
    return {"streams": stream_times, "newcomers": newcomer_times, "arrivals": arrivals}


def decode_gaps(model, streams: list[list[int]], n: int) -> dict:
    """The streams decoding `n` tokens together, no newcomer: p50 and p99 of their gaps
    once all of them decode (one stream: the unloaded ITL)."""
    times = run_load(model, streams, [], {"stream_tokens": n})["streams"]
    start = max(t[0] for t in times)
    gaps = [b - a for t in times for a, b in zip(t, t[1:]) if a >= start]
    return {"p50_s": float(np.percentile(gaps, 50)), "p99_s": float(np.percentile(gaps, 99))}
