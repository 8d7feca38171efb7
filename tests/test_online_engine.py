"""The online, verify-rows, serve-load, serve-bench, constrained-decode and load-budget
experiments run end to end (--quick) and report sane figures."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_quick(script: str, tmp_path, cache_dir) -> dict:
    """experiments/SCRIPT --quick into tmp_path; its one JSON result."""
    out = subprocess.run([sys.executable, str(ROOT / "experiments" / script), "--quick",
                          "--out", str(tmp_path), "--cache-dir", str(cache_dir)],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    (path,) = tmp_path.glob(f"{script.removesuffix('.py')}-*.json")
    return json.loads(path.read_text())


def test_online_engine_experiment_quick(tmp_path, cache_dir):
    out = subprocess.run([sys.executable, str(ROOT / "experiments" / "online_engine.py"),
                          "--quick", "--out", str(tmp_path), "--cache-dir", str(cache_dir)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    (path,) = tmp_path.glob("online_engine-*.json")
    assert path.with_suffix(".png").stat().st_size > 0
    r = json.loads(path.read_text())
    assert r["experiment"] == "online_engine" and r["quick"]
    assert r["environment"]["cpu_count"] and "sha" in r["git"]
    workload = r["workload"]
    assert len(workload) == r["config"]["requests_per_rate"]
    assert [run["rate_per_s"] for run in r["rates"]] == r["config"]["rates_per_s"]
    for run in r["rates"]:
        for path_name in ("engine", "threads"):
            f = run[path_name]
            assert not f["timed_out"] and f["finished"] == f["requests"] == len(workload)
            # EOS ignored: every request decodes exactly its max_tokens
            assert [q["completion_tokens"] for q in f["per_request"]] == \
                [w["max_tokens"] for w in workload]
            assert f["completion_tokens"] == sum(w["max_tokens"] for w in workload)
            assert f["throughput_tokens_per_s"] > 0
            for name in ("ttft", "itl", "latency"):
                assert 0 < f[f"{name}_p50_s"] <= f[f"{name}_p99_s"]
            assert all(0 < q["ttft_s"] <= q["latency_s"] for q in f["per_request"])
        assert 0 < run["engine"]["itl_gap_p50_s"] <= run["engine"]["itl_gap_p99_s"]
        assert run["engine_over_threads"]["throughput_tokens_per_s"] > 0


def test_verify_rows_experiment_quick(tmp_path, cache_dir):
    """experiments/verify_rows.py --quick times both ways of verifying n-gram drafts for
    every mix it reports."""
    r = run_quick("verify_rows.py", tmp_path, cache_dir)
    assert r["experiment"] == "verify_rows" and r["quick"] and "sha" in r["git"]
    mixes = {(f["plain_streams"], f["gamma"]) for f in r["figures"]}
    assert (0, 4) in mixes and any(plain for plain, _ in mixes)
    for f in r["figures"]:
        assert f["rows"] == min(8, f["plain_streams"] + f["gamma"] + 1)
        assert f["rows_ms"] > 0 and f["separate_ms"] > 0
        assert abs(f["rows_over_separate"] - f["rows_ms"] / f["separate_ms"]) < 1e-9


def test_serve_load_experiment_quick(tmp_path, cache_dir):
    """experiments/serve_load.py --quick: a warm `xlr serve` answers every streaming client
    and reports its event loop's stall."""
    r = run_quick("serve_load.py", tmp_path, cache_dir)
    assert r["experiment"] == "serve_load" and r["quick"] and "sha" in r["git"]
    assert [f["clients"] for f in r["levels"]] == r["config"]["clients"]
    for f in r["levels"]:
        assert f["requests"] == f["clients"] * r["config"]["requests_per_client"]
        assert f["throughput_tokens_per_s"] > 0 and 0 < f["ttft_p50_s"] <= f["ttft_p99_s"]
        assert 0 <= r["startup_event_loop_max_stall_s"] <= f["event_loop_max_stall_s"]


