"""Few-row weight products on the CPU (`linear.cc`): an XLA FFI custom call.

x [rows, d] @ w.T for w [out, d], f32. XLA:CPU's dot of a few rows runs at a fraction of
the machine's multiply-add rate, and a multiply-and-sum, the XLA form that reads each
weight row once for every row, costs 1.2-1.6x a matrix-vector product at 8 rows and
more past 16. The kernel reads each block of weight rows once, folds it against every
row of x while it is in the L1 cache, and spreads the blocks over XLA's intra-op
threads: 2 to 96 rows cost less than either (experiments/few_row_products.py).
`cpu_kernels` builds and registers it (`cpu_kernels.build_error()`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from xlr_jax.ops import cpu_kernels

TARGET = "xlr_linear"
MAX_ROWS = 96  # past this XLA's dot (a blocked matrix product) is as fast or faster


def rows_it_pays(lanes: int) -> int:
    """The most rows the kernel built with `lanes`-float vectors is worth taking for, the
    multiply-sum (to 16 rows) or XLA's dot taking the rest: 48 with AVX-512 (its 32
    registers hold 24 accumulators), 8 otherwise (16 registers, 8 accumulators).
    Measured by experiments/few_row_products.py on 2-core AMD EPYCs: with AVX-512 the
    kernel beat or matched XLA's best to 48 rows on both days, and past that won by
    5-7% one day (2026-12-03) and lost by 4-22% the other (2026-12-04); with AVX2 it read
    2-8 rows 0.64-0.99x the multiply-sum's time and 16 rows 1.4-1.6x (2026-12-04, once on
    an AVX2 EPYC and once as an x86-64-v3 build beside XLA capped at AVX2). 4-lane
    targets are unmeasured and keep the AVX2 rule."""
    return 48 if lanes >= 16 else 8


def supports(x, w) -> bool:
    """Whether the kernel takes x [..., d] @ w.T: 2 to MAX_ROWS rows, f32 weights, d a
    multiple of 16."""
    rows = x.size // x.shape[-1] if x.shape[-1] else 0
    return (2 <= rows <= MAX_ROWS and w.ndim == 2 and w.dtype == jnp.float32
            and x.shape[-1] == w.shape[1] and w.shape[1] % 16 == 0)


def linear(x, w, out_dtype=None, target=None):
    """x [..., d] @ w.T in `out_dtype` (default x's), by the kernel built for `target`
    (default: the runtime's; f32 accumulation); call `cpu_kernels.build_error(target)`
    first (it registers the kernel)."""
    rows, d = x.size // x.shape[-1], x.shape[-1]
    out = jax.ffi.ffi_call(cpu_kernels.target_name(TARGET, target),
                           jax.ShapeDtypeStruct((rows, w.shape[0]), jnp.float32))(
        x.reshape(rows, d).astype(jnp.float32), w)
    return out.reshape(*x.shape[:-1], w.shape[0]).astype(out_dtype or x.dtype)


def quantized_linear(x, values, scales, minimums=None, out_dtype=None, target=None):
    """x [..., d] @ w.T for a weight kept quantized (`model.quantized`'s layouts: 4-bit
    `values` uint8 [out, d / 2] with `minimums`, or int8 or float8_e4m3fn [out, d]
    without; scales float16 or float32 [out, groups]), the weights dequantized in
    registers for a few rows, into a cached tile for more (`quantized_linear.cc`); f32
    accumulation. Any row count; a group of a multiple of 32 values (4 bits) or 16. Call
    `cpu_kernels.build_error(target)` first."""
    rows, d = x.size // x.shape[-1], x.shape[-1]
    if minimums is not None:
        name, operands = "xlr_linear_q4", (values, scales, minimums)
    else:
        name = "xlr_linear_q8" if values.dtype == jnp.int8 else "xlr_linear_f8"
        operands = (values, scales)
    out = jax.ffi.ffi_call(cpu_kernels.target_name(name, target),
                           jax.ShapeDtypeStruct((rows, values.shape[0]), jnp.float32))(
        x.reshape(rows, d).astype(jnp.float32), *operands)
    return out.reshape(*x.shape[:-1], values.shape[0]).astype(out_dtype or x.dtype)
