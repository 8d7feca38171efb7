"""What joining processes costs (issue 40 §3): the same 4-way split of a model in one
process with 4 virtual CPU devices, and across two processes with 2 each (jax.distributed,
the leader broadcasting every step's inputs to the follower), side by side.

Each run is a fresh `xlr generate PROMPT --model M --max-tokens N --json --tensor-parallel
4` (the two-process run: the same command twice, `--coordinator` joined), alternating
the two setups over --rounds after one compile round of each; medians of decode tokens/s
and TTFT, their ratio, and whether the tokens agree. The model: experiments/
tensor_parallel.py's random Llama (8 query heads, 4 KV heads, d 512, 8 layers).

Run: python experiments/several_processes.py [--out DIR] [--rounds 3] [--tokens 64] [--quick]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = " ".join(f"w{i}" for i in range(2, 130))  # 128 words of the word-level tokenizer


def generate(model: Path, cache: Path, tokens: int, processes: int) -> dict:
    """One fresh run: the leader's --json output."""
    from xlr_jax.server.replicas import free_port

    argv = [sys.executable, "-m", "xlr_jax.cli", "generate", PROMPT, "--model", str(model),
            "--max-tokens", str(tokens), "--json", "--tensor-parallel", "4",
            "--cache-dir", str(cache)]
    devices = 4 // processes
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    if processes == 1:
        out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    else:
        argv += ["--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", "2"]
        follower = subprocess.Popen([*argv, "--process-id", "1"], env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out = subprocess.run([*argv, "--process-id", "0"], env=env, capture_output=True,
                             text=True, timeout=600)
        follower.wait(120)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "experiments" / "results"))
    ap.add_argument("--rounds", type=int, default=3, help="timed runs of each setup")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens a run")
    ap.add_argument("--quick", action="store_true", help="one round, 8 tokens: a smoke test")
    args = ap.parse_args(argv)
    rounds, tokens = (1, 8) if args.quick else (args.rounds, args.tokens)

    from xlr_jax.bench.run import write_result

    spec = importlib.util.spec_from_file_location(
        "tensor_parallel", ROOT / "experiments" / "tensor_parallel.py")
    tensor_parallel = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tensor_parallel)
    setups = {"one process, 4 devices": 1, "two processes, 2 devices each": 2}
    runs: dict[str, list] = {name: [] for name in setups}
    with tempfile.TemporaryDirectory() as tmp:
        model = tensor_parallel.random_llama(Path(tmp) / "llama8", args.quick)
        cache = Path(tmp) / "cache"
        compiled = {name: generate(model, cache, tokens, n) for name, n in setups.items()}
        for _ in range(rounds):  # interleaved
            for name, n in setups.items():
                runs[name].append(generate(model, cache, tokens, n))
    figures = {name: {
        "decode_tokens_per_s": statistics.median(r["metrics"]["decode_tokens_per_s"]
                                                 for r in rr),
        "ttft_s": statistics.median(r["metrics"]["ttft_s"] for r in rr),
        "decode_runs": [r["metrics"]["decode_tokens_per_s"] for r in rr],
        "ttft_runs": [r["metrics"]["ttft_s"] for r in rr],
        "compile_round_ttft_s": compiled[name]["metrics"]["ttft_s"],
        "token_ids": rr[0]["token_ids"]} for name, rr in runs.items()}
    one, two = figures.values()
    result = {"what": "a 4-way split in one process against two joined processes",
              "tokens": tokens, "rounds": rounds, "figures": figures,
              "decode_two_over_one": two["decode_tokens_per_s"] / one["decode_tokens_per_s"],
              "ttft_two_over_one": two["ttft_s"] / one["ttft_s"],
              "same_tokens": one["token_ids"] == two["token_ids"]}
    path = write_result(args.out, "several_processes", result, args.quick)
    for name, f in figures.items():
        print(f"{name:>30}: decode {f['decode_tokens_per_s']:7.1f} tok/s, TTFT "
              f"{f['ttft_s'] * 1e3:7.1f} ms")
    print(f"two processes / one: decode {result['decode_two_over_one']:.2f}x, TTFT "
          f"{result['ttft_two_over_one']:.2f}x, same tokens {result['same_tokens']}")
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
