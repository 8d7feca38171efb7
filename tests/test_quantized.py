"""Weights kept quantized (`model.quantized`): llama.cpp's Q4_0/Q4_1/Q8_0 blocks read as
its own dequantizer reads them, float weights quantized at load within their groups'
error, the products against a float64 reference of the dequantized weights, and models
loaded with quantized weights (`weights=`)."""
import json
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xlr_jax
from xlr_jax.errors import PlanError
from xlr_jax.loading.gguf_file import GGUFFile
from xlr_jax.model.decoder import linear
from xlr_jax.model.quantized import GROUP, QuantizedTensor, from_gguf_blocks, quantize


def tensor(fields: dict) -> QuantizedTensor:
    return QuantizedTensor(**{k: jnp.asarray(v) for k, v in fields.items()})


def random_weight(seed, rows, cols) -> np.ndarray:
    rng = np.random.default_rng(seed)  # groups of different ranges and offsets
    return (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 2, (rows, 1))
            + rng.uniform(-1, 1, (rows, 1))).astype(np.float32)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows, cols", [(1, 32), (7, 96), (33, 256)])
def test_gguf_blocks_read_as_llama_cpp_dequantizes_them(kind, rows, cols):
    """Blocks the gguf package's quantizer writes, kept as they are: dequantized (whole or
    by gathered rows) they are exactly what its dequantizer gives."""
    t = gguf.GGMLQuantizationType[kind]
    blocks = gguf.quants.quantize(random_weight(rows + cols, rows, cols), t)
    expected = gguf.quants.dequantize(blocks, t).reshape(rows, cols)
    w = tensor(from_gguf_blocks(kind, blocks, (rows, cols)))
    assert w.shape == (rows, cols) and w.bits == (8 if kind == "Q8_0" else 4)
    np.testing.assert_array_equal(np.asarray(w.dequantize()), expected)
    ids = np.array([[rows - 1, 0], [rows // 2, rows - 1]])
    np.testing.assert_array_equal(np.asarray(w.rows(ids)), expected[ids])


def test_blocks_that_do_not_divide_a_row_are_refused(tmp_path):
    blocks = gguf.quants.quantize(random_weight(0, 4, 64), gguf.GGMLQuantizationType.Q4_1)
    with pytest.raises(ValueError, match="does not split into its 32-value blocks"):
        from_gguf_blocks("Q4_1", blocks, (4, 96))
    # a file whose header gives a row length no block divides (48 values of Q4_1) is
    # refused before any read
    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("w", blocks, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = bytearray(path.read_bytes())
    at = data.index(struct.pack("<QQ", 64, 4))  # the tensor's dims, innermost first
    data[at:at + 8] = struct.pack("<Q", 48)
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="not a whole number of Q4_1's 32-value blocks"):
        GGUFFile(path)


@pytest.mark.parametrize("fmt, steps", [("int8", 254), ("int4", 15)])
def test_quantizing_at_load_stays_within_a_step_of_each_group(fmt, steps):
    """Each value within half a quantization step of its group's (plus the float16
    scale's rounding), and the format llama.cpp's own blocks have."""
    w = random_weight(3, 9, 160)
    q = tensor(quantize(w, fmt))
    groups = w.reshape(9, -1, GROUP)
    span = groups.max(-1) - groups.min(-1) if fmt == "int4" else 2 * np.abs(groups).max(-1)
    err = np.abs(np.asarray(q.dequantize()) - w).reshape(9, -1, GROUP).max(-1)
    assert (err <= span / steps * 0.5 + np.abs(groups).max(-1) * 2e-3).all()
    assert q.values.dtype == (jnp.int8 if fmt == "int8" else jnp.uint8)
    assert q.nbytes == pytest.approx(w.size * {"int8": 34, "int4": 20}[fmt] / 32)
    with pytest.raises(ValueError, match="groups of 32"):
        quantize(w[:, :40], fmt)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 3, 8, 17, 64])
def test_a_quantized_product_is_the_dequantized_weights_product(fmt, rows):
    """x @ W.T for W kept quantized, against float64 with W dequantized, at every row
    count a step uses."""
    w = tensor(quantize(random_weight(rows, 48, 192), fmt))
    x = np.random.default_rng(rows).standard_normal((rows, 192)).astype(np.float32)
    ref = x.astype(np.float64) @ np.asarray(w.dequantize(), np.float64).T
    out = np.asarray(linear(jnp.asarray(x), w))
    assert out.shape == (rows, 48)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_the_quantized_kernel_matches_float64(fmt, kernel_target):
    """quantized_linear.cc on every tested target (AVX-512, AVX2, the portable build):
    each row count a step uses, one row included, in passes of up to 8 rows (4 with 16
    registers), output rows that end a task mid-way, inputs of one to 48 groups; against
    float64 with the weights dequantized, to f32 rounding."""
    from xlr_jax.ops import cpu_linear

    rng = np.random.default_rng(7)
    product = jax.jit(lambda x, w: cpu_linear.quantized_linear(
        x, w.values, w.scales, w.minimums, target=kernel_target))
    for rows in (1, 2, 5, 8, 9, 17, cpu_linear.MAX_ROWS):
        for out_rows, d in ((1, 32), (19, 96), (70, 1536)):
            w = tensor(quantize(random_weight(rows + d, out_rows, d), fmt))
            x = jnp.asarray(rng.standard_normal((rows, d)), jnp.float32)
            out = np.asarray(product(x, w), np.float64)
            x64, w64 = np.asarray(x, np.float64), np.asarray(w.dequantize(), np.float64)
            scale = np.abs(x64) @ np.abs(w64).T  # what each output sums
            assert out.shape == (rows, out_rows)
            assert np.max(np.abs(out - x64 @ w64.T) / scale) < 1e-5, (rows, out_rows, d)


def test_a_step_takes_the_kernel_where_the_plan_runs_it(cpu_kernels_on):
    """decoder.linear sends a quantized weight's products of up to MAX_ROWS rows to the
    kernel when the plan runs the CPU kernels (kernel_rows), and a longer chunk to XLA's
    dot of the dequantized weight: the same values either way."""
    from xlr_jax.model.decoder import RowProducts
    from xlr_jax.ops import cpu_linear

    w = tensor(quantize(random_weight(1, 64, 128), "int4"))
    kernel = RowProducts(kernel_rows=cpu_linear.rows_it_pays(16))
    for rows in (1, 4, cpu_linear.MAX_ROWS + 1):
        x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, 128)), jnp.float32)
        lowered = jax.jit(lambda x, w: linear(x, w, kernel)).lower(x, w).as_text()
        assert ("xlr_linear_q4" in lowered) == (rows <= cpu_linear.MAX_ROWS)
        np.testing.assert_allclose(np.asarray(linear(x, w, kernel)),
                                   np.asarray(linear(x, w)), rtol=1e-5, atol=1e-4)


