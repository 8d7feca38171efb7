"""The benchmark runner end to end, in --quick sizes: JSON written, figures sane, greedy parity."""

import argparse
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import jax
import pytest

from xlr_jax.bench import run as bench
from xlr_jax.bench.run import run_bench
from xlr_jax.model.config import ModelConfig
from xlr_jax.ops import cpu_kernels

REPO = Path(__file__).resolve().parents[1]


def test_quick_cpu_bench_writes_results(tmp_path):
    result = run_bench(str(REPO / "experiments/cpu_vs_transformers.toml"), out_dir=str(tmp_path),
                       quick=True)
    path = Path(result["json_path"])
    assert path.parent == tmp_path and path.name.startswith("cpu_vs_transformers-")
    data = json.loads(path.read_text())

    for key in ("environment", "git", "config", "settings", "bandwidth", "engines", "targets"):
        assert key in data
    for key in ("python", "jax_version", "jaxlib_version", "numpy_version", "torch_version",
                "transformers_version", "platform", "cpu_model", "cpu_count", "device_kind"):
        assert key in data["environment"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    assert data["git"]["sha"] == (head.stdout.strip() if head.returncode == 0 else None)
    assert isinstance(data["git"]["dirty"], bool)
    assert data["bandwidth"]["read_bandwidth_gb_per_s"] > 0

    decode = data["settings"]["decode_tokens"]
    xlr, hf = data["engines"]["xlr-jax"], data["engines"]["transformers"]
    for engine in (xlr, hf):
        assert engine["ttft_s"] > 0 and engine["decode_tokens_per_s"] > 0
        assert engine["completion_tokens"] == decode
        assert engine["roofline"]["bytes_per_token"] > engine["roofline"]["weight_bytes_per_token"] > 0
        assert engine["roofline"]["roofline_decode_tokens_per_s"] > 0
    vs = xlr["vs_transformers"]
    assert vs["decode_speedup_vs_transformers"] > 0 and vs["ttft_ratio_vs_transformers"] > 0
    assert vs["greedy_agreement_tokens"] == vs["decoded_tokens"] == decode
    assert {"xlr-jax.decode_speedup_vs_transformers", "xlr-jax.roofline_fraction",
            "xlr-jax.ttft_ratio_vs_transformers"} <= data["targets"].keys()
    assert all(isinstance(t["pass"], bool) for t in data["targets"].values())
    # every run prefills its whole prompt (no prefix cache), as transformers does
    assert xlr["prefix_cache"] is False
    # the ablation runs with XLA's defaults and is measured, not held to the targets
    ablation = data["engines"]["xlr-jax-xla-defaults"]
    assert ablation["compiler_options"] == {} and ablation["completion_tokens"] == decode
    assert not any(name.startswith("xlr-jax-xla-defaults.") for name in data["targets"])
    # the second ablation: decode attention by the XLA walk instead of the CPU kernel
    walk = data["engines"]["xlr-jax-xla-attention"]
    assert walk["attn_impl"] == "xla" and walk["completion_tokens"] == decode
    assert xlr["attn_impl"] == ("cpu" if cpu_kernels.build_error() is None else "xla")
    assert walk["token_ids"] == xlr["token_ids"]  # the same greedy tokens either way
    assert not any(name.startswith("xlr-jax-xla-attention.") for name in data["targets"])


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the message shown without a GPU")
def test_gpu_config_exits_2_without_a_gpu(capsys):
    parser = argparse.ArgumentParser()
    bench.add_cli(parser.add_subparsers())
    args = parser.parse_args(["bench", str(REPO / "experiments/gpu_decode.toml")])
    assert args.func(args) == 2
    err = capsys.readouterr().err.strip()
    assert "needs a GPU" in err and "\n" not in err


def test_gpu_config_describes_llama3_8b():
    config = tomllib.loads((REPO / "experiments/gpu_decode.toml").read_text())
    assert config["requirements"]["gpu"] is True
    shape = next(e["shape"] for e in config["engines"] if e["kind"] == "xlr-random")
    assert round(ModelConfig(**shape).num_params() / 1e9, 2) == 8.03


TINY_RANDOM = """
[requirements]
gpu = false
[run]
prompt_tokens = 40
decode_tokens = 8
repeats = 2
bandwidth = "copy"
bandwidth_gib = 0.0625
bandwidth_runs = 2
[prompt]
kind = "random"
seed = 1
[[engines]]
kind = "xlr-random"
label = "tiny"
dtype = "float32"
[engines.shape]
architecture = "llama"
vocab_size = 512
hidden_size = 64
num_layers = 2
num_heads = 4
num_kv_heads = 2
head_dim = 16
intermediate_size = 128
rms_norm_eps = 1e-5
rope_theta = 10000.0
max_context = 256
tie_embeddings = false
[targets]
roofline_fraction_min = 0.8
"""


def test_random_weight_engine_path(tmp_path):
    """The GPU config's path (random weights, random prompt, copy bandwidth), tiny, on any backend."""
    config = tmp_path / "tiny.toml"
    config.write_text(TINY_RANDOM)
    result = run_bench(str(config), out_dir=str(tmp_path / "out"))
    tiny = result["engines"]["tiny"]
    assert tiny["completion_tokens"] == 8 and tiny["tokens_identical_across_runs"]
    assert result["bandwidth"]["copy_bandwidth_gb_per_s"] > 0
    # untied: the embedding is only gathered, so it is left out of the bytes read per token
    assert tiny["roofline"]["weight_bytes_per_token"] == tiny["param_bytes"] - 512 * 64 * 4
    assert list(result["targets"]) == ["tiny.roofline_fraction"]


def test_prompt_length_sweep(tmp_path):
    """`prompt_tokens` as a list (experiments/prefill_sweep.toml's form): each engine
    measured at every length, figures and targets per length, on the tiny random model."""
    config = tmp_path / "sweep.toml"
    config.write_text(TINY_RANDOM.replace("prompt_tokens = 40", "prompt_tokens = [24, 72]")
                      .replace("decode_tokens = 8", "decode_tokens = 3"))
    result = run_bench(str(config), out_dir=str(tmp_path / "out"))
    data = json.loads(Path(result["json_path"]).read_text())
    assert [p["prompt_tokens"] for p in data["sweep"]] == [24, 72]
    for point in data["sweep"]:
        tiny = point["engines"]["tiny"]
        assert tiny["completion_tokens"] == 3 and tiny["ttft_s"] > 0
        assert tiny["roofline"]["mean_decode_context_tokens"] == point["prompt_tokens"] + 1.5
    assert list(data["targets"]) == ["tiny.roofline_fraction@24", "tiny.roofline_fraction@72"]
    assert data["all_targets_pass"] == all(t["pass"] for t in data["targets"].values())


BATCHING = """
[run]
prompt_tokens = 40
decode_tokens = 6
streams = [3, 1]
repeats = 2
warmup = 2
bandwidth = "copy"
bandwidth_gib = 0.0625
bandwidth_runs = 2
[prompt]
kind = "random"
[[engines]]
kind = "xlr"
label = "tiny"
model = "{model}"
prefix_cache = true
[targets]
batching_speedup_min = 1.0
"""


def test_streams_measure_batched_decode(tmp_path, tiny_models):
    """`streams` (experiments/batching.toml's form): each count of concurrent streams timed
    in interleaved rounds on the tiny model, and the speedup of the most over one."""
    config = tmp_path / "batching.toml"
    config.write_text(BATCHING.format(model=tiny_models.target))
    result = run_bench(str(config), out_dir=str(tmp_path / "out"))
    tiny = json.loads(Path(result["json_path"]).read_text())["engines"]["tiny"]
    assert tiny["prefix_cache"] is True and set(tiny["streams"]) == {"1", "3"}
    for count, figures in tiny["streams"].items():
        assert len(figures["decode_tokens_per_s_runs"]) == 2
        assert figures["tokens_identical_across_runs"]
        # each stream's own span is within the whole span: the sum of speeds bounds it
        assert 0 < figures["span_tokens_per_s"] <= figures["decode_tokens_per_s"] * (1 + 1e-9)
    streams = tiny["streams"]
    assert tiny["batching_speedup"] == pytest.approx(
        streams["3"]["decode_tokens_per_s"] / streams["1"]["decode_tokens_per_s"])
    assert list(result["targets"]) == ["tiny.batching_speedup"]
    assert result["targets"]["tiny.batching_speedup"]["value"] == tiny["batching_speedup"]


@pytest.mark.parametrize("change, message", [
    (("streams = [3, 1]", "streams = [2, 4]"), "including 1"),
    (('kind = "xlr"', 'kind = "transformers"'), "xlr engines only")])
def test_streams_config_errors_name_the_fix(tmp_path, change, message):
    config = tmp_path / "bad.toml"
    config.write_text(BATCHING.format(model="smollm2").replace(*change))
    with pytest.raises(bench.BenchError, match=message):
        run_bench(str(config), out_dir=str(tmp_path / "out"))


def test_engine_no_slower_compares_two_commits_side_by_side(tmp_path):
    """experiments/engine_no_slower.py --quick: the base commit (a worktree it adds and
    removes) and this checkout each run the engine-only bench once, on the same tokens."""
    out = subprocess.run([sys.executable, str(REPO / "experiments/engine_no_slower.py"),
                          "--quick", "--prompt-tokens", "96", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=900, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    (path,) = tmp_path.glob("engine_no_slower-quick-p96-*.json")
    r = json.loads(path.read_text())
    base, new = r["runs"]["base"][0], r["runs"]["new"][0]
    assert base["git"]["sha"].startswith(r["base"]) and base["git"]["sha"] != new["git"]["sha"]
    assert r["summary"]["same_tokens"] and len(new["token_ids"]) > 1
    assert r["summary"]["decode_ratio_new_over_base"] == (
        new["decode_tokens_per_s"] / base["decode_tokens_per_s"])
    worktrees = subprocess.run(["git", "worktree", "list"], capture_output=True, text=True,
                               cwd=REPO).stdout
    assert "xlr-no-slower-" not in worktrees  # the base worktree is gone again


@pytest.mark.parametrize("shape, header", [
    (["--chunk", "16"], "# a 16-token chunk from position 16"),
    (["--rows", "3", "--chunk", "0"], "# 3 decode rows at position 16")])
def test_step_profile_summarizes_a_trace(tmp_path, tiny_models, shape, header):
    """experiments/profile_step.py on the tiny model: a traced chunk step or decode step,
    summed by op kind (the matrix products among them), written where --out says."""
    out = tmp_path / "profile.txt"
    run = subprocess.run([sys.executable, str(REPO / "experiments/profile_step.py"),
                          "--model", str(tiny_models.target), *shape, "--start", "16",
                          "--runs", "1", "--out", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = out.read_text().splitlines()
    assert lines[0].startswith(header)
    rows = [line.split() for line in lines[3:]]
    assert rows and all(float(ms) >= 0 and int(n) > 0 for ms, _, n, _ in rows)
    assert any(kind.startswith(("ynn_fusion", "dot")) for *_, kind in rows), out.read_text()


def test_step_profile_takes_a_weight_format(tmp_path, tiny_models):
    """--weights int8: the plan's format is in the header and the products are the
    quantized kernel's calls (XLA's dot would run on float weights)."""
    out = tmp_path / "profile.txt"
    run = subprocess.run([sys.executable, str(REPO / "experiments/profile_step.py"),
                          "--model", str(tiny_models.target), "--rows", "1", "--chunk", "0",
                          "--start", "16", "--runs", "1", "--weights", "int8",
                          "--out", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = out.read_text().splitlines()
    assert "weights int8" in lines[0], lines[0]
    assert any(line.split()[-1] == "ffi_call" for line in lines[3:]), out.read_text()
