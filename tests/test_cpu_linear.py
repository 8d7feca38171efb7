"""The CPU's few-row weight-product kernel (ops/linear.cc) against a float64 reference,
what it declines, and a model decoding the same through it as through XLA's products."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlr_jax.bench.engines import random_params
from xlr_jax.model.config import ModelConfig
from xlr_jax.model.decoder import RowProducts, linear
from xlr_jax.model.sampling_params import SamplingParams
from xlr_jax.ops import cpu_linear
from xlr_jax.planning.buckets import REDUCE_ROWS
from xlr_jax.planning.hardware import probe
from xlr_jax.planning.mapper import Workload, plan
from xlr_jax.runtime.engine import Engine


def product_error(out, x, w) -> float:
    """The largest error against float64, relative to what each output sums (|x| . |w|):
    f32 rounding in any summation order stays near 1e-7 of that."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    ref = x64 @ w64.T
    scale = np.abs(x64) @ np.abs(w64).T
    return float(np.max(np.abs(np.asarray(out, np.float64) - ref) / scale))


@pytest.mark.parametrize("rows", [2, 3, 5, 6, 7, 8, 13, 24, 37, 72, cpu_linear.MAX_ROWS])
def test_kernel_matches_float64(rows, kernel_target):
    """Every row count in groups of 1-6 rows (1-2 on targets of 16 vector registers),
    weight blocks of 4 and the 1-3 rows past the last block, tasks that end mid-block,
    inputs of one to 96 vectors, on every tested target."""
    rng = np.random.default_rng(rows)
    product = jax.jit(lambda x, w: cpu_linear.linear(x, w, target=kernel_target))
    for out_rows, d in ((1, 16), (7, 32), (33, 576), (130, 48), (70, 1536)):
        x = jnp.asarray(rng.standard_normal((rows, d)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((out_rows, d)), jnp.float32)
        assert cpu_linear.supports(x, w)
        out = product(x, w)
        assert out.shape == (rows, out_rows) and out.dtype == jnp.float32
        assert product_error(out, x, w) < 1e-5, (rows, out_rows, d)


def test_kernel_keeps_leading_axes_and_output_dtype(cpu_kernels_on):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((40, 64)), jnp.float32)
    out = cpu_linear.linear(x, w, jnp.float32)
    assert out.shape == (2, 3, 40)
    assert product_error(out.reshape(6, 40), x.reshape(6, 64), w) < 1e-5


def test_kernel_declines_what_it_does_not_take():
    """One row (XLA's matrix-vector product reads at bandwidth), more than MAX_ROWS rows,
    bf16 weights and an input width that is not a multiple of 16 take XLA's products."""
    w = jnp.ones((8, 64), jnp.float32)
    assert cpu_linear.supports(jnp.ones((2, 64)), w)
    assert not cpu_linear.supports(jnp.ones((1, 64)), w)
    assert not cpu_linear.supports(jnp.ones((cpu_linear.MAX_ROWS + 1, 64)), w)
    assert not cpu_linear.supports(jnp.ones((4, 64)), w.astype(jnp.bfloat16))
    assert not cpu_linear.supports(jnp.ones((4, 40)), jnp.ones((8, 40), jnp.float32))
    # and _linear then takes the multiply-sum or the dot, with the same result
    x = jnp.asarray(np.random.default_rng(2).standard_normal((4, 40)), jnp.float32)
    w40 = jnp.asarray(np.random.default_rng(3).standard_normal((8, 40)), jnp.float32)
    out = linear(x, w40, RowProducts(REDUCE_ROWS, cpu_linear.MAX_ROWS))
    assert product_error(out, x, w40) < 1e-5


def test_model_decodes_the_same_through_the_kernel(cpu_kernels_on):
    """Four prompts decoding side by side (4-row decode steps, and 20-row steps that carry
    a later prompt's 16-token chunk beside them) through the kernel and through XLA's
    multiply-sums and dots: the same 40 greedy tokens, log-probabilities within 1e-4."""
    config = ModelConfig(architecture="llama", vocab_size=512, hidden_size=128, num_layers=2,
                         num_heads=6, num_kv_heads=2, head_dim=32, intermediate_size=256,
                         rms_norm_eps=1e-5, rope_theta=10000.0, max_context=256,
                         tie_embeddings=False)
    params = jax.tree.map(lambda a: a * 10 if a.ndim == 2 else a,
                          random_params(config, jnp.float32, seed=7))
    rng = np.random.default_rng(8)
    prompts = [[int(t) for t in rng.integers(0, 512, n)] for n in (40, 23, 57, 31)]
    sampling = [SamplingParams(max_tokens=40, ignore_eos=True, logprobs=0)] * 4
    done = {}
    for kernel_rows in (0, cpu_linear.MAX_ROWS):
        p = plan(probe(), config, Workload(max_batch=4, prefill_chunk=32, max_context=256,
                                           max_step_tokens=20),
                 page_size=16, num_pages=48, attn_impl="xla",
                 linear_impl="cpu" if kernel_rows else "xla")
        # every product of 2 to 96 rows by the kernel, whatever this CPU's vectors pay for
        engine = Engine(config, params, None, dataclasses.replace(p, kernel_rows=kernel_rows))
        done[kernel_rows] = {i: r for i, _, r in engine.run(prompts, sampling) if r is not None}
        assert sorted(done[kernel_rows]) == [0, 1, 2, 3]
    for i in range(4):
        a, b = done[0][i], done[cpu_linear.MAX_ROWS][i]
        assert len(a.token_ids) == 40 and a.token_ids == b.token_ids
        np.testing.assert_allclose([x["logprob"] for x in a.logprobs],
                                   [x["logprob"] for x in b.logprobs], atol=1e-4)