def test_serve_bench_experiment_quick(tmp_path, cache_dir):
    """experiments/serve_bench.py --quick (llama.cpp skipped): an agent through xlr serve
    with and without the prefix cache (the same greedy replies; cached tokens only with
    it), agents at once, the in-process overhead rounds and a rate level, with targets,
    JSON and PNG."""
    r = run_quick("serve_bench.py", tmp_path, cache_dir)
    assert r["experiment"] == "serve_bench" and r["quick"] and "sha" in r["git"]
    assert r["llama_cpp"].startswith("skipped") and set(r["agents"]) == {"xlr-jax"}
    c = r["config"]
    on, off = r["agent"]["xlr-jax"]["turns"], r["agent"]["xlr-jax --no-prefix-cache"]["turns"]
    assert len(on) == len(off) == c["turns"]
    assert [t["text"] for t in on] == [t["text"] for t in off]
    assert on[1]["cached_tokens"] > 0 and not any(t["cached_tokens"] for t in off)
    assert all(t["prompt_tokens"] > 1000 and t["ttft_s"] > 0 for t in on + off)
    agents = r["agents"]["xlr-jax"]["conversations"]
    assert len(agents) == c["agents"] and all(len(a["turns"]) == c["turns"] for a in agents)
    o = r["overhead"]
    assert len(o["in_process_s"]) == len(o["http_s"]) == o["rounds"] == c["rounds"]
    assert o["in_process_p50_s"] > 0 and o["http_p50_s"] > 0
    (level,) = r["rates"]["xlr-jax"]
    assert level["requests"] == c["requests_per_rate"] and level["completion_tokens"] > 0
    assert 0 < level["ttft_p50_s"] <= level["ttft_p99_s"]
    assert set(r["targets"]) == {"turn_2_plus_ttft_off_over_on", "server_overhead_ms"}
    assert all(isinstance(t["pass"], bool) for t in r["targets"].values())
    (png,) = tmp_path.glob("serve_bench-*.png")
    assert png.stat().st_size > 0


def test_constrained_decode_experiment_quick(tmp_path, cache_dir):
    """experiments/constrained_decode.py --quick: plain streams alone and beside a request
    held to a JSON schema, with the mask's cost per token."""
    r = run_quick("constrained_decode.py", tmp_path, cache_dir)
    assert r["experiment"] == "constrained_decode" and r["quick"] and "sha" in r["git"]
    f = r["figures"]
    assert f["plain_itl_alone_s"] > 0 and f["plain_itl_beside_masked_s"] > 0
    assert 0 < f["mask_s_per_token"] < f["masked_itl_s"]
    assert f["masked_step_over_plain"] == f["masked_itl_s"] / f["plain_itl_alone_s"]
    assert all(rnd["beside_masked"]["masked_tokens"] > 0 for rnd in r["rounds"])


def test_load_budget_experiment_quick(tmp_path, cache_dir):
    """experiments/load_budget.py --quick: at each step budget, the running streams' gaps
    while newcomers prefill and the newcomers' TTFT, against one stream decoding alone."""
    r = run_quick("load_budget.py", tmp_path, cache_dir)
    assert r["experiment"] == "load_budget" and r["quick"] and "sha" in r["git"]
    assert list(r["budgets"]) == [str(b) for b in r["settings"]["budgets"]]
    assert r["unloaded_itl_s"] > 0 and r["default_budget"] == r["plan"]["max_step_tokens"]
    for f in r["budgets"].values():
        assert f["gaps"] > 0 and 0 < f["itl_p50_s"] <= f["itl_p99_s"]
        assert 0 < f["ttft_p50_s"] <= f["ttft_p99_s"] and f["tokens_per_s"] > 0
        assert f["itl_p99_over_unloaded"] == pytest.approx(f["itl_p99_s"] / r["unloaded_itl_s"])
        assert f["streams_decoding_at_end"] == r["settings"]["streams"]  # load held throughout
    assert next(tmp_path.glob("load_budget-*.png")).stat().st_size > 10_000


def test_mixed_sampling_experiment_quick(tmp_path, cache_dir):
    """experiments/mixed_sampling.py --quick: a step and the engine's greedy streams with
    each mix of sampled, filtered, log-probability and speculating rows beside them,
    against all greedy."""
    r = run_quick("mixed_sampling.py", tmp_path, cache_dir)
    assert r["experiment"] == "mixed_sampling" and r["quick"] and "sha" in r["git"]
    mixes = list(r["mixes"])
    assert list(r["engine"]) == mixes and list(r["step"]) == [
        m for m in mixes if r["mixes"][m] is not None]  # speculation runs in the engine only
    assert "together" in r["step"] and "together" in r["engine"]  # every kind in one step
    assert r["step"]["greedy"]["over_greedy"] == 1 == r["engine"]["greedy"]["itl_p50_over_greedy"]
    for f in r["step"].values():
        assert f["step_s"] > 0
    for f in r["engine"].values():
        assert 0 < f["itl_p50_s"] <= f["itl_p99_s"] and all(run["gaps"] > 0 for run in f["runs"])
    worst = r["targets"]["worst_over_greedy"]
    assert worst["value"] >= 1 and worst["pass"] == (worst["value"] <= worst["max"])


