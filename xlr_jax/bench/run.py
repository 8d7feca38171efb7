"""The benchmark runner: `xlr bench CONFIG.toml` measures engines, writes JSON, prints a table.

A config (see experiments/*.toml) names the engines, the prompt and decode
lengths, the bandwidth probe and the targets; `[quick]` overrides `[run]` for
smoke tests. Results go to experiments/results/<config stem>-<UTC time>.json.
"""
from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
import tomllib
from datetime import datetime, timezone
from pathlib import Path

import jax
from tqdm.auto import tqdm

from xlr_jax.bench.engines import (RUNNERS, BenchError, leading_agreement, measure,
                                   measure_streams, prompt_ids, roofline)
from xlr_jax.ops import cpu_kernels
from xlr_jax.planning.hardware import cpu_features, cpu_name, measure_bandwidth

REPO = Path(__file__).resolve().parents[1]


def read_config(path: Path) -> dict:
    """A benchmark config, refused if it cannot be read or needs a GPU JAX does not see."""
    try:
        config = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise BenchError(f"cannot read the config {path}: {e}") from e
    backend = jax.default_backend()
    if config.get("requirements", {}).get("gpu") and backend != "gpu":
        raise BenchError(
            f"{path} needs a GPU ([requirements] gpu = true) but JAX sees only the {backend}; "
            "run it on a GPU machine with jax[cuda12]")
    return config


def run_bench(config_path: str, out_dir: str | None = None, quick: bool = False,
              sweep: bool = False, repeats: int | None = None) -> dict:
    """Run the config's engines (or with `sweep`, every cell of its grid, `repeats` rounds:
    see `xlr_jax.bench.sweep`); write and return the results (plus their `json_path`)."""
    path = Path(config_path)
    config = read_config(path)
    if sweep:
        from xlr_jax.bench.sweep import run_sweep

        return run_sweep(config, path, out_dir, quick, repeats)
    if "sweep" in config:
        raise BenchError(f"{path} declares a grid ([sweep]): run it with --sweep")
    if "engines" not in config:
        raise BenchError(f"{path} names no [[engines]] to measure")
    run = {**config["run"], **(config.get("quick", {}) if quick else {}),
           **({"repeats": repeats} if repeats else {})}
    engine_specs = config["engines"]
    started = datetime.now(timezone.utc)
    t0, load_before = time.perf_counter(), os.getloadavg()[0]

    kind = run.get("bandwidth", "read")
    bandwidth = measure_bandwidth(kind, run.get("bandwidth_gib", 1.0), run.get("bandwidth_runs", 10))
    gb_per_s = bandwidth[f"{kind}_bandwidth_gb_per_s"]
    if "streams" in run:
        figures, table = _batching(config, run), _batching_table
    elif isinstance(run["prompt_tokens"], list):
        figures, table = _sweep(config, run, gb_per_s), _sweep_table
    else:
        figures, table = _one_length(config, run, gb_per_s), _table
    result = {
        "config_path": str(path), "config": config, "quick": quick, **figures,
        "started_utc": started.isoformat(), "wall_s": time.perf_counter() - t0,
        # other work on the machine skews every figure; well above 0 at start means it was busy
        "load_average_1m": {"start": load_before, "end": os.getloadavg()[0]},
        "environment": environment(any(s["kind"] == "transformers" for s in engine_specs)),
        "git": git_state(), "bandwidth": bandwidth,
        "all_targets_pass": all(t["pass"] for t in figures["targets"].values()),
    }
    out = Path(out_dir) if out_dir else path.parent / "results"
    return save_bench_result(result, out / f"{path.stem}-{started:%Y%m%dT%H%M%SZ}.json",
                             table(result))


