"""Attention over the paged KV cache: the single entry point the model calls.

Layouts (one layer):
  q            [batch, q_len, num_heads, head_dim]   new tokens' queries
  kv_pages     (k_pages, v_pages), each [num_pages, kv_heads, page_size, head_dim]
  block_tables [batch, pages_per_seq] int32: page ids of each sequence, in order;
               unused entries point at any page (they are masked by `lengths`)
  lengths      [batch] int32: tokens in the cache per sequence, new ones included
  q_positions  [batch, q_len] int32: absolute position of each query token

A query at position p sees cache positions s with s <= p and s < length (and
s > p - sliding_window when a window is set). Query heads are grouped per KV
head (GQA): head h reads KV head h // (num_heads // kv_heads). A query that sees
no position (padding) returns zeros.
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


def _softmax_product(scores, visible, v, spec):
    """Masked softmax of f32 `scores`, then the product with `v` (einsum `spec`).

    The division comes after the product (fewer passes over the scores), and a
    row that sees nothing gives zeros, not NaN: NaN written to the shared scratch
    page would reach every sequence (0 * NaN).
    """
    scores = jnp.where(visible, scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores - jnp.where(jnp.isfinite(peak), peak, 0.0))
    total = jnp.sum(weights, axis=-1, keepdims=True)
    out = jnp.einsum(spec, weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out / jnp.maximum(total, jnp.finfo(jnp.float32).tiny)


def paged_attention_xla(q, kv_pages, block_tables, lengths, q_positions, *,
                        sliding_window=None):
    """Reference: gather the pages named by the block table, masked softmax in f32."""
    k_pages, v_pages = kv_pages
    batch, q_len, num_heads, head_dim = q.shape
    _, kv_heads, page_size, _ = k_pages.shape
    group = num_heads // kv_heads
    pages = block_tables.shape[1]
    # whole pages, in block-table order: [batch, pages, kv_heads, page_size, head_dim]
    k, v = k_pages[block_tables], v_pages[block_tables]
    q = q * jnp.asarray(head_dim ** -0.5, q.dtype)

    def visible_at(kv_pos):  # [batch, q_len, *kv_pos.shape]
        qp = q_positions.reshape(batch, q_len, *([1] * kv_pos.ndim))
        seen = (kv_pos <= qp) & (kv_pos < lengths.reshape(batch, 1, *([1] * kv_pos.ndim)))
        if sliding_window is not None:
            seen &= kv_pos > qp - sliding_window
        return seen

    if q_len == 1:
        # Decode: every query head against the gathered pages as they lie, one
        # plain product; scores across KV heads are computed and masked off.
        # XLA:CPU would otherwise transpose the gathered pages for a per-head
        # batched product, a copy as large as the KV read.
        cols = pages * kv_heads * page_size
        k, v = k.reshape(batch, cols, head_dim), v.reshape(batch, cols, head_dim)
        col = jnp.arange(cols, dtype=jnp.int32)
        col_head = (col // page_size) % kv_heads
        col_pos = col // (kv_heads * page_size) * page_size + col % page_size
        own = (jnp.arange(num_heads) // group)[:, None] == col_head  # [heads, cols]
        visible = visible_at(col_pos)[:, 0][:, None, :] & own[None]
        scores = jnp.einsum("bhd,bcd->bhc", q[:, 0], k, preferred_element_type=jnp.float32)
        out = _softmax_product(scores, visible, v, "bhc,bcd->bhd")
        return out[:, None].astype(q.dtype)

    # Prefill and multi-token steps: per-KV-head products over one run per sequence
    span = pages * page_size
    k = k.transpose(0, 2, 1, 3, 4).reshape(batch, kv_heads, span, head_dim)
    v = v.transpose(0, 2, 1, 3, 4).reshape(batch, kv_heads, span, head_dim)
    qg = q.reshape(batch, q_len, kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4)
    scores = jnp.einsum("bkgtd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32)
    visible = visible_at(jnp.arange(span, dtype=jnp.int32))[:, None, None]
    out = _softmax_product(scores, visible, v, "bkgts,bksd->bkgtd")
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, q_len, num_heads, head_dim).astype(q.dtype)
