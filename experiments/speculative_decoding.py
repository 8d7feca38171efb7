"""Speculative decoding benchmark on the embedded model: AR vs exact SD vs SMC-SD.

For each workload of the config (experiments/speculative_decoding.toml) and each method
of its grid, one model runs `warmup` runs (compiling) and then `repeats` measured runs;
figures are medians. Methods:
  ar_greedy, ar_sampled                  plain decoding
  exact_<draft>_g<G>                     exact SD, greedy: its tokens must equal ar_greedy's
                                         (draft "truncated:K": a separate draft model,
                                         the first K layers saved apart)
  exact_sampled_ngram_g<G>               exact SD at the sampling temperature
  smc_<draft>_n<N>_g<G>                  SMC-SD with N particles (N = 1 is exact SD)
Speedups compare a method with AR in the same mode (greedy with greedy, sampled with
sampled). Sampled methods report the mean target log-likelihood per output token (under
the model at temperature 1), beside AR sampling's, as a quality check. If
llama-cpp-python is installed, llama.cpp's plain decode of the same GGUF is measured on the
code-edit prompt as an outside comparator (not a CI dependency).

Writes experiments/results/speculative_decoding-<UTC time>.json and .png.
Run: python experiments/speculative_decoding.py [CONFIG] [--quick] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import tomllib
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def workload_prompts(model, workloads: dict) -> dict[str, list[int]]:
    prompts = {}
    for name, w in workloads.items():
        if "source" in w:
            code = (REPO / w["source"]).read_text()
            if "typo" in w:
                code = code.replace(*w["typo"])
            message = f"{w['instruction']}\n\n```python\n{code}\n```"
        else:
            message = w["message"]
        prompts[name] = model.tokenizer.encode(
            model.chat_prompt([{"role": "user", "content": message}]))
    return prompts


def grid_methods(grid: dict) -> list[dict]:
    methods = [{"name": "ar_greedy", "mode": "greedy", "spec": None},
               {"name": "ar_sampled", "mode": "sampled", "spec": None}]
    for entry in grid["exact"]:
        for g in entry["gammas"]:
            methods.append({"name": f"exact_{entry['draft']}_g{g}", "mode": "greedy",
                            "spec": {"method": "exact", "draft": entry["draft"], "gamma": g}})
    for g in grid["sampled_exact_gammas"]:
        methods.append({"name": f"exact_sampled_ngram_g{g}", "mode": "sampled",
                        "spec": {"method": "exact", "draft": "ngram", "gamma": g}})
    for entry in grid["smc"]:
        for n in entry["particles"]:
            for g in entry["gammas"]:
                methods.append({"name": f"smc_{entry['draft']}_n{n}_g{g}", "mode": "sampled",
                                "spec": {"method": "smc", "draft": entry["draft"], "gamma": g,
                                         "particles": n}})
    return methods


def log_likelihood(model, ids: list[int], out: list[int]) -> float:
    """Mean log p_target(token) over `out` after `ids` (temperature 1)."""
    logits = model.logits(ids + out)[len(ids) - 1:len(ids) + len(out) - 1].astype(np.float64)
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return float(np.mean(logp[np.arange(len(out)), out]))


def run_method(model, ids, method: dict, run: dict) -> dict:
    sampled = method["mode"] == "sampled"
    kw = dict(max_tokens=run["max_tokens"], speculative=method["spec"],
              temperature=run["temperature"] if sampled else 0.0)
    for i in range(run["warmup"]):
        model.generate(ids, seed=i, **kw)
    results = [model.generate(ids, seed=i, **kw) for i in range(run["repeats"])]
    med = lambda key: statistics.median(r.metrics.get(key, 0.0) for r in results)  # noqa: E731
    row = {"mode": method["mode"], "spec": method["spec"],
           "decode_tokens_per_s": med("decode_tokens_per_s"),
           "completion_tokens": med("completion_tokens"),
           "token_ids": results[0].token_ids}
    if method["spec"]:
        row.update(accepted_per_pass=med("accepted_per_pass"),
                   acceptance_rate=med("acceptance_rate"), target_passes=med("target_passes"))
        if method["spec"]["method"] == "smc":
            row.update(resamples=med("resamples"),
                       particles_mean=statistics.median(
                           float(np.mean(r.metrics["particles"])) for r in results))
    if sampled:
        row["log_likelihood_per_token"] = statistics.median(
            log_likelihood(model, ids, r.token_ids) for r in results)
    return row


def llama_cpp_decode(gguf: Path, prompt: str, max_tokens: int) -> dict:
    """llama.cpp's plain greedy decode rate of the same GGUF, when llama-cpp-python is here."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return {"available": False, "reason": "llama-cpp-python is not installed"}
    import os

    llm = Llama(model_path=str(gguf), n_ctx=4096, n_threads=os.cpu_count(), verbose=False)
    stamps = []
    for _ in llm(prompt, max_tokens=max_tokens, temperature=0.0, stream=True):
        stamps.append(time.perf_counter())
    rate = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
    return {"available": True, "decode_tokens_per_s": rate, "tokens": len(stamps)}