def save_bench_result(result: dict, json_path: Path, table: str) -> dict:
    """Write a bench result as JSON, print its table and path; the result plus its
    `json_path`."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    print(table)
    print(f"results: {json_path}")
    return {**result, "json_path": str(json_path)}


def _one_length(config: dict, run: dict, gb_per_s: float) -> dict:
    """Each engine in turn on one prompt: settings, engines' figures, targets."""
    engines, ids = {}, None
    for spec in config["engines"]:
        runner = RUNNERS[spec["kind"]](spec)
        if ids is None or config["prompt"]["kind"] == "random":  # random ids follow the vocab
            ids = prompt_ids(config["prompt"], run["prompt_tokens"], runner)
        engines[runner.label] = _figures(runner, ids, run, gb_per_s)
        del runner  # one model in memory at a time
        gc.collect()
    _compare_to_baseline(engines)
    return {"settings": {**run, "prompt_tokens": len(ids)}, "engines": engines,
            "targets": _check_targets(config.get("targets", {}), engines)}


def _figures(runner, ids: list[int], run: dict, gb_per_s: float) -> dict:
    """One engine's timings on `ids`, with its decode roofline."""
    figures = measure(runner, ids, run["decode_tokens"], run["repeats"], run.get("warmup", 1))
    figures["roofline"] = roofline(runner, len(ids), run["decode_tokens"], gb_per_s,
                                   figures["decode_tokens_per_s"])
    return {"kind": runner.kind, **runner.info, **figures}


def _sweep(config: dict, run: dict, gb_per_s: float) -> dict:
    """`prompt_tokens` a list: every engine is loaded once and they take turns at each
    length (side by side, so a slower hour slows both); targets hold at every length."""
    runners = [RUNNERS[spec["kind"]](spec) for spec in config["engines"]]
    points, targets = [], {}
    for n in tqdm(run["prompt_tokens"], desc="prompt lengths", unit="length"):
        ids = prompt_ids(config["prompt"], n, runners[0])
        engines = {r.label: _figures(r, ids, run, gb_per_s) for r in runners}
        _compare_to_baseline(engines)
        for name, t in _check_targets(config.get("targets", {}), engines).items():
            targets[f"{name}@{len(ids)}"] = t
        points.append({"prompt_tokens": len(ids), "engines": engines})
    return {"settings": run, "sweep": points, "targets": targets}


def _batching(config: dict, run: dict) -> dict:
    """`streams` (a list of stream counts, 1 among them): each xlr engine decodes that many
    different prompts at once; targets hold on its aggregate speedup over one stream."""
    counts = run["streams"]
    if not (isinstance(counts, list) and 1 in counts
            and all(isinstance(c, int) and c > 0 for c in counts)):
        raise BenchError(f"[run] streams must list positive stream counts including 1, "
                         f"e.g. streams = [1, 8] (got {counts!r})")
    engines = {}
    for spec in config["engines"]:
        if not spec["kind"].startswith("xlr"):
            raise BenchError(f"streams measure xlr engines only; remove the {spec['kind']} "
                             f"engine or the streams setting")
        runner = RUNNERS[spec["kind"]](spec)
        # stream i's prompt: the prompt spec with seed + i (a different shuffle or draw)
        prompts = [prompt_ids({**config["prompt"], "seed": config["prompt"].get("seed", 0) + i},
                              run["prompt_tokens"], runner) for i in range(max(counts))]
        engines[runner.label] = {"kind": runner.kind, **runner.info, **measure_streams(
            runner, prompts, run["decode_tokens"], sorted(counts), run["repeats"],
            run.get("warmup", 1))}
        del runner
        gc.collect()
    return {"settings": run, "engines": engines,
            "targets": _check_targets(config.get("targets", {}), engines)}


def _compare_to_baseline(engines: dict) -> None:
    """Add speed ratios and greedy agreement against the transformers engine of the same model."""
    base = next((e for e in engines.values() if e["kind"] == "transformers"), None)
    if base is None:
        return
    for e in engines.values():
        if e["kind"] != "transformers" and e["model"] == base["model"]:
            e["vs_transformers"] = {
                "decode_speedup_vs_transformers": e["decode_tokens_per_s"] / base["decode_tokens_per_s"],
                "ttft_ratio_vs_transformers": e["ttft_s"] / base["ttft_s"],
                "greedy_agreement_tokens": leading_agreement(e["token_ids"], base["token_ids"]),
                "decoded_tokens": e["completion_tokens"],
            }


