"""The hardware probe, the Execution Plan, adaptive particle counts, the roofline and the
compile-once-per-bucket rule."""
import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import xlr_jax
from xlr_jax import PlanError, Workload, plan, probe
from xlr_jax.bench.engines import random_params
from xlr_jax.loading.registry import resolve_model
from xlr_jax.loading.weights import read_config
from xlr_jax.model.config import ModelConfig
from xlr_jax.model.sampling_params import SamplingParams
from xlr_jax.planning.hardware import (KNOWN_GPUS, HardwareProfile, gpu_memory, gpu_spec,
                                       jax_preallocates, peaks, preset, simd_bits)
from xlr_jax.ops import cpu_kernels
from xlr_jax.planning.buckets import chunk_room, first_chunk, pick_bucket
from xlr_jax.planning.mapper import ExecutionPlan, particle_pages, particles_for
from xlr_jax.planning.roofline import PRESETS, estimate, weight_bytes_read
from xlr_jax.runtime.engine import Engine

GB = 10 ** 9
LLAMA3_8B = ModelConfig("llama", 128256, 4096, 32, 32, 8, 128, 14336, 1e-5, 500000.0, 8192,
                        tie_embeddings=False)
RESULTS = Path(__file__).parents[1] / "experiments" / "results"


def fake(backend: str, memory_gb: float, name: str) -> HardwareProfile:
    mem = int(memory_gb * GB)
    return HardwareProfile(backend, name, 1, mem, mem, "9.0" if backend == "gpu" else None,
                           16, 1000.0, 100.0, "table")


PROFILES = {"cpu24": fake("cpu", 24, "cpu"), "gpu8": fake("gpu", 8, "NVIDIA RTX 3070"),
            "gpu24": fake("gpu", 24, "NVIDIA RTX 4090"), "gpu80": fake("gpu", 80, "NVIDIA H100"),
            "gpu141": fake("gpu", 141, "NVIDIA H200")}


@pytest.fixture(scope="module")
def smollm2():
    return read_config(resolve_model("smollm2"))