def summarize(rows: dict) -> dict:
    """Speedups against AR in the same mode; greedy exact SD checked against greedy AR."""
    ar = {"greedy": rows["ar_greedy"], "sampled": rows["ar_sampled"]}
    for name, row in rows.items():
        base = ar[row["mode"]]
        row["speedup_vs_ar"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        if row["mode"] == "greedy" and row["spec"]:
            row["equals_ar_greedy"] = row["token_ids"] == ar["greedy"]["token_ids"]
    best = max((r for r in rows.values() if r["spec"]), key=lambda r: r["speedup_vs_ar"])
    best_name = next(n for n, r in rows.items() if r is best)
    return {"best_method": best_name, "best_speedup_vs_ar": best["speedup_vs_ar"]}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = result["workloads"]
    fig, axes = plt.subplots(1, len(workloads), figsize=(7 * len(workloads), 9), squeeze=False)
    for ax, (name, w) in zip(axes[0], workloads.items()):
        rows = w["methods"]
        names = sorted(rows, key=lambda n: rows[n]["decode_tokens_per_s"])
        colors = ["tab:gray" if not rows[n]["spec"] else
                  "tab:blue" if rows[n]["spec"]["method"] == "exact" else "tab:orange"
                  for n in names]
        ax.barh(names, [rows[n]["decode_tokens_per_s"] for n in names], color=colors)
        for mode, style in (("ar_greedy", "--"), ("ar_sampled", ":")):
            ax.axvline(rows[mode]["decode_tokens_per_s"], color="black", ls=style, lw=1,
                       label=f"{mode} {rows[mode]['decode_tokens_per_s']:.0f} tok/s")
        ax.set_title(f"{name}: best {w['summary']['best_method']} "
                     f"x{w['summary']['best_speedup_vs_ar']:.2f}")
        ax.set_xlabel("decode tokens/s (median)")
        ax.tick_params(axis="y", labelsize=7)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle("Speculative decoding, SmolLM2-135M f32 on the CPU "
                 "(gray AR, blue exact SD, orange SMC-SD)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def truncated_draft(folder: Path, layers: int) -> str:
    """A separate draft model for the draft-model path: the embedded model's first `layers`
    layers with its final norm and head, saved by transformers as safetensors (no other
    model shares SmolLM2's tokenizer offline)."""
    import torch
    from transformers import AutoModelForCausalLM

    from xlr_jax.registry import resolve_model

    path = folder / f"truncated-{layers}"
    if not (path / "config.json").exists():
        gguf = resolve_model("smollm2")
        hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                  dtype=torch.float32)
        hf.config.num_hidden_layers = layers
        small = type(hf)(hf.config)  # a GGUF-loaded model refuses to be saved: copy it
        missing, _ = small.load_state_dict(hf.state_dict(), strict=False)  # drops layers >= K
        if missing:
            raise RuntimeError(f"truncated draft: weights not copied: {missing}")
        small.save_pretrained(path, safe_serialization=True)
    return str(path)


def measure_workload(config: dict, run: dict, grid: dict, name: str) -> dict:
    """Every method of the grid on one workload, in this process (see main). A draft
    "truncated:K" is a separate model built here (see truncated_draft)."""
    import tempfile

    import xlr_jax

    model = xlr_jax.load_model("smollm2", dtype="float32", max_batch=run["max_batch"])
    ids = workload_prompts(model, {name: config["workloads"][name]})[name]
    rows = {}
    with tempfile.TemporaryDirectory() as scratch:
        for method in grid_methods(grid):
            spec = method["spec"]
            if spec and spec["draft"].startswith("truncated:"):
                path = truncated_draft(Path(scratch), int(spec["draft"].split(":")[1]))
                spec = {**spec, "draft": path}
            row = run_method(model, ids, {**method, "spec": spec}, run)
            rows[method["name"]] = {**row, "spec": method["spec"]}
            print(f"{name:>10} {method['name']:<26} {row['decode_tokens_per_s']:7.1f} tok/s"
                  f"  {row.get('accepted_per_pass', 1.0):5.2f} tokens/pass", flush=True)
    return {"prompt_tokens": len(ids), "methods": rows,
            "prompt_text": model.tokenizer.decode(ids, skip_special_tokens=False)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="?", default=str(REPO / "experiments/speculative_decoding.toml"))
    ap.add_argument("--quick", action="store_true", help="tiny sizes and grid: a smoke test")
    ap.add_argument("--out", default=str(REPO / "experiments/results"), help="results folder")
    ap.add_argument("--workload", help=argparse.SUPPRESS)  # internal: one workload's process
    args = ap.parse_args(argv)

    sys.path.insert(0, str(REPO))
    from xlr_jax.bench import environment, git_state
    from xlr_jax.registry import resolve_model

    config = tomllib.loads(Path(args.config).read_text())
    run = {**config["run"], **(config["quick"] if args.quick else {})}
    grid = config["quick_grid" if args.quick else "grid"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.workload:
        part = measure_workload(config, run, grid, args.workload)
        (out / f"part-{args.workload}.json").write_text(json.dumps(part))
        return 0

    started, git = datetime.now(timezone.utc), git_state()  # the code that ran
    t0 = time.perf_counter()
    stem = out / f"speculative_decoding-{started.strftime('%Y%m%dT%H%M%SZ')}"
    workloads: dict = {}
    result = {"config_path": args.config, "config": config, "quick": args.quick,
              "settings": run, "started_utc": started.isoformat(),
              "environment": environment(False), "git": git, "workloads": workloads}
    prompt_text = {}
    for name in config["workloads"]:
        # one process per workload: a single process compiling every step variant of the
        # whole grid ran out of LLVM code memory (method 37 of 46)
        command = [sys.executable, __file__, args.config, "--out", str(out), "--workload", name]
        subprocess.run(command + (["--quick"] if args.quick else []), check=True)
        part_path = out / f"part-{name}.json"
        part = json.loads(part_path.read_text())
        part_path.unlink()
        prompt_text[name] = part.pop("prompt_text")
        workloads[name] = {**part, "summary": summarize(part["methods"])}
        # written after each workload: a later failure keeps what was measured
        result["wall_s"] = time.perf_counter() - t0
        Path(f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    best = workloads["code_edit"]["summary"]["best_speedup_vs_ar"]
    bound = config["targets"]["code_edit_best_speedup_min"]
    result.update(
        wall_s=time.perf_counter() - t0,
        llama_cpp=llama_cpp_decode(resolve_model("smollm2"), prompt_text["code_edit"],
                                   run["max_tokens"]),
        targets={"code_edit_best_speedup": {"value": best, "min": bound, "pass": best >= bound}})
    Path(f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, Path(f"{stem}.png"))
    for name, w in workloads.items():
        print(f"{name}: best {w['summary']['best_method']} "
              f"x{w['summary']['best_speedup_vs_ar']:.2f} vs AR")
    print(f"target code_edit best speedup >= {bound}: {best:.2f} "
          f"{'PASS' if best >= bound else 'FAIL'}")
    print(f"results: {stem}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
