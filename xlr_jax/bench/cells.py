"""What one cell of an ablation grid measures, run in a process of its own.

`python -m xlr_jax.bench.cells SPEC.json OUT.json` reads a cell (`measure`, the engine
spec with the cell's values in it, `run` settings, `prompt`, a `nonce` unique to the
cell and round) and writes its figures. A measure returns `figures` (numbers, or lists
of numbers for per-turn and per-cycle series, which the sweep takes medians of) and
`detail` (anything else: token ids, the plan's choices). The measures:

- decode: one prompt, greedy, EOS ignored: TTFT, decode tokens/s, the read roofline at
  the bandwidth measured in the cell (`xlr bench`'s single-engine figures);
- streams: `streams` counts of different prompts decoded at once (continuous batching):
  each count's aggregate decode tokens/s and the most streams' speedup over one;
- agent: a multi-turn agent conversation with `prefix_cache` "off", "on" (an empty
  tier store) or "warm" (a restart: the same conversation ran in another process first,
  leaving its stable tier on disk): TTFT per turn and what the cache served;
- speculative: one prompt with `method` "off", "exact" or "smc" (and draft, gamma,
  particles...): decode tokens/s, tokens kept per target pass, SMC's ESS and resampling
  per cycle;
- load: requests arriving as a Poisson process at `rate` a second through the online
  engine: throughput and TTFT/ITL/latency percentiles.

Every measure runs its shapes once before timing (the warm-up compiles them), but
"warm", whose first turn is what a restart pays.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from xlr_jax.bench.engines import (RUNNERS, BenchError, load_options, measure, measure_streams,
                                   prompt_ids, roofline)

AGENT_MODES = ("off", "on", "warm")
SPEC_KEYS = ("method", "draft", "gamma", "particles", "ess_threshold", "min_agreement",
             "resampler", "draft_weights")
# the engine options a measure reads itself (the rest are load_model's)
OWN_OPTIONS = {"decode": (), "streams": (), "agent": ("prefix_cache",),
               "speculative": SPEC_KEYS, "load": ("rate",)}


def decode(engine: dict, run: dict, prompt: dict, nonce: str) -> dict:
    from xlr_jax.planning.hardware import measure_bandwidth

    runner = RUNNERS[engine.get("kind", "xlr")](engine)
    ids = prompt_ids(prompt, run["prompt_tokens"], runner)
    m = measure(runner, ids, run["decode_tokens"], run.get("runs", 3), run.get("warmup", 1))
    bandwidth = measure_bandwidth("read", run.get("bandwidth_gib", 1.0),
                                  run.get("bandwidth_runs", 10))["read_bandwidth_gb_per_s"]
    roof = roofline(runner, len(ids), run["decode_tokens"], bandwidth,
                    m["decode_tokens_per_s"])
    figures = {"ttft_s": m["ttft_s"], "decode_tokens_per_s": m["decode_tokens_per_s"],
               "roofline_decode_tokens_per_s": roof["roofline_decode_tokens_per_s"],
               "roofline_fraction": roof["roofline_fraction"],
               "bytes_per_token": roof["bytes_per_token"], "read_bandwidth_gb_per_s": bandwidth}
    if hasattr(runner, "flops_per_token"):
        figures["flops_per_token"] = runner.flops_per_token
    return {"figures": figures,
            "detail": {"engine": runner.info, "prompt_tokens": len(ids),
                       "tokens_identical_across_runs": m["tokens_identical_across_runs"],
                       "token_ids": m["token_ids"]}}


def streams(engine: dict, run: dict, prompt: dict, nonce: str) -> dict:
    runner = RUNNERS[engine.get("kind", "xlr")](engine)
    counts = sorted(run["streams"])
    # stream i's prompt: the prompt spec with seed + i (a different shuffle or draw)
    prompts = [prompt_ids({**prompt, "seed": prompt.get("seed", 0) + i}, run["prompt_tokens"],
                          runner) for i in range(counts[-1])]
    m = measure_streams(runner, prompts, run["decode_tokens"], counts, run.get("runs", 3),
                        run.get("warmup", 1))
    return {"figures": {**{f"decode_tokens_per_s_{c}": m["streams"][str(c)]["decode_tokens_per_s"]
                           for c in counts},
                        "batching_speedup": m["batching_speedup"]},
            "detail": {"engine": runner.info, "streams": m["streams"]}}


def agent_conversation(model, system: str, max_tokens: int, turns_text: list[str]) -> list[dict]:
    """An agent's conversation, greedy: the system prompt, then each user turn with the
    replies so far; per turn its TTFT and what the prefix cache served."""
    messages = [{"role": "system", "content": system}]
    turns = []
    for text in turns_text:
        messages.append({"role": "user", "content": text})
        r = model.chat(messages, max_tokens=max_tokens)
        m = r.metrics
        turns.append({"ttft_s": m["ttft_s"], "prompt_tokens": m["prompt_tokens"],
                      "cached_tokens": m["cached_tokens"],
                      "prefilled_tokens": m["prefilled_tokens"],
                      "stable_tokens": m["stable_tokens"],
                      "stable_cached_tokens": m["stable_cached_tokens"],
                      "token_ids": r.token_ids})
        messages.append({"role": "assistant", "content": r.text})
    return turns


def agent(engine: dict, run: dict, prompt: dict, nonce: str) -> dict:
    import xlr_jax
    from xlr_jax.bench.serving import TOOLS, TURNS, agent_system_prompt

    mode = engine.get("prefix_cache", "on")
    if mode not in AGENT_MODES + ("prime",):
        raise BenchError(f"prefix_cache must be one of {', '.join(AGENT_MODES)} for the agent "
                         f"measure (got {mode!r})")
    turns_text = (TURNS * 4)[:run.get("turns", 8)]
    # the measured conversation's system prompt is this cell's own: nothing of it is in
    # the tier store from an earlier run, but what "prime" (a restart's first life) left
    size = {"rules": run.get("rules", 12), "tools": run.get("tools", len(TOOLS))}
    system = agent_system_prompt(f"agent{nonce}", **size)
    max_tokens = run.get("max_tokens", 24)
    if mode == "warm":  # its first life, in a process of its own
        first = run_cell_process({"measure": "agent", "run": run, "prompt": prompt,
                                  "engine": {**engine, "prefix_cache": "prime"},
                                  "nonce": nonce})
        if "error" in first:
            raise BenchError(f"the warm cell's first process failed: {first['error']}")
    options = load_options(engine, own=OWN_OPTIONS["agent"])
    model = xlr_jax.load_model(engine["model"], prefix_cache=mode != "off", **options)
    if mode in ("off", "on"):  # compiles every step shape the measured turns meet
        agent_conversation(model, agent_system_prompt(f"warmup{nonce}", **size), max_tokens,
                           turns_text + turns_text[:4])
        if model.prefix_cache is not None:  # its tier must not take the measured one's pages
            for tier in model.prefix_cache.registered():
                model.prefix_cache.unregister_stable(tier)
    turns = agent_conversation(model, system, max_tokens, turns_text)
    model.engine.kv.flush()  # the stable tier's snapshot on disk before the process ends
    model.shutdown()
    ttft = [t["ttft_s"] for t in turns]
    stable = [t["stable_cached_tokens"] / t["stable_tokens"] for t in turns]
    cached = [t["cached_tokens"] / t["prompt_tokens"] for t in turns]
    later = ttft[1:] or ttft
    return {"figures": {"ttft_s": ttft, "ttft_first_turn_s": ttft[0],
                        "ttft_later_turns_median_s": statistics.median(later),
                        "stable_hit_fraction": stable, "cached_fraction": cached,
                        "load_s": model.load_info["load_s"]},
            "detail": {"system_prompt_tokens": turns[0]["stable_tokens"],
                       "prefilled_tokens": [t["prefilled_tokens"] for t in turns],
                       "token_ids": [t["token_ids"] for t in turns],
                       "load": model.load_info}}


def speculative(engine: dict, run: dict, prompt: dict, nonce: str) -> dict:
    import xlr_jax

    method = engine.get("method", "off")
    spec = None if method == "off" else {k: engine[k] for k in SPEC_KEYS if k in engine}
    options = load_options(engine, own=OWN_OPTIONS["speculative"])
    model = xlr_jax.load_model(engine["model"], **{"prefix_cache": False, **options})
    ids = _prompt(model, prompt, run)
    kw = dict(max_tokens=run["max_tokens"], temperature=run.get("temperature", 0.0),
              speculative=spec)
    for i in range(run.get("warmup", 1)):
        model.generate(ids, seed=i, **kw)
    results = [model.generate(ids, seed=i, **kw) for i in range(run.get("runs", 3))]
    model.shutdown()

    def median(key):
        return statistics.median(float(r.metrics.get(key) or 0.0) for r in results)

    figures = {"decode_tokens_per_s": median("decode_tokens_per_s"),
               "ttft_s": median("ttft_s"), "completion_tokens": median("completion_tokens")}
    detail = {"prompt_tokens": len(ids), "token_ids": [r.token_ids for r in results]}
    if spec:
        figures.update(accepted_per_pass=median("accepted_per_pass"),
                       acceptance_rate=median("acceptance_rate"),
                       target_passes=median("target_passes"))
    if method == "smc":
        m = results[0].metrics  # the first seed's population, cycle by cycle
        figures.update(resamples=median("resamples"),
                       particles_mean=statistics.median(
                           statistics.fmean(r.metrics["particles"] or [1]) for r in results),
                       smc_fallbacks=sum(r.metrics["smc_fallback"] is not None for r in results),
                       ess_before=m["smc_ess_before"],
                       particles=m["particles"], resampled=[int(x) for x in m["smc_resampled"]])
        detail["smc_fallback"] = [r.metrics["smc_fallback"] for r in results]
    return {"figures": figures, "detail": detail}


def load(engine: dict, run: dict, prompt: dict, nonce: str) -> dict:
    import xlr_jax
    from xlr_jax.bench.arrivals import poisson_workload, replay

    rate = engine.get("rate")
    if not isinstance(rate, (int, float)) or rate <= 0:
        raise BenchError(f"the load measure needs a request rate > 0 (rate = {rate!r})")
    lengths, outputs = tuple(run["prompt_tokens"]), tuple(run["output_tokens"])
    model = xlr_jax.load_model(engine["model"], **{
        "prefix_cache": False, "max_context": lengths[1] + outputs[1],
        **load_options(engine, own=OWN_OPTIONS["load"])})
    requests = poisson_workload(model.tokenizer, prompt["passage"], run["requests"], lengths,
                                outputs, prompt.get("seed", 0))
    model.warmup(progress=False)
    model.generate([r["prompt"] for r in requests[:2]], max_tokens=2, ignore_eos=True)
    result = replay(model, requests, float(rate), run.get("timeout_s", 300.0))
    if not result["timed_out"]:
        model.shutdown()
    per_request = result.pop("per_request")
    figures = {k: v for k, v in result.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {"figures": figures,
            "detail": {"timed_out": result["timed_out"], "per_request": per_request}}


MEASURES = {"decode": decode, "streams": streams, "agent": agent, "speculative": speculative,
            "load": load}


def check_cell(measure_name: str, engine: dict) -> None:
    """Refuse a cell before any process starts: an unknown measure or engine option."""
    if measure_name not in MEASURES:
        raise BenchError(f"unknown measure {measure_name!r}: one of {', '.join(MEASURES)}")
    kind = engine.get("kind", "xlr")
    if kind not in RUNNERS:
        raise BenchError(f"unknown engine kind {kind!r}: one of {', '.join(RUNNERS)}")
    if kind == "xlr-random":  # random weights of `shape`, not a model file
        if "shape" not in engine:
            raise BenchError("an xlr-random engine needs a shape (ModelConfig's fields)")
        return
    if "model" not in engine:
        raise BenchError("[engine] names no model (e.g. model = \"smollm2\")")
    if kind == "xlr":
        load_options(engine, own=OWN_OPTIONS[measure_name])


def _prompt(model, prompt: dict, run: dict) -> list[int]:
    """A chat message through the chat template (`message`), else `prompt_ids`' (passage
    text, or random ids)."""
    if "message" in prompt:
        return model.encode([{"role": "user", "content": prompt["message"]}])[0]
    encoder = _Encoder(model.tokenizer, model.config.vocab_size)
    return prompt_ids(prompt, run["prompt_tokens"], encoder)


class _Encoder:
    """What prompt_ids needs of a runner, from a loaded model's tokenizer."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


