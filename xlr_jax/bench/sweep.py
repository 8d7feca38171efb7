"""`xlr bench CONFIG --sweep`: every cell of an ablation grid, each in a process of its own.

An ablation config (experiments/ablations/*.toml) names what a cell measures (`[run]
measure`: decode, agent, speculative or load; see `xlr_jax.bench.cells`), the base engine
(`[engine]`: load_model's options and the measure's own), the prompt (`[prompt]`) and the
grid: `[sweep]` maps engine options to lists of values and the grid is their product, or
`[[sweep]]` lists several such tables and the grid is the union of their products
(speculation off, then exact x drafts x gamma, then SMC x N x gamma). `[quick]` overrides
`[run]` (its `[quick.engine]` the engine) and `[quick_sweep]` replaces the grid: a smoke test.

A fresh process per cell: no compiled program, in-memory cache or allocation of one cell
reaches the next (what is on disk, converted params and compiled steps, does: it shortens
the warm-up each cell runs before it times anything). With `--repeats N` the grid runs N
rounds, the cells in the same order each round, so a slower minute touches every cell;
each figure is reported as its median and min/max over the rounds. A cell that fails is
recorded with its error and the rest go on. One JSON: environment, git sha and dirty flag,
the config and its hash, the hardware's peaks, and per cell its values, each round's
figures, their summary and detail.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

from tqdm.auto import tqdm

from xlr_jax.bench.cells import MEASURES, check_cell, run_cell_process
from xlr_jax.bench.engines import BenchError


def grid(sweep) -> list[dict]:
    """The cells of `[sweep]` (a table: the product of its lists) or `[[sweep]]` (the
    union of each table's product), in order: the first key varies slowest."""
    tables = sweep if isinstance(sweep, list) else [sweep]
    cells = []
    for table in tables:
        if not isinstance(table, dict) or not table:
            raise BenchError(f"a sweep table maps options to lists of values, e.g. "
                             f"attn_impl = [\"xla\", \"cpu\"] (got {table!r})")
        bad = [k for k, v in table.items() if not isinstance(v, list) or not v]
        if bad:
            value = table[bad[0]]
            raise BenchError(f"sweep values must be non-empty lists: {', '.join(bad)}"
                             + (f" (e.g. {bad[0]} = [{value!r}])"
                                if not isinstance(value, list) else ""))
        for values in itertools.product(*table.values()):
            cells.append(dict(zip(table, values)))
    return cells


def cell_name(values: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items())


def config_hash(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def summarize(rounds: list[dict]) -> dict:
    """Median, min and max over rounds of each number, and element by element of each
    list of numbers of one length (per-turn and per-cycle series)."""
    out = {}
    for key in rounds[0]:
        values = [r[key] for r in rounds if key in r]
        if all(_number(v) for v in values):
            out[key] = {"median": statistics.median(values), "min": min(values),
                        "max": max(values)}
        elif (all(isinstance(v, list) and all(map(_number, v)) for v in values)
              and len({len(v) for v in values}) == 1):
            columns = list(zip(*values))
            out[key] = {"median": [statistics.median(c) for c in columns],
                        "min": [min(c) for c in columns], "max": [max(c) for c in columns]}
    return out


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def settings(config: dict, quick: bool) -> tuple[dict, dict, list[dict]]:
    """The run settings, the base engine and the cells: with `quick`, [quick] over [run]
    (its [quick.engine] over [engine]) and [quick_sweep] for [sweep] where there is one."""
    quick_run = dict(config.get("quick", {})) if quick else {}
    engine = {**config["engine"], **quick_run.pop("engine", {})}
    cells = grid(config["quick_sweep"] if quick and "quick_sweep" in config
                 else config["sweep"])
    return {**config["run"], **quick_run}, engine, cells


def run_sweep(config: dict, path: Path, out_dir: str | None, quick: bool,
              repeats: int | None) -> dict:
    """Every cell of the config's grid, `repeats` rounds; write and return the results."""
    from xlr_jax.bench.report import markdown_table
    from xlr_jax.bench.run import environment, git_state, save_bench_result
    from xlr_jax.planning.hardware import probe

    if "sweep" not in config:
        raise BenchError(f"{path} has no [sweep] table: it declares no grid (run it without "
                         f"--sweep)")
    for key in ("run", "engine"):
        if key not in config:
            raise BenchError(f"{path} has no [{key}] table: an ablation config needs [run] "
                             f"(with measure = ...), [engine] and [sweep]")
    run, engine, cells = settings(config, quick)
    measure = run.get("measure")
    if measure not in MEASURES:
        raise BenchError(f"{path}: [run] measure must be one of {', '.join(MEASURES)} "
                         f"(got {measure!r})")
    for values in cells:
        check_cell(measure, {**engine, **values})
    rounds = repeats or run.get("rounds", 1)
    if rounds < 1:
        raise BenchError(f"--repeats must be at least 1 (got {rounds})")
    started = datetime.now(timezone.utc)
    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    results = [{"name": cell_name(values), "values": values, "rounds": []} for values in cells]
    t0 = time.perf_counter()
    with tqdm(total=len(cells) * rounds, desc=f"{path.stem} cells", unit="cell") as bar:
        for r in range(rounds):
            for i, (values, cell) in enumerate(zip(cells, results)):
                bar.set_postfix_str(f"round {r + 1}/{rounds}: {cell['name']}")
                spec = {"measure": measure, "engine": {**engine, **values},
                        "run": run, "prompt": config.get("prompt", {}),
                        "nonce": f"{stamp}c{i}r{r}"}
                cell["rounds"].append(run_cell_process(spec, run.get("cell_timeout_s")))
                bar.update()
    for cell in results:
        good = [r for r in cell["rounds"] if "error" not in r]
        cell["errors"] = [r["error"] for r in cell["rounds"] if "error" in r]
        cell["summary"] = summarize([r["figures"] for r in good]) if good else {}
    result = {"kind": "sweep", "config_path": str(path), "config": config,
              "config_hash": config_hash(config), "quick": quick, "measure": measure,
              "settings": run, "repeats": rounds, "started_utc": started.isoformat(),
              "wall_s": time.perf_counter() - t0, "environment": environment(False),
              "hardware": dataclasses.asdict(probe()), "git": git_state(), "cells": results,
              "failed_cells": sum(bool(c["errors"]) for c in results)}
    out = Path(out_dir) if out_dir else path.parent / "results"
    return save_bench_result(result, out / f"{path.stem}{'-quick' if quick else ''}-{stamp}.json",
                             markdown_table(result))