def test_decode_attention_floor_experiment_quick(tmp_path, cache_dir):
    """experiments/decode_attention_floor.py --quick: one row's attention over every layer,
    the read floor of its bytes, the step and its roofline shares, and the overlap check."""
    r = run_quick("decode_attention_floor.py", tmp_path, cache_dir)
    assert r["experiment"] == "decode_attention_floor" and r["quick"] and "sha" in r["git"]
    gb_s = r["bandwidth"]["read_bandwidth_gb_per_s"]
    assert list(r["positions"]) == [str(p) for p in r["settings"]["positions"]]
    for position, f in r["positions"].items():
        assert f["kv_bytes"] == r["kv_bytes_per_position"] * (int(position) + 1)
        assert f["at_bandwidth_s"] == pytest.approx(f["kv_bytes"] / (gb_s * 1e9))
        assert min(f["read_floor_s"], f["attention_s"], f["step_s"]) > 0  # timings: not compared
        # the CPU kernel is timed wherever it builds, and then the plan's step uses it
        assert ("kernel_s" in f) == (r["attn_impl"] == "cpu")
        in_step = f["kernel_s"] if r["attn_impl"] == "cpu" else f["attention_s"]
        roof = (r["weight_bytes_per_token"] + f["kv_bytes"]) / (gb_s * 1e9)
        assert f["roofline_share"] == pytest.approx(roof / f["step_s"])
        assert f["roofline_share_attention_at_bandwidth"] == pytest.approx(
            roof / (f["step_s"] - in_step + f["at_bandwidth_s"]))
    o = r["overlap"]
    assert min(o["product_s"], o["gather_s"], o["both_s"]) > 0
    assert o["overlap_share"] == pytest.approx(
        (o["product_s"] + o["gather_s"] - o["both_s"]) / min(o["product_s"], o["gather_s"]))


def test_few_row_products_experiment_quick(tmp_path, cache_dir, cpu_kernels_on):
    """experiments/few_row_products.py --quick: the weight products of every layer and the
    LM head by XLA's dot, the multiply-sum and the few-row kernel per row count, and the
    step with the plan's products beside one with XLA's."""
    r = run_quick("few_row_products.py", tmp_path, cache_dir)
    assert r["experiment"] == "few_row_products" and r["quick"] and "sha" in r["git"]
    assert list(r["products"]) == [str(n) for n in r["settings"]["rows"]]
    one_row = r["products"]["1"]["dot"]["s"]
    for rows, by_path in r["products"].items():
        # one row: the dot alone; the multiply-sum to 24 rows; the kernel from 2 rows
        expected = {"dot"} | ({"multiply_sum", "kernel"} if int(rows) >= 2 else set())
        assert set(by_path) == expected
        for f in by_path.values():
            assert f["s"] > 0 and f["over_one_row_dot"] == pytest.approx(f["s"] / one_row)
            assert f["weights_gb_per_s"] == pytest.approx(r["weight_bytes"] / f["s"] / 1e9)
    assert [[f["decode_rows"], f["chunk"]] for f in r["steps"].values()] == r["settings"]["steps"]
    for f in r["steps"].values():
        assert f["kernel_over_xla"] == pytest.approx(f["kernel_s"] / f["xla_s"])


def test_chunk_attention_experiment_quick(tmp_path, cache_dir, cpu_kernels_on):
    """experiments/chunk_attention.py --quick: the step with the CPU attention kernel beside
    the same step with the XLA walk."""
    r = run_quick("chunk_attention.py", tmp_path, cache_dir)
    assert r["experiment"] == "chunk_attention" and r["quick"] and "sha" in r["git"]
    assert len(r["steps"]) == len(r["settings"]["steps"]) * len(r["settings"]["positions"])
    for f in r["steps"].values():
        assert f["kernel_over_walk"] == pytest.approx(f["kernel_s"] / f["walk_s"])


def test_same_outputs_experiment_quick(tmp_path, cache_dir):
    """experiments/same_outputs.py --quick against HEAD: both sides ran every request in
    fresh processes, and this checkout gives what the commit gives."""
    out = subprocess.run([sys.executable, str(ROOT / "experiments" / "same_outputs.py"),
                          "--base", "HEAD", "--quick", "--out", str(tmp_path),
                          "--cache-dir", str(cache_dir)],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    (path,) = tmp_path.glob("same_outputs-quick-*.json")
    r = json.loads(path.read_text())
    assert r["requests"] == 6 and r["differ"] == [] and r["same"]
    assert all(len(v[0]) == 8 for key, v in r["outputs"].items() if key[0].isdigit())
