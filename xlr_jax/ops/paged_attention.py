"""Attention over the paged KV cache: the single entry point the model calls.

Layouts (one layer):
  q            [batch, q_len, num_heads, head_dim]   new tokens' queries
  kv_pages     (k_pages, v_pages), each [kv_heads, num_pages, page_size, head_dim]
  block_tables [batch, pages_per_seq] int32: page ids of each sequence, in order;
               unused entries point at any page (they are masked by `lengths`)
  lengths      [batch] int32: tokens in the cache per sequence, new ones included
  q_positions  [batch, q_len] int32: absolute position of each query token

A query at position p sees cache positions s with s <= p and s < length (and
s > p - sliding_window when a window is set). Query heads are grouped per KV
head (GQA): head h reads KV head h // (num_heads // kv_heads). A query that sees no
position (padding) returns zeros.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLS = ("auto", "xla")


def paged_attention(q, kv_pages, block_tables, lengths, q_positions, *,
                    sliding_window=None, impl="auto"):
    """Causal GQA attention of `q` over each sequence's pages; returns q's shape."""
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; choose one of {IMPLS}")
    return paged_attention_xla(q, kv_pages, block_tables, lengths, q_positions,
                               sliding_window=sliding_window)


def paged_attention_xla(q, kv_pages, block_tables, lengths, q_positions, *,
                        sliding_window=None):
    """Reference: gather the pages named by the block table, masked softmax in f32."""
    k_pages, v_pages = kv_pages
    batch, q_len, num_heads, head_dim = q.shape
    kv_heads, _, page_size, _ = k_pages.shape
    group = num_heads // kv_heads
    span = block_tables.shape[1] * page_size

    # [kv_heads, batch, pages_per_seq, page_size, head_dim] -> one run per sequence;
    # (kv_heads, batch) stay the leading batch dims so XLA needs no transposes
    k = k_pages[:, block_tables].reshape(kv_heads, batch, span, head_dim)
    v = v_pages[:, block_tables].reshape(kv_heads, batch, span, head_dim)
    qg = q.reshape(batch, q_len, kv_heads, group, head_dim).transpose(2, 0, 3, 1, 4)

    scores = jnp.einsum("kbgtd,kbsd->kbgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (head_dim ** -0.5)
    kv_pos = jnp.arange(span, dtype=jnp.int32)
    visible = (kv_pos[None, None, :] <= q_positions[:, :, None]) & (
        kv_pos[None, None, :] < lengths[:, None, None])
    if sliding_window is not None:
        visible &= kv_pos[None, None, :] > q_positions[:, :, None] - sliding_window
    scores = jnp.where(visible[None, :, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    # a query that sees nothing (padding past a window) must give zeros, not NaN:
    # NaN written to the shared scratch page would reach every row (0 * NaN)
    probs = jnp.where(visible.any(-1)[None, :, None, :, None], probs, 0.0)
    out = jnp.einsum("kbgts,kbsd->kbgtd", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    out = out.transpose(1, 3, 0, 2, 4)
    return out.reshape(batch, q_len, num_heads, head_dim).astype(q.dtype)