def _check_targets(targets: dict, engines: dict) -> dict:
    """Targets are `<figure>_min` / `<figure>_max`, checked on every xlr engine that has the
    figure, except ablations (an engine spec with `check_targets = false`)."""
    out = {}
    for label, e in engines.items():
        if e["kind"] == "transformers" or not e.get("check_targets", True):
            continue
        figures = {**({"roofline_fraction": e["roofline"]["roofline_fraction"]}
                      if "roofline" in e else {}),
                   **({"batching_speedup": e["batching_speedup"]}
                      if "batching_speedup" in e else {}),
                   **e.get("vs_transformers", {})}
        for key, bound in targets.items():
            name, _, side = key.rpartition("_")
            if name in figures:
                value = figures[name]
                ok = value >= bound if side == "min" else value <= bound
                out[f"{label}.{name}"] = {"value": value, side: bound, "pass": ok}
    return out


def environment(uses_torch: bool) -> dict:
    packages = ["jax", "jaxlib", "numpy"] + (["torch", "transformers"] if uses_torch else [])
    env = {f"{p}_version": importlib.metadata.version(p) for p in packages}
    env.update(python=platform.python_version(), platform=platform.platform(),
               cpu_model=cpu_name(), cpu_count=os.cpu_count(), cpu_flags=cpu_features(),
               cpu_kernels=_cpu_kernels_state(),
               xla_flags=os.environ.get("XLA_FLAGS", ""),  # e.g. an ISA cap (--xla_cpu_max_isa)
               jax_backend=jax.default_backend(), device_kind=jax.devices()[0].device_kind,
               device_count=jax.device_count())
    return env


def _cpu_kernels_state() -> str:
    if jax.default_backend() != "cpu":
        return "not used (not the CPU backend)"
    return cpu_kernels.status() or f"on (built for {cpu_kernels.default_target()})"


def git_state() -> dict:
    def git(*args):
        try:
            r = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    # tracked files only: result JSONs written beside the code do not make it dirty
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"sha": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


def write_result(out_dir, experiment: str, result: dict, quick: bool = False) -> Path:
    """Write an experiment's result as OUT/<experiment>[-quick]-<UTC time>.json, stamped
    with its creation time, the environment and the git state; returns the path."""
    now = datetime.now(timezone.utc)
    result = {"experiment": experiment, "created": now.isoformat(timespec="seconds"),
              "environment": environment(uses_torch=False), "git": git_state(),
              "quick": quick, **result}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{experiment}{'-quick' if quick else ''}-{now:%Y%m%dT%H%M%SZ}.json"
    path.write_text(json.dumps(result, indent=2))
    return path


@contextlib.contextmanager
def git_worktree(repo: Path, rev: str, path: Path):
    """A detached worktree of `repo` at `rev` in `path` for the block, removed after (to run
    an earlier commit side by side with this one). Yields (path, the commit's sha)."""
    subprocess.run(["git", "worktree", "add", "--detach", "-f", str(path), rev], cwd=repo,
                   check=True, capture_output=True)
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, check=True,
                             capture_output=True, text=True).stdout.strip()
        yield path, sha
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=repo,
                       capture_output=True)


