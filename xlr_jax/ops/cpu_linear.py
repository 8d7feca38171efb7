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