@pytest.fixture(scope="module")
def float_and_native(cache_dir):
    return (xlr_jax.load_model("smollm2", cache_dir=cache_dir, weights="float"),
            xlr_jax.load_model("smollm2", cache_dir=cache_dir, weights="native"))


def test_the_embedded_model_runs_on_its_own_q4_1_blocks(float_and_native, cache_dir):
    """weights="native": the file's Q4_1 matrices and Q8_0 embedding kept as they are, at
    under 30% of the f32 load's bytes; its logits are the float load's (the same
    dequantized values), so are its greedy tokens; a second load maps them from the
    params cache."""
    dense, native = float_and_native
    assert native.plan.weights == "native" and dense.plan.weights == "float"
    p = native.engine.runner.params
    assert isinstance(p.embed, QuantizedTensor) and p.embed.bits == 8
    assert all(isinstance(lp.wqkv, QuantizedTensor) and lp.w_down.bits == 4
               for lp in p.layers)
    ratio = p.nbytes() / dense.engine.runner.params.nbytes()
    assert ratio < 0.3
    ids = dense.encode("The capital of France is")[0]
    np.testing.assert_allclose(native.logits(ids), dense.logits(ids), rtol=0, atol=1e-4)
    for prompt in ("def fibonacci(n):", "Once upon a time"):
        assert native.generate(prompt, max_tokens=32).token_ids == \
            dense.generate(prompt, max_tokens=32).token_ids
    again = xlr_jax.load_model("smollm2", cache_dir=cache_dir, weights="native")
    assert again.load_info["params_from_cache"]
    assert again.engine.runner.params.nbytes() == p.nbytes()


@pytest.mark.parametrize("fmt, bound", [("int8", 0.05), ("int4", 0.3)])
def test_quantized_at_load_the_model_stays_near_its_float_logits(float_and_native, fmt,
                                                                 bound):
    """weights="int8"/"int4": every matrix quantized at load from the file's float
    values; the logits move by about the format's step (measured: int8 2.3%, int4 18% of
    the largest logit: int4 of the Q4_1 values is a second rounding)."""
    dense, _ = float_and_native
    model = xlr_jax.load_model("smollm2", params_cache=False, weights=fmt)
    ids = dense.encode("The three primary colors are")[0]
    ref = dense.logits(ids)
    err = np.abs(model.logits(ids) - ref).max() / np.abs(ref).max()
    assert 1e-4 < err < bound, err


def test_an_unknown_weight_format_is_refused_by_name():
    with pytest.raises(PlanError, match="weights 'int3' is not supported; choose one of "
                                        "float, native, int8, int4"):
        xlr_jax.load_model("smollm2", weights="int3")


def test_plan_cli_takes_the_weight_format():
    out = subprocess.run([sys.executable, "-m", "xlr_jax.cli", "plan", "llama-3-8b",
                          "--hardware", "rtx4090", "--weights", "int4", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["weights"] == "int4" and plan["reasons"]["weights"] == "set by the caller"
    # 8.03 B params at 20 bytes a 32-value group: 5.0 GB, where bf16 needs 16.1
    assert plan["memory"]["weight_bytes"] == int(8_030_261_248 * 20 / 32)


def test_the_weight_format_experiment_quick(tmp_path):
    """experiments/quantized_weights.py --quick: every format's bytes, speed and greedy
    agreement with float, in a JSON."""
    script = Path(__file__).resolve().parents[1] / "experiments/quantized_weights.py"
    out = subprocess.run([sys.executable, str(script), "--quick", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    (path,) = tmp_path.glob("quantized_weights-quick-*.json")
    figures = json.loads(path.read_text())["formats"]
    assert set(figures) == {"float", "native", "int8", "int4"}
    share = {f: figures[f]["bytes_over_float"] for f in figures}
    assert share["int4"] < share["native"] < share["int8"] < 0.3 and share["float"] == 1
    assert figures["native"]["greedy_tokens_equal_to_float"] == 8  # the same values
    assert all(f["decode_tokens_per_s"] > 0 and f["ttft_s"] > 0 for f in figures.values())