def _table(result: dict) -> str:
    bw = result["bandwidth"]
    lines = [f"{'engine':<22}{'ttft_s':>9}{'decode tok/s':>14}{'roofline tok/s':>16}{'fraction':>10}"]
    for label, e in result["engines"].items():
        r = e["roofline"]
        lines.append(f"{label:<22}{e['ttft_s']:>9.3f}{e['decode_tokens_per_s']:>14.1f}"
                     f"{r['roofline_decode_tokens_per_s']:>16.1f}{r['roofline_fraction']:>10.2f}")
    lines.append(f"{bw['kind']} bandwidth {bw[bw['kind'] + '_bandwidth_gb_per_s']:.1f} GB/s "
                 f"({result['environment']['device_kind']})")
    for label, e in result["engines"].items():
        r = e["roofline"]
        lines.append(f"{label}: {r['bytes_per_token'] / 1e6:.1f} MB/token (weights "
                     f"{r['weight_bytes_per_token'] / 1e6:.1f} + KV {r['kv_bytes_per_token'] / 1e6:.1f})")
        if "vs_transformers" in e:
            v = e["vs_transformers"]
            lines.append(f"{label} vs transformers: decode x{v['decode_speedup_vs_transformers']:.2f}, "
                         f"TTFT ratio {v['ttft_ratio_vs_transformers']:.2f}, greedy agreement "
                         f"{v['greedy_agreement_tokens']}/{v['decoded_tokens']} tokens")
    return "\n".join(lines + _target_lines(result["targets"]))


def _target_lines(targets: dict) -> list[str]:
    lines = []
    for name, t in targets.items():
        bound = f">= {t['min']}" if "min" in t else f"<= {t['max']}"
        lines.append(f"target {name} {bound}: {t['value']:.3f} {'PASS' if t['pass'] else 'FAIL'}")
    return lines


def _sweep_table(result: dict) -> str:
    labels = list(result["sweep"][0]["engines"])
    lines = [f"{'prompt':>7}" + "".join(f"{label + ' ttft_s':>28}" for label in labels)
             + f"{'ratio':>8}"]
    for point in result["sweep"]:
        engines = point["engines"]
        ratios = [e["vs_transformers"]["ttft_ratio_vs_transformers"] for e in engines.values()
                  if "vs_transformers" in e]
        lines.append(f"{point['prompt_tokens']:>7}" + "".join(
            f"{engines[label]['ttft_s']:>28.3f}" for label in labels)
            + "".join(f"{r:>8.2f}" for r in ratios))
    return "\n".join(lines + _target_lines(result["targets"]))


def _batching_table(result: dict) -> str:
    counts = sorted(result["settings"]["streams"])
    lines = [f"{'engine':<22}" + "".join(f"{f'{c} streams tok/s':>18}" for c in counts)
             + f"{'speedup':>9}"]
    for label, e in result["engines"].items():
        lines.append(f"{label:<22}" + "".join(
            f"{e['streams'][str(c)]['decode_tokens_per_s']:>18.1f}" for c in counts)
            + f"{e['batching_speedup']:>9.2f}")
    return "\n".join(lines + _target_lines(result["targets"]))


def add_cli(subparsers) -> None:
    """Register `bench CONFIG.toml [--sweep] [--repeats N] [--out DIR] [--quick]`."""
    p = subparsers.add_parser(
        "bench", help="run a benchmark config (experiments/*.toml) or an ablation grid",
        description="Measure the engines a config names, or with --sweep every cell of an "
                    "ablation grid (experiments/ablations/*.toml), each cell in a process of "
                    "its own; one JSON of figures, environment and git state. `xlr report` "
                    "draws the results.")
    p.add_argument("config", metavar="CONFIG.toml", help="the benchmark config")
    p.add_argument("--out", metavar="DIR", help="results folder (default: results/ beside the config)")
    p.add_argument("--quick", action="store_true", help="the config's [quick] sizes: a smoke test")
    p.add_argument("--sweep", action="store_true",
                   help="run the grid the config declares ([sweep]): the product of its "
                        "listed values, each cell in a fresh process")
    p.add_argument("--repeats", type=int, metavar="N",
                   help="with --sweep: rounds over the grid (figures: median, min and max); "
                        "without: runs per engine (the config's [run] repeats)")
    p.set_defaults(func=_cli)


def _cli(args) -> int:
    try:
        result = run_bench(args.config, args.out, quick=args.quick, sweep=args.sweep,
                           repeats=args.repeats)
    except BenchError as e:
        print(f"xlr bench: {e}", file=sys.stderr)
        return 2
    return 1 if result.get("failed_cells") else 0
