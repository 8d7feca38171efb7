"""Speculative decoding benchmark on the embedded model: AR vs exact SD vs SMC-SD.

For each workload of the config (experiments/speculative_decoding.toml) and each method
of its grid, one model runs `warmup` runs (compiling) and then `repeats` measured runs;
figures are medians. Methods:
  ar_greedy, ar_sampled                  plain decoding
  exact_<draft>_g<G>                     exact SD, greedy: its tokens must equal ar_greedy's
  exact_sampled_ngram_g<G>               exact SD at the sampling temperature
  smc_<draft>_n<N>_g<G>                  SMC-SD with N particles (its default fallback on)
Drafts: "ngram", "self:K", and separate models built here: "truncated:K" (the first K
layers saved apart) and "noisy:S" (the whole model with Gaussian noise of S times each
matrix's standard deviation: a stand-in for a draft model that shares the tokenizer and
agrees well with the target; as slow as the target, so it serves quality checks only).
Speedups compare a method with AR in the same mode (greedy with greedy, sampled with
sampled). Sampled methods report the mean target log-likelihood per output token (under
the model at temperature 1), beside AR sampling's. If llama-cpp-python is installed,
llama.cpp's plain decode of the same GGUF is measured on the code-edit prompt as an
outside comparator (not a CI dependency).

SMC quality (config [smc_quality]): on a set of prompts, plain sampling against SMC-SD
with each draft, both with its fallback to exact speculation (the default) and forced
(min_agreement 0). Per draft: how often SMC fell back, the draft's measured agreement,
and for the answers that finished under SMC the mean target log-likelihood per token
against plain sampling's on the same prompts (target: within 10%) and the answers that
repeat a 2-token pattern more than 5 times where plain sampling does not (target: none).

Writes experiments/results/speculative_decoding-<UTC time>.json and .png.
Run: python experiments/speculative_decoding.py [CONFIG] [--quick] [--out DIR] [--cache-dir DIR]
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
                       smc_fallbacks=sum(r.metrics["smc_fallback"] is not None
                                         for r in results),
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


def build_draft(folder: Path, draft: str) -> str:
    """A draft spec the engine takes: "truncated:K" and "noisy:S" become GGUF files
    derived from the embedded model's (no other model shares SmolLM2's tokenizer
    offline); anything else is returned as it is."""
    kind, _, arg = draft.partition(":")
    if kind not in ("truncated", "noisy"):
        return draft
    path = folder / f"{kind}-{arg}.gguf"
    if not path.exists():
        write_derived_gguf(path, layers=int(arg) if kind == "truncated" else None,
                           noise=float(arg) if kind == "noisy" else None)
    return str(path)


def write_derived_gguf(path: Path, layers: int | None = None, noise: float | None = None,
                       source: str = "smollm2") -> None:
    """`source`'s GGUF (default the embedded model's) with only its first `layers`
    blocks (their tensors copied as they are: the same values the target loads), or with
    every matrix dequantized and given Gaussian noise of `noise` times its standard
    deviation (the head untied first, so it gets noise of its own)."""
    import gguf

    from xlr_jax.loading.gguf_file import GGUFFile
    from xlr_jax.loading.registry import resolve_model

    src = GGUFFile(resolve_model(source))
    arch = src.fields["general.architecture"]
    writer = gguf.GGUFWriter(str(path), arch)  # writes general.architecture itself
    for key, value in src.fields.items():
        if key == "general.architecture":
            continue
        if key == f"{arch}.block_count" and layers is not None:
            value = layers
        writer.add_key_value(key, value, gguf.GGUFValueType.get_type(value))
    tensors = {t.name: t for t in src.tensors}
    if layers is not None:
        tensors = {name: t for name, t in tensors.items()
                   if not name.startswith("blk.") or int(name.split(".")[1]) < layers}
    rng = np.random.default_rng(0)

    def noisy(t) -> np.ndarray:
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        w = w.reshape(tuple(reversed(t.shape)))
        if w.ndim == 2:
            w = w + (rng.standard_normal(w.shape) * noise * w.std()).astype(np.float32)
        return w

    for name, t in tensors.items():
        if noise is None:
            writer.add_tensor(name, t.data, raw_dtype=t.tensor_type)
        else:
            writer.add_tensor(name, noisy(t))
    if noise is not None and "output.weight" not in tensors:
        writer.add_tensor("output.weight", noisy(tensors["token_embd.weight"]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def max_pair_repeats(tokens: list[int]) -> int:
    """The most times any 2-token pattern repeats back to back (", and, and, and" -> 3)."""
    best = 0
    for i in range(len(tokens) - 1):
        k = 1
        while tokens[i + 2 * k:i + 2 * k + 2] == tokens[i:i + 2]:
            k += 1
        best = max(best, k)
    return best


def smc_quality(q: dict, max_batch: int, cache_dir: str | None) -> dict:
    """Plain sampling against SMC-SD per draft, fallback on and forced, on q's prompts and
    seeds (the answers of one prompt and seed are compared with each other)."""
    import tempfile

    import xlr_jax

    # at least the speed grid's rows: its plan, hence its compiled steps
    model = xlr_jax.load_model("smollm2", dtype="float32",
                               max_batch=max(*q["particles"], max_batch), cache_dir=cache_dir)
    prompts = [model.tokenizer.encode(model.chat_prompt([{"role": "user", "content": p}]))
               for p in q["prompts"]]
    runs = [(ids, seed) for ids in prompts for seed in q["seeds"]]
    kw = dict(max_tokens=q["max_tokens"], temperature=q["temperature"])

    def answer(ids, seed, spec=None) -> dict:
        r = model.generate(ids, seed=seed, speculative=spec, **kw)
        m = r.metrics
        return {"text": r.text, "log_likelihood_per_token": log_likelihood(model, ids,
                                                                           r.token_ids),
                "max_pair_repeats": max_pair_repeats(r.token_ids),
                "smc_fallback": m.get("smc_fallback"), "draft_agreement":
                m.get("draft_agreement"), "smc_cycles": m.get("smc_cycles"),
                "decode_tokens_per_s": m["decode_tokens_per_s"]}

    plain = [answer(ids, seed) for ids, seed in runs]
    print(f"smc_quality plain sampling: ll {np.mean([a['log_likelihood_per_token'] for a in plain]):.3f}",
          flush=True)
    rows = {}
    with tempfile.TemporaryDirectory() as scratch:
        for draft in q["drafts"]:
            path = build_draft(Path(scratch), draft)
            for n in q["particles"]:
                for mode, extra in (("fallback", {}), ("forced", {"min_agreement": 0})):
                    spec = {"method": "smc", "draft": path, "gamma": q["gamma"],
                            "particles": n, **extra}
                    answers = [answer(ids, seed, spec) for ids, seed in runs]
                    row = summarize_quality(plain, answers, q)
                    rows[f"smc_{draft}_n{n}_{mode}"] = {"draft": draft, "particles": n,
                                                         "mode": mode, **row,
                                                         "answers": answers}
                    print(f"smc_quality {draft:>12} n{n} {mode:>8}: fell back "
                          f"{row['fallbacks']}/{len(runs)}, agreement "
                          f"{row['mean_agreement']}, under SMC {row['finished_under_smc']}"
                          f" ll ratio {row['ll_ratio_vs_plain']} repeats "
                          f"{row['new_repeats']} pass {row['pass']}", flush=True)
    return {"plain": plain, "drafts": rows}


def summarize_quality(plain: list[dict], answers: list[dict], q: dict) -> dict:
    """The issue's target over the answers that finished under SMC (no fallback): mean
    target log-likelihood per token within `ll_tolerance` of plain sampling's on the same
    prompts, and none repeating a 2-token pattern more than `max_repeats` times where
    plain sampling's does not."""
    under = [i for i, a in enumerate(answers) if a["smc_fallback"] is None]
    agreements = [a["draft_agreement"] for a in answers if a["draft_agreement"] is not None]
    row = {"fallbacks": len(answers) - len(under), "finished_under_smc": len(under),
           "mean_agreement": round(float(np.mean(agreements)), 3) if agreements else None,
           "ll_smc": None, "ll_plain_same_prompts": None, "ll_ratio_vs_plain": None,
           "new_repeats": 0, "pass": None}
    if not under:
        return row
    ll_smc = float(np.mean([answers[i]["log_likelihood_per_token"] for i in under]))
    ll_plain = float(np.mean([plain[i]["log_likelihood_per_token"] for i in under]))
    new = sum(answers[i]["max_pair_repeats"] > q["max_repeats"] >= plain[i]["max_pair_repeats"]
              for i in under)
    ratio = ll_smc / ll_plain
    return {**row, "ll_smc": ll_smc, "ll_plain_same_prompts": ll_plain,
            "ll_ratio_vs_plain": round(ratio, 3), "new_repeats": new,
            "pass": abs(ratio - 1) <= q["ll_tolerance"] and new == 0}