def run_cell_process(cell: dict, timeout_s: float | None = None) -> dict:
    """`cell` in a fresh process: {"figures", "detail", "wall_s"}, or {"error" (its last
    line of stderr), "stderr_tail", "wall_s"}."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="xlr-cell-") as tmp:
        spec, out = Path(tmp) / "cell.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps(cell))
        try:
            done = subprocess.run([sys.executable, "-m", "xlr_jax.bench.cells", str(spec),
                                   str(out)], capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout_s:.0f} s",
                    "wall_s": time.perf_counter() - start}
        if done.returncode or not out.exists():
            lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
            return {"error": lines[-1] if lines else f"exit {done.returncode}",
                    "stderr_tail": done.stderr[-3000:], "wall_s": time.perf_counter() - start}
        return {**json.loads(out.read_text()), "wall_s": time.perf_counter() - start}


def run_cell(cell: dict) -> dict:
    measure_name = cell["measure"]
    check_cell(measure_name, cell["engine"])
    return MEASURES[measure_name](cell["engine"], cell["run"], cell.get("prompt", {}),
                                  cell.get("nonce", "0"))


def main(argv=None) -> int:
    spec, out = argv or sys.argv[1:]
    result = run_cell(json.loads(Path(spec).read_text()))
    Path(out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
