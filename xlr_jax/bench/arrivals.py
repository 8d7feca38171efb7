"""Requests arriving as a Poisson process, replayed against a loaded `Model` and timed
per request: what experiments/online_engine.py and the `load` ablation cells measure.

It imports numpy and the standard library only, so the online-engine experiment's
worker on an old commit loads this file by its path beside that commit's xlr_jax.
"""
from __future__ import annotations

import threading
import time

import numpy as np


def poisson_workload(tokenizer, passage: str, n: int, prompt: tuple[int, int],
                     output: tuple[int, int], seed: int) -> list[dict]:
    """`n` requests: arrival in units of the mean gap (scaled by 1/rate when replayed), a
    window of `passage`'s tokens (tiled, at a random offset) as the prompt, max_tokens;
    prompt and output lengths log-uniform in their (lo, hi)."""
    rng = np.random.default_rng(seed)
    base = tokenizer.encode(passage, add_special_tokens=False)
    tiled = base * (prompt[1] // len(base) + 2)  # any offset in base leaves a full window
    gaps = rng.exponential(1.0, n)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[:-1])])

    def log_uniform(lo, hi):
        return np.exp(rng.uniform(np.log(lo), np.log(hi + 1), n)).astype(int).clip(lo, hi)

    lengths, outputs = log_uniform(*prompt), log_uniform(*output)
    offsets = rng.integers(0, len(base), n)
    return [{"arrival": float(a), "prompt": tiled[o:o + p], "max_tokens": int(m)}
            for a, p, m, o in zip(arrivals, lengths, outputs, offsets)]


def sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.perf_counter()))


def record(req: dict, arrival: float, issued: float, result, t0: float) -> dict:
    """One answered request's timings (seconds from `t0`, and TTFT, ITL, latency)."""
    returned = time.perf_counter()
    m = result.metrics
    # the first token came its decode time before the return (an engine that starts a
    # request's clock only once the call holds the model would hide its wait otherwise)
    ttft = None if m["ttft_s"] is None else returned - (m["total_s"] - m["ttft_s"]) - arrival
    return {"arrival_s": arrival - t0, "issued_s": issued - t0, "returned_s": returned - t0,
            "prompt_tokens": len(req["prompt"]), "max_tokens": req["max_tokens"],
            "completion_tokens": m["completion_tokens"], "finish_reason": result.finish_reason,
            "ttft_s": ttft, "itl_s": m["itl_s"], "latency_s": returned - arrival}


def submit_at_arrivals(model, requests: list[dict], t0: float, deadline: float,
                       records: list, gaps: list) -> list[threading.Thread]:
    """Submit each request at its arrival (this thread); a consumer thread per request
    keeps its record and its streamed inter-token gaps. Stops at the deadline, or when
    `model.submit` refuses (the model was shut down)."""
    from xlr_jax.errors import XlrError

    def consume(i, req, arrival, issued, handle):
        times = [time.perf_counter() for _ in handle.tokens()]
        records[i] = record(req, arrival, issued, handle.result(), t0)
        gaps[i] = np.diff(times).tolist()

    consumers = []
    for i, req in enumerate(requests):
        arrival = t0 + req["arrival"]
        if arrival >= deadline:
            break
        sleep_until(arrival)
        issued = time.perf_counter()
        try:
            handle = model.submit(req["prompt"], max_tokens=req["max_tokens"], ignore_eos=True)
        except XlrError:  # shut down at the deadline: not issued
            break
        consumers.append(threading.Thread(target=consume, daemon=True,
                                          args=(i, req, arrival, issued, handle)))
        consumers[-1].start()
    return consumers


def percentiles(values: list, name: str) -> dict:
    return {f"{name}_p{q}_s": float(np.percentile(values, q)) if values else None
            for q in (50, 99)}


def summary(requests: int, records: list, gaps: list | None, timed_out: bool) -> dict:
    """A replay's figures: counts, throughput (every token delivered over the span from
    the first arrival to the last return), and TTFT, ITL, latency p50/p99 over the
    requests that ran to their length (with `gaps`, every streamed gap's p50/p99)."""
    answered = [r for r in records if r is not None]
    done = [i for i, r in enumerate(records) if r and r["finish_reason"] == "length"]
    finished = [records[i] for i in done]
    span = max((r["returned_s"] for r in answered), default=0.0)
    tokens = sum(r["completion_tokens"] for r in answered)
    return {"requests": requests, "finished": len(finished),
            "aborted": sum(r["finish_reason"] == "abort" for r in answered),
            # never issued (arriving after the deadline) or failed
            "unanswered": requests - len(answered), "timed_out": timed_out,
            "completion_tokens": tokens, "throughput_tokens_per_s": tokens / span if span else 0.0,
            **percentiles([r["ttft_s"] for r in finished], "ttft"),
            **percentiles([r["itl_s"] for r in finished], "itl"),
            **percentiles([r["latency_s"] for r in finished], "latency"),
            **(percentiles([g for i in done for g in gaps[i]], "itl_gap")
               if gaps is not None else {}),
            "per_request": records}


def replay(model, requests: list[dict], rate: float, timeout: float) -> dict:
    """The workload at `rate` requests a second through `model.submit`; past `timeout`
    the model is shut down (requests in flight end "abort"; "timed_out" says so, and
    the caller loads it again)."""
    scaled = [{**r, "arrival": r["arrival"] / rate} for r in requests]
    records, gaps = [None] * len(scaled), [None] * len(scaled)
    t0 = time.perf_counter() + 0.05  # the threads are started before the first arrival
    deadline = t0 + timeout
    threads = submit_at_arrivals(model, scaled, t0, deadline, records, gaps)
    for t in threads:
        t.join(max(0.0, deadline - time.perf_counter()))
    timed_out = any(t.is_alive() for t in threads)
    if timed_out:
        model.shutdown()
        for t in threads:
            t.join()
    return summary(len(scaled), records, gaps, timed_out)
