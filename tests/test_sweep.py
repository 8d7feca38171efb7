"""Ablation grids and reports: `xlr bench CONFIG --sweep` runs every cell of the configs in
experiments/ablations/ in processes of their own (their --quick grids here, through the
real command line on the embedded model), and `xlr report` draws their figures."""
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from xlr_jax.bench.cells import MEASURES, check_cell
from xlr_jax.bench.engines import BenchError
from xlr_jax.bench.report import PLOTS, ReportError, markdown_table, write_report
from xlr_jax.bench.run import run_bench
from xlr_jax.bench.sweep import config_hash, grid, settings, summarize

REPO = Path(__file__).resolve().parents[1]
ABLATIONS = REPO / "experiments" / "ablations"
# what the issue asks a config of (one per lever)
LEVERS = {"prefix_cache", "speculation", "kernels", "page_size", "kv_dtype", "weights",
          "plan_overrides", "online_load"}


def test_a_table_is_the_product_of_its_lists_and_tables_are_a_union():
    assert grid({"a": [1, 2], "b": ["x", "y"]}) == [
        {"a": 1, "b": "x"}, {"a": 1, "b": "y"}, {"a": 2, "b": "x"}, {"a": 2, "b": "y"}]
    assert grid([{"method": ["off"]}, {"method": ["exact"], "gamma": [2, 4]}]) == [
        {"method": "off"}, {"method": "exact", "gamma": 2}, {"method": "exact", "gamma": 4}]


@pytest.mark.parametrize("sweep, message", [({"gamma": 4}, r"lists: gamma \(e.g. gamma = \[4\]\)"),
                                            ({"gamma": []}, "non-empty lists: gamma"),
                                            ([{}], "maps options to lists")])
def test_a_grid_that_lists_nothing_is_refused(sweep, message):
    with pytest.raises(BenchError, match=message):
        grid(sweep)


def test_rounds_summarize_as_median_min_and_max():
    rounds = [{"tok_s": 10.0, "ttft": [1.0, 0.2], "name": "a", "cycles": [1, 2]},
              {"tok_s": 30.0, "ttft": [3.0, 0.1], "name": "a", "cycles": [1]},
              {"tok_s": 20.0, "ttft": [2.0, 0.3], "name": "a", "cycles": [1, 2]}]
    s = summarize(rounds)
    assert s["tok_s"] == {"median": 20.0, "min": 10.0, "max": 30.0}
    assert s["ttft"] == {"median": [2.0, 0.2], "min": [1.0, 0.1], "max": [3.0, 0.3]}
    assert "name" not in s and "cycles" not in s  # not numbers; series of different lengths


def test_the_table_gives_each_cell_its_values_median_and_range():
    def cell(values, rounds, errors=()):
        return {"values": values, "summary": summarize(rounds) if rounds else {},
                "errors": list(errors)}

    result = {"measure": "speculative", "cells": [
        cell({"method": "off"}, [{"decode_tokens_per_s": 20.0}, {"decode_tokens_per_s": 30.0},
                                 {"decode_tokens_per_s": 25.0}]),
        cell({"method": "exact", "gamma": 4}, [{"decode_tokens_per_s": 40.0,
                                                "accepted_per_pass": 3.25}]),
        cell({"method": "smc", "gamma": 2}, [], ["PlanError: no room"])]}
    lines = markdown_table(result).splitlines()
    assert lines[0].startswith("| method | gamma | decode tok/s | tokens / pass |")
    assert lines[2].startswith("| off |  | 25.0 (20.0-30.0) |  |")
    assert lines[3].startswith("| exact | 4 | 40.0 | 3.25 |")
    assert lines[4].startswith("| smc | 2 | failed: PlanError: no room |")


@pytest.mark.parametrize("path", sorted(ABLATIONS.glob("*.toml")), ids=lambda p: p.stem)
@pytest.mark.parametrize("quick", [False, True])
def test_every_ablation_config_declares_a_grid_of_valid_cells(path, quick):
    config = tomllib.loads(path.read_text())
    run, engine, cells = settings(config, quick)
    assert run["measure"] in MEASURES and len(cells) >= 2
    for values in cells:
        check_cell(run["measure"], {**engine, **values})  # raises on an unknown option
    assert f"xlr bench experiments/ablations/{path.name} --sweep" in path.read_text()


def test_there_is_an_ablation_config_for_every_lever():
    assert {p.stem for p in ABLATIONS.glob("*.toml")} == LEVERS


