"""Nothing slower (issue 13 §8): this checkout against an earlier commit, side by side.

Runs `xlr bench` on the xlr-jax engine of experiments/cpu_vs_transformers.toml alone
(1,024 prompt tokens, 128 decoded, batch 1, greedy; each run a median of the config's
repeats) on the base commit (a temporary git worktree) and on this checkout, `--runs`
times each, interleaved base/new, on one machine. Reports the medians of decode tok/s
and TTFT, their ratios new/base, and whether both produced the same tokens.
Target: decode ratio >= 0.95 and TTFT ratio <= 1.05. `--prompt-tokens N` runs the
same at another context length (the attention walk reads a different number of pages).

Run: python experiments/engine_no_slower.py --out experiments/results/ [--base REV] [--runs 3]
     [--prompt-tokens N]
(--quick: the config's [quick] sizes and one run each; a smoke test, not a measurement)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "experiments" / "cpu_vs_transformers.toml"
BASE = "8a9b053"  # the commit before issue 13 (the always-on engine)


def engine_only_config(text: str, prompt_tokens: int | None) -> str:
    """The config with its first engine only (xlr-jax), no targets (they compare against
    transformers) and, if given, `prompt_tokens` in its [run] and [quick] sizes."""
    head, first, rest = text.partition("[[engines]]")
    engine = rest.split("[[engines]]")[0].split("[targets]")[0]
    if prompt_tokens:
        head = re.sub(r"(?m)^prompt_tokens = \d+", f"prompt_tokens = {prompt_tokens}", head)
    return head + first + engine


def bench(tree: Path, config: Path, out: Path, quick: bool) -> dict:
    """One `xlr bench` process with `tree` on the path; its xlr-jax figures."""
    before = set(out.glob("*.json"))
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "xlr_jax.cli", "bench", str(config), "--out", str(out)]
    run = subprocess.run(cmd + (["--quick"] if quick else []), capture_output=True, text=True,
                         env=env, cwd=tree, timeout=1800)
    if run.returncode:
        raise SystemExit(f"xlr bench failed in {tree}:\n{run.stderr[-3000:]}")
    (path,) = set(out.glob("*.json")) - before
    result = json.loads(path.read_text())
    engine = result["engines"]["xlr-jax"]
    return {"git": result["git"], "ttft_s": engine["ttft_s"],
            "decode_tokens_per_s": engine["decode_tokens_per_s"],
            "token_ids": engine["token_ids"], "bandwidth": result.get("bandwidth")}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="experiments/results", help="directory for the JSON")
    ap.add_argument("--base", default=BASE, help=f"the commit to compare with (default {BASE})")
    ap.add_argument("--runs", type=int, default=3, help="runs of each side, interleaved")
    ap.add_argument("--prompt-tokens", type=int, help="prompt length (default: the config's)")
    ap.add_argument("--quick", action="store_true", help="[quick] sizes, one run each")
    args = ap.parse_args(argv)
    runs = 1 if args.quick else args.runs

    from xlr_jax.bench.run import environment, git_state, git_worktree

    with tempfile.TemporaryDirectory(prefix="xlr-no-slower-") as tmp, \
            git_worktree(ROOT, args.base, Path(tmp) / "base") as (base_tree, _):
        tmp = Path(tmp)
        config = tmp / "engine.toml"
        config.write_text(engine_only_config(CONFIG.read_text(), args.prompt_tokens))
        sides: dict[str, list] = {"base": [], "new": []}
        for _ in range(runs):
            for side, tree in (("base", base_tree), ("new", ROOT)):
                sides[side].append(bench(tree, config, tmp / side, args.quick))

    med = {side: {key: statistics.median(r[key] for r in rs)
                  for key in ("decode_tokens_per_s", "ttft_s")} for side, rs in sides.items()}
    decode = med["new"]["decode_tokens_per_s"] / med["base"]["decode_tokens_per_s"]
    ttft = med["new"]["ttft_s"] / med["base"]["ttft_s"]
    tokens = [r["token_ids"] for rs in sides.values() for r in rs]
    summary = {"base": med["base"], "new": med["new"],
               "decode_ratio_new_over_base": decode, "ttft_ratio_new_over_base": ttft,
               "same_tokens": all(t == tokens[0] for t in tokens),
               "target": "decode ratio >= 0.95 and TTFT ratio <= 1.05",
               "decode_pass": decode >= 0.95, "ttft_pass": ttft <= 1.05}
    result = {"experiment": "engine_no_slower",
              "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "what": f"xlr bench on {CONFIG.name}'s xlr-jax engine alone, {runs} runs of "
                      f"each side interleaved: base {args.base}, new this checkout",
              "prompt_tokens": args.prompt_tokens or "the config's",
              "environment": environment(uses_torch=False), "git": git_state(),
              "base": args.base, "quick": args.quick, "runs": sides, "summary": summary}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    tag = ("-quick" if args.quick else "") + (f"-p{args.prompt_tokens}" if args.prompt_tokens
                                               else "")
    path = out / f"engine_no_slower{tag}-{stamp}.json"
    path.write_text(json.dumps(result, indent=2))
    print(json.dumps({"out": str(path), **{k: v for k, v in summary.items()
                                           if k not in ("base", "new")}}))
    return result


if __name__ == "__main__":
    main()
