"""experiments/gpu_suite.py, the one-call GPU suite, in its --smoke mode on the CPU: every
part runs on tiny shapes (the Pallas kernel in interpret mode, random-weight models written
here) and passes its checks, and a part that fails leaves the others' results standing."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def gpu_suite():
    spec = importlib.util.spec_from_file_location("gpu_suite",
                                                  REPO / "experiments" / "gpu_suite.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu_suite")
    done = subprocess.run([sys.executable, "experiments/gpu_suite.py", "--smoke", "--out",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = out.glob("gpu_suite-quick-*.json")
    return json.loads(path.read_text())


def test_every_part_runs_and_passes_its_checks(smoke):
    parts = smoke["parts"]
    assert list(parts) == list(gpu_suite().PARTS)
    failed = {name: p.get("error") or [k for k, v in p["checks"].items() if not v]
              for name, p in parts.items() if not p["ok"]}
    assert not failed and smoke["passed"] and smoke["failed_parts"] == []
    for name, p in parts.items():
        assert p["checks"] and all(p["checks"].values()), name
    assert smoke["git"]["sha"] and smoke["environment"]["jax_version"]
    assert smoke["hardware"]["peak_tflops"] > 0


def test_the_kernel_part_checks_every_case_and_times_jax_beside_ours(smoke):
    kernels = smoke["parts"]["kernels"]
    cases = {name.removeprefix("kernel_matches_reference_") for name in kernels["checks"]}
    assert cases >= {"decode", "verify", "ragged", "prefill_chunk", "decode_int8", "decode_fp8"}
    names = {e["name"] for e in kernels["figures"]["timings"]["decode"] if "median_s" in e}
    assert {"xlr_pallas", "jax_pallas_paged_attention", "xla_reference"} <= names
    assert set(kernels["targets"]) == {"decode_fraction_of_copy", "decode_time_over_jax",
                                       "verify_over_decode"}
    assert kernels["figures"]["copy_bandwidth_gb_per_s"] > 0
    assert kernels["targets"]["verify_over_decode"]["value"] > 0


def test_the_parts_report_their_figures(smoke):
    parts = smoke["parts"]
    decode = parts["decode_8b"]["figures"]
    assert decode["decode_tokens_per_s"] > 0 and 0 < decode["roofline_fraction"]
    assert "roofline_fraction" in parts["decode_8b"]["targets"]
    batches = parts["engine_batches"]["figures"]
    assert batches["decode_tokens_per_s_1"] > 0 and batches["batching_speedup"] > 0
    spec = parts["speculation"]["figures"]
    assert {"off", "exact ngram", "exact self:1", "smc"} == set(spec)
    assert spec["exact ngram"]["accepted_per_pass"] >= 1
    agent = parts["prefix_cache"]["figures"]
    assert all(f > 0 for f in agent["on"]["cached_fraction"][1:])
    assert agent["off"]["cached_fraction"] == [0.0] * len(agent["off"]["cached_fraction"])
    assert agent["on"]["ttft_later_turns_median_s"] < agent["off"]["ttft_later_turns_median_s"]
    quantized = parts["quantized"]["figures"]
    assert quantized["int8"]["bytes_per_token"] < quantized["float"]["bytes_per_token"]


def test_a_failing_part_is_reported_and_the_rest_go_on(tmp_path, monkeypatch):
    suite = gpu_suite()

    def broken(*args):
        raise RuntimeError("this part broke")

    monkeypatch.setitem(suite.RUNNERS, "decode_8b", broken)
    parts = suite.run_suite(suite.SMOKE, ["decode_8b", "quantized"], tmp_path)
    assert parts["decode_8b"] == {"ok": False, "error": "RuntimeError: this part broke",
                                  "wall_s": parts["decode_8b"]["wall_s"]}
    assert parts["quantized"]["ok"] and all(parts["quantized"]["checks"].values())


def test_without_a_gpu_the_full_suite_refuses_to_run(tmp_path):
    done = subprocess.run([sys.executable, "experiments/gpu_suite.py", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "needs a GPU (use --smoke" in done.stderr
