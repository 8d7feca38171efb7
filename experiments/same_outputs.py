"""The same outputs as an earlier commit (issue 37: a change of structure changes no token).

Runs every kind of request on the embedded model in a fresh process on the base commit (a
temporary git worktree) and on this checkout, and compares what they give: greedy and
seeded sampling (top-p too), log-probabilities, exact speculation with the n-gram and the
self:20 drafts, SMC, a mixed batch submitted at once, a chat with a system prompt (its
stable tier cached), and the logits of a prompt. Each process has its own cache directory
unless --cache-dir gives both one (then the new side may restore a stable tier the base
side saved, instead of prefilling it).

Run: python experiments/same_outputs.py --base REV [--out experiments/results] [--quick]
     [--cache-dir DIR]
(--quick: one prompt, three kinds, a smoke test)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "The three primary colors are", "Write a haiku about the sea."]
KINDS = {
    "greedy": {},
    "seeded": {"temperature": 0.8, "seed": 3},
    "top_p": {"temperature": 1.0, "top_p": 0.9, "seed": 5},
    "logprobs": {"logprobs": 2},
    "ngram": {"speculative": {"method": "exact", "draft": "ngram", "gamma": 4}},
    "self_draft": {"speculative": {"method": "exact", "draft": "self:20", "gamma": 2}},
    "smc": {"temperature": 0.8, "seed": 7, "speculative": {
        "method": "smc", "draft": "self:26", "gamma": 2, "particles": 2, "min_agreement": 0}},
}
QUICK = ("greedy", "seeded", "ngram")


def outputs(cache_dir: str, quick: bool) -> dict:
    """What every request gives, in this process (the child's side)."""
    import xlr_jax

    m = xlr_jax.load_model("smollm2", dtype="float32", cache_dir=cache_dir)
    prompts, kinds = (PROMPTS[:1], {k: KINDS[k] for k in QUICK}) if quick else (PROMPTS, KINDS)
    tokens = 8 if quick else 24
    out = {}
    for i, prompt in enumerate(prompts):
        for name, kw in kinds.items():
            r = m.generate(prompt, max_tokens=tokens, ignore_eos=True, **kw)
            out[f"{i}-{name}"] = [r.token_ids, [round(x["logprob"], 4) for x in r.logprobs]
                                  if r.logprobs else None]
    mixed = list(kinds.values())
    handles = [m.submit(p, max_tokens=tokens, ignore_eos=True, **mixed[(i * 3) % len(mixed)])
               for i, p in enumerate(prompts * 2)]
    out["batch"] = [h.result().token_ids for h in handles]
    out["chat"] = m.chat([{"role": "system", "content": "You are terse."},
                          {"role": "user", "content": "Name a planet."}],
                         max_tokens=tokens).token_ids
    out["logits"] = [round(float(x), 3) for x in m.logits("Hello world")[-1][:8]]
    m.shutdown()
    return out


def side(tree: Path, cache_dir: Path, quick: bool) -> dict:
    """`outputs` in a fresh process with `tree` on the path."""
    run = subprocess.run([sys.executable, __file__, "--child", str(cache_dir)]
                         + (["--quick"] if quick else []), capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree, timeout=1800)
    if run.returncode:
        raise SystemExit(f"the requests failed in {tree}:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", help="the commit to compare with (required)")
    ap.add_argument("--out", default="experiments/results", help="directory for the JSON")
    ap.add_argument("--quick", action="store_true", help="one prompt, three kinds")
    ap.add_argument("--cache-dir", help="one cache directory for both sides (default: one each)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(outputs(args.child, args.quick)))
        return {}
    if not args.base:
        ap.error("--base REV is required: the commit whose outputs these must equal")

    from xlr_jax.bench.run import git_worktree, write_result

    with tempfile.TemporaryDirectory(prefix="xlr-same-outputs-") as tmp, \
            git_worktree(ROOT, args.base, Path(tmp) / "base") as (base_tree, base_sha):
        caches = [Path(args.cache_dir or Path(tmp) / name) for name in ("base", "new")]
        base = side(base_tree, caches[0], args.quick)
        new = side(ROOT, caches[1], args.quick)
    differ = sorted(k for k in base if base[k] != new.get(k))
    result = {"base": base_sha, "requests": len(base), "differ": differ,
              "same": not differ and base.keys() == new.keys(), "outputs": new}
    path = write_result(args.out, "same_outputs", result, quick=args.quick)
    print(json.dumps({"out": str(path), "base": base_sha, "requests": len(base),
                      "differ": differ}))
    return result


if __name__ == "__main__":
    main()