def _config(tmp_path, text: str) -> Path:
    path = tmp_path / "grid.toml"
    path.write_text(text)
    return path


def test_an_unknown_engine_option_is_refused_before_any_cell_runs(tmp_path):
    path = _config(tmp_path, '[run]\nmeasure = "decode"\n[engine]\nmodel = "smollm2"\n'
                             '[sweep]\nattention = ["xla"]\n')
    with pytest.raises(BenchError, match="unknown engine option.*attention"):
        run_bench(str(path), str(tmp_path), sweep=True)
    assert not list(tmp_path.glob("grid-*.json"))


def test_a_grid_runs_only_with_sweep_and_sweep_only_with_a_grid(tmp_path):
    grid_config = _config(tmp_path, '[run]\nmeasure = "decode"\n[engine]\nmodel = "smollm2"\n'
                                    '[sweep]\npage_size = [16]\n')
    with pytest.raises(BenchError, match=r"declares a grid \(\[sweep\]\): run it with --sweep"):
        run_bench(str(grid_config), str(tmp_path))
    with pytest.raises(BenchError, match=r"has no \[sweep\] table"):
        run_bench(str(REPO / "experiments" / "cpu_vs_transformers.toml"), str(tmp_path),
                  sweep=True)


def xlr(*args, cache_dir, timeout=900) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLR_CACHE_DIR": str(cache_dir)}
    return subprocess.run([sys.executable, "-m", "xlr_jax.cli", *args], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=timeout)


def test_a_failing_cell_is_recorded_and_the_command_says_so(tmp_path, cache_dir):
    path = _config(tmp_path, '[run]\nmeasure = "decode"\nprompt_tokens = 8\ndecode_tokens = 2\n'
                             'runs = 1\nbandwidth_gib = 0.01\nbandwidth_runs = 1\n'
                             '[engine]\nmodel = "smollm2"\n[prompt]\n'
                             'kind = "random"\n[sweep]\nkv_dtype = ["int3"]\n')
    done = xlr("bench", str(path), "--sweep", "--out", str(tmp_path), cache_dir=cache_dir)
    assert done.returncode == 1, done.stderr[-2000:]
    result = json.loads(next(tmp_path.glob("grid-*.json")).read_text())
    (cell,) = result["cells"]
    assert result["failed_cells"] == 1 and cell["summary"] == {}
    assert "PlanError: kv_dtype 'int3' is not supported" in cell["errors"][0]
    assert "Traceback" in cell["rounds"][0]["stderr_tail"]


@pytest.fixture(scope="module")
def quick_sweeps(tmp_path_factory, cache_dir):
    """Four ablation grids at their --quick sizes through `xlr bench --sweep` (the kernels'
    grid twice over: --repeats 2); their result files by config name."""
    out = tmp_path_factory.mktemp("sweeps")
    paths = {}
    for name, extra in (("kernels", ["--repeats", "2"]), ("speculation", []),
                        ("prefix_cache", []), ("online_load", [])):
        done = xlr("bench", str(ABLATIONS / f"{name}.toml"), "--sweep", "--quick", "--out",
                   str(out), *extra, cache_dir=cache_dir)
        assert done.returncode == 0, done.stderr[-3000:]
        (paths[name],) = out.glob(f"{name}-quick-*.json")
        assert f"results: {paths[name]}" in done.stdout
    return paths


def _result(quick_sweeps, name: str) -> dict:
    return json.loads(quick_sweeps[name].read_text())


def _cells(result: dict) -> dict:
    assert result["failed_cells"] == 0, [c["errors"] for c in result["cells"]]
    return {c["name"]: c for c in result["cells"]}