def check_within_budget(p: ExecutionPlan):
    m = p.memory
    assert m.weight_bytes + m.activation_bytes + m.reserve_bytes + m.kv_budget_bytes <= m.usable_bytes
    assert p.num_pages * m.page_bytes <= m.kv_budget_bytes + m.page_bytes  # + the scratch page
    assert p.num_pages >= 2 and p.max_context >= p.page_size
    assert p.page_buckets[-1] == -(-p.max_context // p.page_size)


# ---------------------------------------------------------------- probe

def test_probe_this_cpu():
    hw = probe()
    assert hw.backend == "cpu" and hw.device_count >= 1 and hw.cpu_cores >= 1
    assert 0 < hw.memory_free_bytes <= hw.memory_total_bytes
    assert hw.peak_source == "default" and "xlr probe --measure" in hw.notes[0]
    assert HardwareProfile.from_json(hw.to_json()) == hw


def test_probe_measures_on_the_spot():
    hw = probe(measure=True)
    assert hw.peak_source == "measured" and not hw.notes
    assert 1 < hw.peak_bandwidth_gb_s < 1000 and 0.001 < hw.peak_tflops < 100


def test_simd_width_from_cpu_flags():
    assert simd_bits("fpu sse2 avx2 avx512f avx512bw") == 512
    assert simd_bits("fpu sse2 avx avx2 fma") == 256
    assert simd_bits("fpu sse2 sse4_2 avx512_vnni") == 128  # no avx512f: not AVX-512
    assert simd_bits("") == 0


def test_gpu_peaks_from_the_table_or_a_conservative_default(caplog):
    spec, source, notes = peaks("NVIDIA H200", "gpu")
    assert (spec.bandwidth_gb_s, spec.tflops_bf16, source, notes) == (4800, 989, "table", ())
    assert peaks("NVIDIA H100 PCIe", "gpu")[0].bandwidth_gb_s == 2000  # most specific first
    spec, source, notes = peaks("NVIDIA Imaginary 9000", "gpu")
    assert source == "default" and spec.bandwidth_gb_s <= 300
    assert "not in the GPU table" in notes[0] and "not in the GPU table" in caplog.text


@pytest.mark.parametrize("name,key", [
    ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA GeForce RTX 4090", "RTX 4090"), ("NVIDIA A100-SXM4-40GB", "A100-SXM4-40GB"),
    ("NVIDIA A100-SXM4-80GB", "A100"), ("NVIDIA L40", "L40"), ("NVIDIA L40S", "L40S"),
    ("NVIDIA L4", "L4"), ("NVIDIA A10", "A10"),
    ("NVIDIA A10G", None), ("NVIDIA GH200 480GB", None)])  # not an A10, not an H200
def test_gpu_names_match_whole_words_longest_key_first(name, key):
    assert gpu_spec(name) is (KNOWN_GPUS[key] if key else None)


def test_gpu_memory_is_what_the_jax_client_can_allocate():
    """Fake readings: NVML (total, free) taken before JAX started and the device's
    memory_stats(). A preallocated pool hides the GPU from NVML afterwards, so its limit
    is the budget; on demand, NVML's free memory within the allocator's limit."""
    nvml = (141 * GB, 139 * GB)
    pool = {"bytes_limit": 105 * GB, "bytes_in_use": 2 * GB}
    total, free, source = gpu_memory(nvml, pool, preallocated=True)
    assert (total, free) == (141 * GB, 103 * GB) and "preallocated pool" in source
    assert gpu_memory(nvml, pool, preallocated=False)[1:] == (
        103 * GB, "JAX's allocator limit (below NVML's free memory)")
    on_demand = gpu_memory((141 * GB, 20 * GB), pool, preallocated=False)  # others hold 121
    assert on_demand == (141 * GB, 20 * GB, "NVML free memory before JAX started")
    assert gpu_memory(nvml, None, preallocated=False)[1] == 139 * GB  # platform: no stats
    assert gpu_memory(None, pool, preallocated=False)[:2] == (105 * GB, 103 * GB)  # no NVML
    assert jax_preallocates({})  # JAX's default
    assert not jax_preallocates({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    assert not jax_preallocates({"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"})
    assert jax_preallocates({"XLA_PYTHON_CLIENT_PREALLOCATE": "true"})


def test_the_plan_budgets_from_the_probed_free_memory_and_says_where_it_came_from(smollm2):
    total, free, source = gpu_memory((141 * GB, 30 * GB),  # NVML after a 75% pool: the rest
                                     {"bytes_limit": 105 * GB, "bytes_in_use": 0}, True)
    hw = dataclasses.replace(PROFILES["gpu141"], memory_total_bytes=total,
                             memory_free_bytes=free, memory_source=source)
    p = plan(hw, smollm2)
    assert p.memory.device_bytes == 105 * GB
    assert p.reasons["memory"] == f"budgeted from 105.00 GB free: {source}"


# ---------------------------------------------------------------- plans

@pytest.mark.parametrize("name", PROFILES)
def test_plans_fit_and_pick_backend_choices(smollm2, name):
    hw = PROFILES[name]
    for config in (smollm2, LLAMA3_8B):
        if name in ("gpu8", "cpu24") and config is LLAMA3_8B:
            with pytest.raises(PlanError, match="weights need"):  # 16 GB bf16 / 32 GB f32
                plan(hw, config)
            continue
        p = plan(hw, config)
        check_within_budget(p)
        gpu = hw.backend == "gpu"
        assert p.compute_dtype == ("bfloat16" if gpu else "float32")
        # the CPU's attention kernel where it builds (it takes both models' pages)
        assert p.attn_impl == ("pallas" if gpu else
                               "cpu" if cpu_kernels.build_error() is None else "xla")
        # a few rows' products: multiply-sums on XLA:CPU, dots on the GPU
        assert p.reduce_rows == (0 if gpu else 16) == p.buckets.reduce_rows
        # and the CPU's few-row kernel before them, where it builds (f32 weights)
        kernel = not gpu and cpu_kernels.build_error() is None
        assert p.linear_impl == ("cpu" if kernel else "xla")
        # as many rows as the kernel's vectors make it pay for: 48 with AVX-512, else 8
        lanes = cpu_kernels.vector_lanes()
        assert p.kernel_rows == p.buckets.kernel_rows == (
            (48 if lanes == 16 else 8) if kernel else 0)
        assert p.kv_dtype == p.compute_dtype
        assert set(p.reasons) >= {"compute_dtype", "page_size", "num_pages", "attn_impl",
                                  "reduce_rows", "linear_impl"}
        assert ExecutionPlan.from_json(p.to_json()) == p
        assert json.loads(p.to_json())["reasons"] == p.reasons
        older = {k: v for k, v in json.loads(p.to_json()).items()
                 if k not in ("reduce_rows", "linear_impl", "kernel_rows")}
        older = ExecutionPlan.from_json(json.dumps(older))
        assert older.reduce_rows == 0 and older.buckets.kernel_rows == 0  # every one a dot
        if not gpu:  # off by choice, and bf16 weights the kernel does not take
            assert plan(hw, config, linear_impl="xla").buckets.kernel_rows == 0
            assert plan(hw, config, dtype="bfloat16").linear_impl == "xla"
        with pytest.raises(PlanError, match="linear_impl"):
            plan(hw, config, linear_impl="gemm")


@pytest.mark.parametrize("target, rows", [("x86-64-v3", 8), ("x86-64", 8)])
def test_kernel_rows_follow_the_vectors_the_kernels_were_built_with(smollm2, target, rows):
    """Built for AVX2 or SSE2 (XLR_CPU_TARGET), the plan gives the few-row kernel 2-8 rows
    and says so, whatever this CPU has (the native width is checked above)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 targets")
    # built in the shared kernels directory, where the child finds it
    assert cpu_kernels.build_error(target, wait_s=math.inf) is None
    code = ("import json, math; from xlr_jax.ops import cpu_kernels;"
            "from xlr_jax import plan, probe; from xlr_jax.loading.registry import resolve_model;"
            "from xlr_jax.loading.weights import read_config;"
            "assert cpu_kernels.build_error(wait_s=math.inf) is None;"
            "p = plan(probe(), read_config(resolve_model('smollm2')));"
            "print(json.dumps([cpu_kernels.vector_lanes(), p.kernel_rows, p.reasons['linear_impl']]))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "XLR_CPU_TARGET": target}, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lanes, kernel_rows, why = json.loads(run.stdout.splitlines()[-1])
    assert (lanes, kernel_rows) == ({"x86-64-v3": 8, "x86-64": 4}[target], rows)
    assert f"2 to {rows} rows by the few-row kernel" in why and "9-16 rows multiply-sums" in why


def test_bigger_gpus_get_more_pages():
    pages = [plan(PROFILES[n], LLAMA3_8B).num_pages for n in ("gpu24", "gpu80", "gpu141")]
    assert pages[0] < pages[1] < pages[2]
    small = plan(PROFILES["gpu24"], LLAMA3_8B)  # 16 GB of weights on 24 GB: trimmed to fit
    assert small.max_batch < 64 or small.max_context < LLAMA3_8B.max_context


def test_model_that_cannot_fit():
    with pytest.raises(PlanError, match=r"weights need 16\.\d+ GB.*7\.\d+ GB.*another device"):
        plan(PROFILES["gpu8"], LLAMA3_8B)


def test_context_that_leaves_no_pages():
    with pytest.raises(PlanError, match=r"8192-token context needs .* GB of KV.*quantized KV"):
        plan(PROFILES["gpu24"], LLAMA3_8B, Workload(max_context=8192, max_batch=64))


def test_override_that_cannot_fit_is_refused_with_numbers(smollm2):
    with pytest.raises(PlanError, match=r"num_pages=10000000 needs [\d.]+ GB .* at most \d+ pages"):
        plan(PROFILES["cpu24"], smollm2, num_pages=10_000_000)
    with pytest.raises(PlanError, match="kv_dtype 'int4' is not supported"):
        plan(PROFILES["cpu24"], smollm2, kv_dtype="int4")


def test_overrides_are_kept_and_quantized_kv_halves_page_bytes():
    base = plan(PROFILES["gpu80"], LLAMA3_8B)
    p = plan(PROFILES["gpu80"], LLAMA3_8B, Workload(max_batch=16), page_size=32, kv_dtype="int8")
    assert (p.max_batch, p.page_size, p.kv_dtype) == (16, 32, "int8")
    assert p.reasons["page_size"] == "set by the caller"
    # int8 values plus one f32 scale per token and head, against bf16 values
    assert p.memory.page_bytes * 16 / 32 == pytest.approx(base.memory.page_bytes * (1 + 4 / 128) / 2)
    # the roofline counts the same bytes a KV token takes, scales included
    kv_token = estimate(LLAMA3_8B, PROFILES["gpu80"], prompt=64, kv_bytes=1)["kv_bytes_per_token"]
    assert kv_token * p.page_size == p.memory.page_bytes


def test_avx512_cpus_compile_with_wide_vectors(smollm2):
    wide = dataclasses.replace(PROFILES["cpu24"], cpu_vector_bits=512)
    p = plan(wide, smollm2)
    assert p.compiler_options == {"xla_cpu_prefer_vector_width": 512}
    assert "AVX-512" in p.reasons["compiler_options"]
    assert ExecutionPlan.from_json(p.to_json()) == p
    for hw in (dataclasses.replace(PROFILES["cpu24"], cpu_vector_bits=256), PROFILES["gpu141"]):
        assert plan(hw, smollm2).compiler_options == {}
    off = plan(wide, smollm2, compiler_options={})
    assert off.compiler_options == {} and off.reasons["compiler_options"] == "set by the caller"
    with pytest.raises(PlanError, match="compiler_options must map XLA option names"):
        plan(wide, smollm2, compiler_options={"xla_cpu_prefer_vector_width": [512]})


def test_compiler_options_reach_xla_and_keep_the_tokens():
    """The plan's XLA options are compiled into every step, and change no token: an
    invalid value fails the compile, and wide vectors decode what XLA's defaults do."""
    config = ModelConfig("llama", 256, 64, 2, 4, 2, 16, 128, 1e-5, 10000.0, 128,
                         tie_embeddings=True)
    params = random_params(config, jnp.float32, seed=3)

    def engine(options):
        p = plan(PROFILES["cpu24"], config,
                 Workload(max_batch=2, prefill_chunk=32, max_context=128), page_size=16,
                 num_pages=20, compiler_options=options)
        return Engine(config, params, None, p)

    bad = engine({"xla_cpu_prefer_vector_width": "wide"})
    with pytest.raises(Exception, match="xla_cpu_prefer_vector_width"):
        bad.runner.run_step(bad.runner.steps.builder(1, 0).build())
    prompts = [[5, 9, 2, 77, 31], [100, 3, 3, 8]]
    sampling = [SamplingParams(max_tokens=12, ignore_eos=True)] * 2
    runs = [[d.token_ids for _, _, d in engine(o).run(prompts, sampling) if d is not None]
            for o in ({"xla_cpu_prefer_vector_width": 512}, {})]
    assert runs[0] == runs[1] and all(len(t) == 12 for t in runs[0])


def test_load_model_uses_the_plan(tmp_path):
    model = xlr_jax.load_model("smollm2", cache_dir=tmp_path, max_context=256, max_batch=2)
    e, p = model.engine, model.plan
    assert (e.kv.page_size, e.kv.pool.num_pages, e.scheduler.max_batch) == (
        p.page_size, p.num_pages, 2)
    assert e.buckets == p.buckets and str(e.runner.kv.k.dtype) == p.kv_dtype
    assert model.info()["plan"]["num_pages"] == p.num_pages
    with pytest.raises(PlanError, match="needs"):
        xlr_jax.load_model("smollm2", cache_dir=tmp_path, num_pages=10_000_000)


# ---------------------------------------------------------------- particles

@settings(max_examples=200, deadline=None)
@given(st.integers(0, 5000), st.integers(0, 5000), st.integers(1, 8000), st.integers(1, 8),
       st.sampled_from([16, 64]), st.integers(1, 16))
def test_particles_monotone_and_never_over_commit(a, b, context, gamma, page_size, cap):
    lo, hi = sorted((a, b))
    n_lo = particles_for(lo, context, gamma, page_size=page_size, cap=cap)
    n_hi = particles_for(hi, context, gamma, page_size=page_size, cap=cap)
    assert 1 <= n_lo <= n_hi <= cap
    assert (n_hi - 1) * particle_pages(context, gamma, page_size) <= hi - math.ceil(hi / 10)


def test_particles_tight_then_plentiful():
    p = plan(PROFILES["gpu80"], LLAMA3_8B)
    assert p.particles_for(free_pages=0, context_len=1000) == 1
    assert p.particles_for(free_pages=1, context_len=1000) == 1  # the page is headroom
    assert p.particles_for(free_pages=10_000, context_len=1000) == p.speculative.particle_cap


# ---------------------------------------------------------------- roofline

def test_llama3_8b_counts_against_a_hand_computation():
    arch = PRESETS["llama-3-8b"]
    assert arch.num_params() == pytest.approx(8.03e9, rel=0.005)
    assert LLAMA3_8B.num_params() == arch.num_params()
    context = 4096
    # by hand, bf16: every weight but the input embedding once (32 layers of q, k, v, o, gate,
    # up, down and two norms; final norm; LM head), then K and V of 8 heads x 128 for 32
    # layers at each of the 4096 cached positions, and the new token's K and V written
    layer = 4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    weights = 2 * (32 * layer + 4096 + 128256 * 4096)
    kv = 2 * 32 * 2 * 8 * 128 * (context + 1)
    figures = estimate(arch, preset("h200"), prompt=context, batch=1)
    assert figures["decode_bytes_per_token"] == pytest.approx(weights + kv, rel=0.01)
    assert figures["decode_bound"] == "memory" and figures["prefill_bound"] == "compute"
    assert figures["itl_s"] == pytest.approx((weights + kv) / 4800e9, rel=0.01)


@pytest.mark.parametrize("name,total,active", [
    ("llama-3-70b", 70.6e9, None), ("qwen2.5-72b", 72.7e9, None),
    ("mixtral-8x7b", 46.7e9, 12.9e9), ("deepseek-v3-like", 671e9, 37e9),
    ("qwen3-30b-a3b", 30.5e9, 3.3e9 - 151936 * 2048),  # 3.3 B active with its embedding
    ("gemma-2-9b", 9.24e9, None), ("gemma-3-27b", 27.0e9, None)])  # Gemma-3: its text model
def test_presets_match_published_sizes(name, total, active):
    arch = PRESETS[name]
    assert arch.num_params() == pytest.approx(total, rel=0.02)
    if active:  # active per token, less the input embedding (a lookup)
        assert arch.active_matmul_params() == pytest.approx(active, rel=0.05)


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b"])
def test_moe_prefill_flops_against_a_hand_computation(name):
    """The seed's exercise with the active experts: a 4096-token prefill's FLOPs by hand,
    matmul by matmul, against the roofline's."""
    c, prompt = PRESETS[name], 4096
    d, hd, kv_heads = c.hidden_size, c.head_dim, c.num_kv_heads
    q = c.num_heads * hd
    per_token_layer = (2 * d * q            # Q
                       + 2 * 2 * d * kv_heads * hd  # K, V
                       + 2 * q * d          # O
                       + 2 * d * c.num_experts  # the router
                       + c.experts_per_token * 3 * 2 * d * c.moe_intermediate_size)  # experts
    causal = prompt * (prompt + 1) // 2     # positions the prompt's queries see in all
    attention = c.num_layers * 2 * 2 * c.num_heads * hd * causal  # scores and weighted sum
    by_hand = prompt * c.num_layers * per_token_layer + attention + 2 * d * c.vocab_size
    figures = estimate(c, preset("h200"), prompt=prompt)
    # norms (2 d a token a layer, and q/k norms) are the only weights the hand count skips
    assert figures["prefill_flops"] == pytest.approx(by_hand, rel=1e-4)


def test_windowed_layers_read_and_compute_over_their_window_only():
    """Gemma-2-9B at a 32,768-token context, by hand: its 21 global layers read every
    cached position, its 21 windowed ones the last 4,096; a prompt's query i sees i + 1
    positions on a global layer and at most 4,096 on a windowed one."""
    c, context, window = PRESETS["gemma-2-9b"], 32768, 4096
    kv_layer_token = 2 * 8 * 256 * 2  # K and V, 8 heads of 256, bf16
    weights = weight_bytes_read(c, 1, 2)
    kv = kv_layer_token * (21 * (context + 1) + 21 * window)
    figures = estimate(c, preset("h200"), prompt=context)
    assert figures["decode_bytes_per_step"] == pytest.approx(weights + kv, rel=1e-9)
    causal = context * (context + 1) / 2
    windowed = window * (window + 1) / 2 + (context - window) * window
    attention = 4 * 16 * 256 * (21 * causal + 21 * windowed)  # scores and weighted sum
    matmul = c.active_matmul_params()
    by_hand = 2 * context * (matmul - c.embed_params()) + 2 * c.embed_params() + attention
    assert figures["prefill_flops"] == pytest.approx(by_hand, rel=1e-9)
    # the same model without its windows reads the whole context on every layer
    plain = dataclasses.replace(c, sliding_window=None, window_layers=())
    assert estimate(plain, preset("h200"), prompt=context)["decode_bytes_per_step"] \
        == pytest.approx(weights + kv_layer_token * 42 * (context + 1), rel=1e-9)


def test_moe_decode_reads_only_touched_experts():
    arch, hw = PRESETS["mixtral-8x7b"], preset("h100")
    one = estimate(arch, hw, prompt=512, batch=1)["decode_bytes_per_step"]
    many = estimate(arch, hw, prompt=512, batch=64)["decode_bytes_per_step"]
    weights = weight_bytes_read(arch, 1, 2)
    assert weights < 0.4 * arch.num_params() * 2  # 2 of 8 experts
    assert many > one and weight_bytes_read(arch, 64, 2) == pytest.approx(
        (arch.num_params() - arch.embed_params()) * 2, rel=1e-3)


def _xlr(*args):
    return subprocess.run([sys.executable, "-m", "xlr_jax.cli", *args], capture_output=True,
                          text=True, timeout=600)


def test_roofline_cli_json_and_plot(tmp_path):
    out = _xlr("roofline", "llama-3-70b", "--hardware", "h200", "--prompt", "4096",
               "--batch", "1", "--json")
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout)
    arch = PRESETS["llama-3-70b"]
    assert figures["prefill_flops"] == pytest.approx(2 * 4096 * arch.active_matmul_params(),
                                                     rel=0.1)
    assert figures["ttft_s"] > figures["itl_s"] > 0
    assert figures["decode_bytes_per_step"] > 2 * arch.num_params() * 0.98
    table = _xlr("roofline", "llama-3-70b", "--hardware", "h200", "--prompt", "4096")
    assert "TTFT, ITL" in table.stdout and "compute" in table.stdout
    png = tmp_path / "roof.png"
    bench = sorted(RESULTS.glob("cpu_vs_transformers-*.json"))[-1]
    out = _xlr("roofline", "smollm2", "--hardware", "this", "--plot", str(png),
               "--measured", str(bench))
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    bad = _xlr("roofline", "llama-9", "--hardware", "h200")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "llama-3-8b" in bad.stderr


def test_plan_and_probe_cli():
    out = _xlr("plan", "--json", "--max-context", "1024", "--max-step-tokens", "40")
    assert out.returncode == 0, out.stderr
    p = ExecutionPlan.from_json(out.stdout)
    assert p.max_context == 1024 and p.compute_dtype == "float32" and p.max_step_tokens == 40
    assert "set by the caller" in _xlr("plan", "--max-context", "1024").stdout
    out = _xlr("probe", "--json")
    assert json.loads(out.stdout)["backend"] == "cpu"
    bad = _xlr("plan", "--num-pages", "100000000")
    assert bad.returncode == 2 and "at most" in bad.stderr


# ---------------------------------------------------------------- shapes before compilation

TINY = ModelConfig("llama", 256, 64, 2, 4, 2, 16, 128, 1e-5, 10000.0, 64, tie_embeddings=True)


def fifty_requests(engine: Engine, seed: int):
    rng = np.random.default_rng(seed)
    done = 0
    while done < 50:
        n = int(rng.integers(1, 4))
        prompts = [[int(t) for t in rng.integers(0, 256, int(rng.integers(1, 40)))]
                   for _ in range(n)]
        params = [SamplingParams(max_tokens=int(rng.integers(1, 64 - len(p))), ignore_eos=True,
                                 temperature=float(rng.choice([0.0, 0.8])))
                  for p in prompts]
        results = [r for _, _, r in engine.run(prompts, params) if r is not None]
        assert len(results) == n
        done += n


@pytest.mark.parametrize("warm", [False, True])
def test_compilations_never_exceed_the_buckets(warm):
    p = plan(PROFILES["cpu24"], TINY, Workload(max_batch=2, prefill_chunk=32), page_size=16)
    engine = Engine(TINY, random_params(TINY, jnp.float32, 0), None, p)
    b = p.buckets
    # decode rows alone, a chunk alone, a chunk beside the largest batch; the sampler and
    # the block-table width are no shapes
    shapes = len(b.batch) + 2 * len(b.chunk)
    assert len(engine.runner.steps.keys()) == shapes
    if warm:
        report = engine.runner.warmup(progress=False)
        assert len(report) == shapes
        assert all(r["compile_s"] > 0 for r in report)
    fifty_requests(engine, seed=int(warm))
    assert engine.runner.steps.compilations()["step"] <= shapes
    if warm:  # everything ran on the warmed executables: the jit cache stayed empty
        assert engine.runner.steps._step._cache_size() == 0


def test_plan_dataclass_is_frozen(smollm2):
    p = plan(PROFILES["cpu24"], smollm2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.num_pages = 3


def test_step_budget_sizes_the_chunk_beside_decode_rows_and_keeps_the_tokens(smollm2):
    """max_step_tokens caps the prefill chunk a step carries beside decode rows, at a chunk
    bucket (a chunk costs its bucket's step); with nothing decoding a prompt takes whole
    chunks. The budget changes when tokens come, never which."""
    p = plan(PROFILES["cpu24"], TINY, Workload(max_batch=2, prefill_chunk=32, max_step_tokens=40),
             page_size=16)
    assert p.max_step_tokens == 40 and p.reasons["max_step_tokens"] == "set by the caller"
    cpu, gpu = plan(PROFILES["cpu24"], smollm2), plan(PROFILES["gpu80"], smollm2)
    assert cpu.max_step_tokens == cpu.max_batch + 64 < cpu.max_batch + cpu.prefill_chunk
    assert gpu.max_step_tokens == gpu.max_batch + gpu.prefill_chunk
    with pytest.raises(PlanError, match="max_step_tokens"):
        plan(PROFILES["cpu24"], TINY, Workload(max_step_tokens=0))
    engine = Engine(TINY, random_params(TINY, jnp.float32, 0), None, p)
    assert p.buckets.chunk == (16, 32)

    def room(rows, budget, b=p.buckets):
        return chunk_room(b, rows, None, budget, p.step_cost_tokens)

    assert room(0, 40) == 32 and room(2, 40) == 32
    assert room(0, 33) == 32  # nothing decodes: a whole chunk
    assert room(1, 33) == 32 and room(2, 33) == 16  # 31 fit: the 16 bucket
    assert room(2, 10) == 16  # none fits: the smallest, so a prompt still moves
    # a short prompt decodes while a long one prefills beside it
    prompts = [[5, 9, 2], [int(t) for t in np.random.default_rng(1).integers(0, 256, 40)]]
    params = [SamplingParams(max_tokens=20, ignore_eos=True)] * 2
    tokens = {}
    for budget in (10, 40):
        engine.scheduler.set_budget(budget)
        tokens[budget] = [r.token_ids for _, _, r in engine.run(prompts, params) if r is not None]
    assert tokens[10] == tokens[40] and all(len(t) == 20 for t in tokens[10])


def _cheapest(left: int, sizes: tuple[int, ...], step_cost: int) -> int:
    """Brute force: the least cost of any sequence of buckets through `left` tokens."""
    best = [0] + [math.inf] * left
    for n in range(1, left + 1):
        best[n] = min(c + step_cost + best[max(0, n - c)] for c in sizes)
    return best[left]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 600), st.sampled_from([0, 4, 16, 40]))
def test_a_prompt_tail_takes_the_cheapest_buckets(left, step_cost):
    """first_chunk's pieces cover the prompt exactly, whole chunks first, at the least
    cost a brute force finds; at step cost 0 the tail is one padded bucket."""
    sizes = (16, 32, 64, 128, 256)
    pieces, n = [], left  # the buckets the steps run: a piece short of its room is padded
    while n > 0:
        pieces.append(pick_bucket(min(first_chunk(n, sizes, step_cost), n), sizes))
        n -= min(pieces[-1], n)
    whole = left // 256 if left % 256 else left // 256 - 1
    assert pieces[:whole] == [256] * whole
    tail = left - 256 * whole
    if step_cost == 0:
        assert pieces[whole:] == [pick_bucket(tail, sizes)]
    else:
        assert sum(c + step_cost for c in pieces[whole:]) == _cheapest(tail, sizes, step_cost)


def test_the_cpu_plan_splits_a_prompt_tail_and_the_gpu_plan_pads_it(smollm2):
    cpu, gpu = plan(PROFILES["cpu24"], smollm2), plan(PROFILES["gpu80"], smollm2)
    assert cpu.step_cost_tokens == 16 and gpu.step_cost_tokens == 0
    assert first_chunk(171, cpu.buckets.chunk, cpu.step_cost_tokens) == 128
    assert first_chunk(171, gpu.buckets.chunk, gpu.step_cost_tokens) == gpu.buckets.chunk[-1]
    assert ExecutionPlan.from_json(cpu.to_json()) == cpu


# ---------------------------------------------------------------- what fits (planning.fit)

def test_what_fits_against_a_hand_computation():
    """Llama-3-8B on a 24 GB GPU at 8192 tokens, by hand: 90% of the memory usable, 1 GB
    reserved, one 512-token prefill step's activations (hidden states through a layer, the
    chunk's f32 logits), the rest in 16-token pages; batch b fits while b full contexts'
    pages (and the scratch page) fit beside b sequences' activations."""
    from xlr_jax.planning.fit import fit

    gpu = fake("gpu", 24, "NVIDIA RTX 4090")
    table = fit(gpu, LLAMA3_8B, 8192)
    rows = {(r["weights"], r["kv"]): r for r in table["rows"]}
    params = 128256 * 4096 * 2 + 32 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336
                                       + 2 * 4096) + 4096
    assert params == 8_030_261_248
    for kv, per_token in (("bfloat16", 32 * 2 * 8 * 128 * 2),
                          ("int8", 32 * 2 * 8 * 128 + 32 * 2 * 8 * 4)):  # + f32 scales
        row = rows[("bfloat16", kv)]
        assert row["weight_bytes"] == 2 * params and row["kv_bytes_per_token"] == per_token

        def pages(batch):
            act = batch * 512 * (6 * 4096 + 2 * 14336) * 2 + 512 * 128256 * 4
            return (int(0.9 * 24 * GB) - 2 * params - act - GB) // (16 * per_token) - 1

        largest = max(b for b in range(1, 64) if b * 512 <= pages(b))
        assert row["fits"] and row["largest_batch"] == largest
        assert row["longest_context"] == min(pages(1) * 16, 8192)
    assert (rows[("bfloat16", "bfloat16")]["largest_batch"], rows[("bfloat16", "int8")][
        "largest_batch"]) == (3, 7)
    f32 = rows[("float32", "bfloat16")]  # 32 GB of weights in 21.6 GB usable
    assert not f32["fits"] and "weights need 32.12 GB" in f32["why"]
    # quantized at load: a 32-value group in 34 bytes (int8) or 20 (int4), scales included;
    # fp8 a byte a value (a row's one scale left out)
    for fmt, group_bytes in (("int8", 34), ("int4", 20), ("fp8", 32)):
        assert rows[(fmt, "bfloat16")]["weight_bytes"] == int(params * group_bytes / 32)
    assert rows[("int4", "bfloat16")]["largest_batch"] > rows[("bfloat16", "bfloat16")][
        "largest_batch"]
    assert table["plan"]["weights"] == "bfloat16" and table["plan"]["kv"] == "bfloat16"


