"""experiments/startup.py runs end to end (--quick, on the tiny GGUF) and measures what it says."""
import json
import subprocess
import sys
from pathlib import Path

from tiny_gguf import write_tiny_gguf

ROOT = Path(__file__).resolve().parent.parent


def test_startup_experiment_quick(tmp_path):
    model = write_tiny_gguf(tmp_path / "tiny.gguf", context=4096)
    out = subprocess.run([sys.executable, str(ROOT / "experiments" / "startup.py"), "--quick",
                          "--model", str(model), "--out", str(tmp_path / "results")],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    (path,) = (tmp_path / "results").glob("startup-quick-*.json")
    r = json.loads(path.read_text())
    assert r["environment"]["cpu_count"] and r["environment"]["cpu_flags"] and "sha" in r["git"]
    cold, warm = r["generate"]["cold"][0], r["generate"]["warm"][0]
    assert not cold["load"]["params_from_cache"] and cold["load"]["steps_preloaded"] == 0
    # a fresh install: the first process built the CPU kernels beside its load and ran them
    assert cold["load"]["cpu_kernels_off"] is None and warm["load"]["cpu_kernels_off"] is None
    assert r["environment"]["cpu_kernels"].startswith("on")
    # the same command again: nothing parsed or converted, its compiled steps preloaded
    assert warm["load"]["metadata_from_cache"] and warm["load"]["params_from_cache"]
    assert warm["load"]["steps_preloaded"] >= 2
    assert 0 < warm["overhead_s"] < warm["wall_s"]
    assert r["generate"]["in_process"]["decode_tokens_per_s"] > 0
    agent = r["agent"]["warm"][0]
    assert agent["cached_tokens"] > agent["prompt_tokens"] // 2  # the stable tier, from disk
    assert len(r["chat"]["warm"][0]["ttft_s"]) == len(r["chat_turns"])
    assert r["targets"]["outputs_identical"]["pass"]
    assert 0 < r["serve"]["warm_ready_s"][0] < 600
    assert set(r["targets"]) >= {"warm_generate_overhead_s", "warm_generate_ttft_s",
                                 "cold_generate_wall_s", "agent_warm_first_turn_ttft_s",
                                 "chat_warm_later_turns_ttft_s", "first_answer_wall_s",
                                 "later_generate_overhead_s", "serve_ready_warm_s"}