def test_a_sweep_records_its_environment_config_and_every_round(quick_sweeps):
    result = _result(quick_sweeps, "kernels")
    config = tomllib.loads((ABLATIONS / "kernels.toml").read_text())
    assert result["config"] == config and result["config_hash"] == config_hash(config)
    env = result["environment"]
    for key in ("jax_version", "jaxlib_version", "jax_backend", "device_kind", "cpu_model",
                "cpu_flags", "xla_flags", "cpu_kernels"):
        assert key in env
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip()
    assert result["git"]["sha"] == head and isinstance(result["git"]["dirty"], bool)
    assert result["hardware"]["peak_tflops"] > 0 and result["repeats"] == 2
    cells = _cells(result)
    assert list(cells) == ["attn_impl=xla", "attn_impl=cpu"]
    for name, cell in cells.items():
        assert len(cell["rounds"]) == 2
        rates = [r["figures"]["decode_tokens_per_s"] for r in cell["rounds"]]
        assert all(rate > 0 for rate in rates)
        s = cell["summary"]["decode_tokens_per_s"]
        assert s["min"] == min(rates) and s["max"] == max(rates) and s["min"] <= s["median"]
        # each cell's process loaded the engine its values ask for
        assert cell["rounds"][0]["detail"]["engine"]["attn_impl"] == name.split("=")[1]
        assert cell["rounds"][0]["detail"]["engine"]["weights"] == "float"
        assert len(cell["rounds"][0]["detail"]["token_ids"]) == result["settings"]["decode_tokens"]


def test_speculation_cells_report_passes_and_smc_cycles(quick_sweeps):
    cells = _cells(_result(quick_sweeps, "speculation"))
    off, exact = cells["method=off"], cells["method=exact, draft=ngram, gamma=4"]
    smc = cells["method=smc, draft=self:20, particles=2, gamma=2, min_agreement=0.0"]
    assert "accepted_per_pass" not in off["summary"]
    assert exact["summary"]["accepted_per_pass"]["median"] >= 1
    f = smc["rounds"][0]["figures"]
    assert f["smc_fallbacks"] == 0  # min_agreement 0: no probation, SMC throughout
    assert len(f["ess_before"]) == len(f["particles"]) == len(f["resampled"]) == \
        f["target_passes"] > 0
    assert f["particles"] == [2] * len(f["particles"]) and f["ess_before"][0] == 1.0
    # a cycle resamples exactly when the weights it found fell below the threshold
    assert f["resampled"] == [int(e < 0.5) for e in f["ess_before"]]
    assert f["resamples"] == sum(f["resampled"])


def test_prefix_cache_cells_are_off_on_and_a_restart(quick_sweeps):
    cells = _cells(_result(quick_sweeps, "prefix_cache"))
    hits = {name: c["rounds"][0]["figures"]["stable_hit_fraction"] for name, c in cells.items()}
    assert hits["prefix_cache=off"] == [0.0] * 3
    assert hits["prefix_cache=on"] == [0.0, 1.0, 1.0]  # turn 1 has nothing to hit yet
    assert hits["prefix_cache=warm"] == [1.0] * 3  # its first life left the tier on disk
    on = cells["prefix_cache=on"]["summary"]
    assert on["ttft_later_turns_median_s"]["median"] < on["ttft_first_turn_s"]["median"]


def test_load_cells_serve_every_request_at_each_rate(quick_sweeps):
    result = _result(quick_sweeps, "online_load")
    cells = _cells(result)
    assert list(cells) == ["rate=1.0", "rate=4.0"]
    for cell in cells.values():
        f = cell["rounds"][0]["figures"]
        assert f["finished"] == f["requests"] == result["settings"]["requests"]
        assert f["throughput_tokens_per_s"] > 0 and f["ttft_p50_s"] <= f["ttft_p99_s"]
        assert len(cell["rounds"][0]["detail"]["per_request"]) == f["requests"]


def test_report_draws_every_standard_figure_and_a_table(quick_sweeps, tmp_path):
    bench = sorted((REPO / "experiments" / "results").glob("cpu_vs_transformers-*.json"))[-1]
    paths = [str(p) for p in quick_sweeps.values()] + [str(bench)]
    done = xlr("report", *paths, "--out", str(tmp_path), cache_dir=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    for name in PLOTS:
        png = tmp_path / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
        assert str(png) in done.stdout
    report = (tmp_path / "report.md").read_text()
    for name in ("kernels", "speculation", "prefix_cache", "online_load"):
        result = _result(quick_sweeps, name)
        assert result["config_hash"] in report
        assert markdown_table(result) in report
    assert "| xlr-jax | " in report  # the plain bench result's engines
    assert all(f"![{name}]({name})" in report for name in PLOTS)


def test_report_refuses_a_file_that_is_no_result(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"experiment": "something"}))
    with pytest.raises(ReportError, match="neither an `xlr bench --sweep` result"):
        write_report([str(path)], str(tmp_path / "out"))
    done = xlr("report", str(tmp_path / "missing.json"), cache_dir=tmp_path, timeout=120)
    assert done.returncode == 2 and "cannot read" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