def test_a_model_that_fits_nowhere_says_so_in_every_row():
    from xlr_jax.planning.fit import fit

    table = fit(fake("gpu", 8, "NVIDIA RTX 3070"), PRESETS["llama-3-70b"], 4096)
    assert not any(r["fits"] for r in table["rows"]) and "error" in table["plan"]


def test_plan_fit_cli_reads_presets_on_preset_hardware():
    out = _xlr("plan", "mixtral-8x7b", "--fit", "--hardware", "h200", "--context", "32768",
               "--json")
    assert out.returncode == 0, out.stderr
    table = json.loads(out.stdout)
    assert table["device"] == "NVIDIA H200" and len(table["rows"]) == 20  # 5 x 4 formats
    fits = {(r["weights"], r["kv"]): r["fits"] for r in table["rows"]}
    assert fits[("bfloat16", "bfloat16")] and not fits[("float32", "float32")]
    text = _xlr("plan", "qwen3-30b-a3b", "--fit", "--hardware", "h100", "--context", "4096")
    assert text.returncode == 0 and "the plan picks bfloat16 weights" in text.stdout
    assert "experts: 128 (8 active a token, 0 shared)" in text.stdout
    small = _xlr("plan", "qwen3-30b-a3b", "--fit", "--hardware", "rtx4090")  # 61 GB in bf16
    assert small.returncode == 0 and "the plan: nothing fits" in small.stdout
    plain = _xlr("plan", "llama-3-8b", "--hardware", "h100", "--json")
    assert plain.returncode == 0, plain.stderr
    assert ExecutionPlan.from_json(plain.stdout).device_name == "NVIDIA H100"
    moe = _xlr("plan", "mixtral-8x7b", "--hardware", "h200")
    assert moe.returncode == 0 and "experts: 8 (2 active a token, 0 shared)" in moe.stdout
    big = _xlr("plan", "llama-3-70b", "--hardware", "h100")  # 141 GB of bf16 weights
    assert big.returncode == 2 and "weights need 141.11 GB" in big.stderr
    bad = _xlr("plan", "--warmup", "--hardware", "h100")
    assert bad.returncode == 2 and "--hardware" in bad.stderr
