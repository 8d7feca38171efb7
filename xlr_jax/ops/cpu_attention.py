"""The CPU's paged-attention kernel (`paged_attention.cc`): an XLA FFI custom call.

XLA:CPU runs the pure-JAX walk as many small ops one after another, each reading a few
pages on one thread (experiments/decode_attention_floor.py: 1.4-1.6x a lone read of the
same bytes, which itself runs at 10-15 GB/s), and a prefill chunk's attention as masked
pieces of score matrices over gathered copies of its pages. The kernel reads each page in
place, folds it into an online softmax while it is in the cache (a decode row's query
heads, or a chunk's queries in tiles of 16 query vectors, fold each K and V row once for
all of them), and spreads the work over XLA's intra-op threads. It takes every row the
engine runs: decode, verify rows and chunks of any length (experiments/chunk_attention.py).
`cpu_kernels` builds and registers it (`cpu_kernels.build_error()`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from xlr_jax.ops import cpu_kernels

TARGET = "xlr_paged_attention"
HEAD_DIMS = (32, 64, 128, 256)
MAX_GROUP = 8
MAX_PAGE_SIZE = 256


def takes(head_dim: int, group: int, page_size: int, kv_dtype) -> bool:
    """Whether the kernel takes a model's pages: f32, a head dim of 32, 64, 128 or 256, at
    most 8 query heads per KV head, at most 256 slots a page."""
    return (jnp.dtype(kv_dtype) == jnp.float32 and head_dim in HEAD_DIMS
            and 1 <= group <= MAX_GROUP and page_size <= MAX_PAGE_SIZE)


def supports(q_shape, kv_pages, kv_scales=None) -> bool:
    """Whether the kernel takes this call, q [rows, q_len, heads, dim]: `takes` and no
    scales (f32 pages)."""
    k, v = kv_pages
    heads, dim = q_shape[-2], q_shape[-1]
    kv_heads, page_size = k.shape[-3], k.shape[-2]
    return (kv_scales is None and v.dtype == k.dtype and heads % kv_heads == 0
            and takes(dim, heads // kv_heads, page_size, k.dtype))


def attention(q, kv_pages, block_tables, lengths, q_positions, *, layer=None,
              sliding_window=None, target=None):
    """paged_attention's padded form (q [rows, q_len, heads, dim], q_positions [rows,
    q_len]; a position < 0 sees nothing) by the kernel built for `target` (default: the
    runtime's); call `cpu_kernels.build_error(target)` first (it registers the kernel)."""
    k, v = kv_pages
    if layer is None:  # one layer's pages: a layer axis of one
        k, v, layer = k[None], v[None], 0
    pos = q_positions.astype(jnp.int32)
    last = jnp.minimum(pos + 1, lengths.astype(jnp.int32)[:, None])
    first = (jnp.zeros_like(pos) if sliding_window is None
             else jnp.maximum(pos - sliding_window + 1, 0))
    out = jax.ffi.ffi_call(cpu_kernels.target_name(TARGET, target),
                           jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q.astype(jnp.float32), k, v, block_tables.astype(jnp.int32), first, last,
        jnp.asarray(layer, jnp.int32))
    return out.astype(q.dtype)