def measure_workload(config: dict, run: dict, grid: dict, name: str,
                     cache_dir: str | None) -> dict:
    """Every method of the grid on one workload, in this process (see main). Drafts
    "truncated:K" and "noisy:S" are separate models built here (see build_draft)."""
    import tempfile

    import xlr_jax

    model = xlr_jax.load_model("smollm2", dtype="float32", max_batch=run["max_batch"],
                               cache_dir=cache_dir)
    ids = workload_prompts(model, {name: config["workloads"][name]})[name]
    rows = {}
    with tempfile.TemporaryDirectory() as scratch:
        for method in grid_methods(grid):
            spec = method["spec"]
            if spec:
                spec = {**spec, "draft": build_draft(Path(scratch), spec["draft"])}
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
    ap.add_argument("--cache-dir", default=None,
                    help="the model cache: converted params, compiled steps (default: xlr-jax's)")
    ap.add_argument("--workload", help=argparse.SUPPRESS)  # internal: one workload's process
    ap.add_argument("--only", choices=("speed", "quality"),
                    help="run only the speed grid or only the SMC quality check")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(REPO))
    from xlr_jax.bench.run import environment, git_state
    from xlr_jax.loading.registry import resolve_model

    config = tomllib.loads(Path(args.config).read_text())
    run = {**config["run"], **(config["quick"] if args.quick else {})}
    grid = config["quick_grid" if args.quick else "grid"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    quality = {**config["smc_quality"], **(config["quick_smc_quality"] if args.quick else {})}
    if args.workload:
        part = (smc_quality(quality, run["max_batch"], args.cache_dir)
                if args.workload == "smc_quality" else
                measure_workload(config, run, grid, args.workload, args.cache_dir))
        (out / f"part-{args.workload}.json").write_text(json.dumps(part))
        return 0

    started, git = datetime.now(timezone.utc), git_state()  # the code that ran
    t0 = time.perf_counter()
    stem = out / f"speculative_decoding-{started.strftime('%Y%m%dT%H%M%SZ')}"
    workloads: dict = {}
    result = {"config_path": args.config, "config": config, "quick": args.quick,
              "settings": run, "started_utc": started.isoformat(),
              "environment": environment(False), "git": git, "workloads": workloads}
    speed = args.only != "quality"
    names = (run.get("workloads", list(config["workloads"])) if speed else []) + \
        (["smc_quality"] if args.only != "speed" else [])
    prompt_text, targets = {}, {}
    for name in names:
        # one process per workload: a single process compiling every step variant of the
        # whole grid ran out of LLVM code memory (method 37 of 46)
        command = [sys.executable, __file__, args.config, "--out", str(out), "--workload", name]
        if args.cache_dir:
            command += ["--cache-dir", args.cache_dir]
        subprocess.run(command + (["--quick"] if args.quick else []), check=True)
        part_path = out / f"part-{name}.json"
        part = json.loads(part_path.read_text())
        part_path.unlink()
        if name == "smc_quality":
            result["smc_quality"] = {"settings": quality, **part}
            targets["smc_quality"] = {d: row["pass"] for d, row in part["drafts"].items()
                                      if row["mode"] == "fallback"}
        else:
            prompt_text[name] = part.pop("prompt_text")
            workloads[name] = {**part, "summary": summarize(part["methods"])}
        # written after each part: a later failure keeps what was measured
        result["wall_s"] = time.perf_counter() - t0
        Path(f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    if speed:
        best = workloads["code_edit"]["summary"]["best_speedup_vs_ar"]
        bound = config["targets"]["code_edit_best_speedup_min"]
        targets["code_edit_best_speedup"] = {"value": best, "min": bound, "pass": best >= bound}
        result["llama_cpp"] = llama_cpp_decode(resolve_model("smollm2"),
                                               prompt_text["code_edit"], run["max_tokens"])
    result.update(wall_s=time.perf_counter() - t0, targets=targets)
    Path(f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    if speed:
        plot(result, Path(f"{stem}.png"))
        for name, w in workloads.items():
            print(f"{name}: best {w['summary']['best_method']} "
                  f"x{w['summary']['best_speedup_vs_ar']:.2f} vs AR")
        print(f"target code_edit best speedup >= {bound}: {best:.2f} "
              f"{'PASS' if best >= bound else 'FAIL'}")
    for name, ok in targets.get("smc_quality", {}).items():
        print(f"SMC quality {name}: {'PASS' if ok else 'no answer under SMC' if ok is None else 'FAIL'}")
    print(f"results: {stem}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
