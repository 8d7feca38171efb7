"""Pallas kernel for attention over the paged KV: decode (split-K) and multi-query.

One kernel serves every caller. A program owns one sequence, one KV head, one
block of that sequence's query tokens and one split of its pages:

  grid = (batch, kv_heads, q_blocks, k_splits)

The query heads of a KV head (GQA group, padded to a power of two `gp`) and
`block_q` consecutive tokens form the rows of one matrix, so a block of pages
is read once for all of them. Pages are walked `pages_per_block` at a time
through the block table with an online softmax in f32; only pages a row can
see are read (up to the block's last position, from the sliding window's
start), their scores soft-capped where a cap is set. With `k_splits > 1` (flash-decoding) each split writes its partial
output and log-sum-exp, merged afterwards in `_merge_splits`.

Decode is the case of one query token per sequence; the multi-query case (q
tokens ragged across the batch, given by cumulative lengths) serves
speculative verification, chunked prefill over a cached prefix and prefill.

Quantized KV: int8 or fp8 pages carry per-token-per-head f32 scales
([pages, kv_heads, page_size]); a page is dequantized in the kernel as
`page.astype(f32) * scale`, the score by K's scale and the probabilities by V's.

Constraints (Triton): head_dim, page_size * pages_per_block and
block_q * gp are powers of two >= 16; head_dim % 16 == 0.

Lowering: on GPU the kernel is compiled through Pallas' Triton backend (jax
0.10.2 to 0.11.x, pinned in pyproject). jax 0.11 deprecates that backend in favour of
Mosaic GPU; moving on means rewriting the page loop with Mosaic GPU's explicit
TMA copies and warpgroup matmuls (see jax.experimental.pallas.mosaic_gpu). On
the CPU it runs in Pallas' interpret mode, which is how it is tested.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Finite stand-in for -inf: an all-masked block must not produce inf - inf.
_MASKED = -1e30


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _kernel(cu_ref, len_ref, bt_ref, pos_ref, q_ref, k_ref, v_ref, *rest,
            gp, block_q, pages_per_block, k_splits, sliding_window, softcap, quantized):
    if quantized:
        ks_ref, vs_ref, o_ref, lse_ref = rest
    else:
        (o_ref, lse_ref), ks_ref, vs_ref = rest, None, None
    b, split = pl.program_id(0), pl.program_id(3)
    tok0 = cu_ref[b] + pl.program_id(2) * block_q
    tok_end = cu_ref[b + 1]
    rows = block_q * gp
    page_size, head_dim = k_ref.shape[1:]
    span = pages_per_block * page_size

    @pl.when(tok0 < tok_end)
    def _():
        r0 = tok0 * gp
        row_ok = tok0 + jnp.arange(rows, dtype=jnp.int32) // gp < tok_end
        pos = jnp.where(row_ok, pos_ref[pl.ds(r0, rows)], -1)
        length = len_ref[b]
        q = q_ref[pl.ds(r0, rows), :]
        # pages any row can see: [lo, hi)
        hi = pl.cdiv(jnp.minimum(jnp.max(pos) + 1, length), page_size)
        lo = 0
        if sliding_window is not None:
            first = jnp.min(jnp.where(row_ok, pos, jnp.iinfo(jnp.int32).max))
            lo = jnp.maximum(first - sliding_window + 1, 0) // page_size
        per_split = pl.cdiv(pl.cdiv(jnp.maximum(hi - lo, 0), k_splits),
                            pages_per_block) * pages_per_block
        start = lo + split * per_split
        stop = jnp.minimum(start + per_split, hi)

        def body(i, carry):
            acc, m, denom = carry
            p0 = start + i * pages_per_block
            pages = bt_ref[b, pl.ds(p0, pages_per_block)]
            k = k_ref[pages].reshape(span, head_dim)
            v = v_ref[pages].reshape(span, head_dim)
            if quantized:
                k, v = k.astype(jnp.float32), v.astype(jnp.float32)
                s = plgpu.dot(q.astype(jnp.float32), k, trans_b=True)
                s = s * ks_ref[pages].reshape(1, span)
            else:
                s = plgpu.dot(q, k, trans_b=True).astype(jnp.float32)
            if softcap is not None:
                s = softcap * jnp.tanh(s / softcap)
            kv_pos = p0 * page_size + jnp.arange(span, dtype=jnp.int32)
            seen = (kv_pos[None, :] <= pos[:, None]) & (kv_pos[None, :] < length)
            if sliding_window is not None:
                seen &= kv_pos[None, :] > pos[:, None] - sliding_window
            s = jnp.where(seen, s, _MASKED)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            p = jnp.where(seen, jnp.exp(s - m_new[:, None]), 0.0)
            fix = jnp.exp(m - m_new)
            denom = denom * fix + jnp.sum(p, axis=1)
            if quantized:
                p = p * vs_ref[pages].reshape(1, span)
            else:
                p = p.astype(v.dtype)
            acc = acc * fix[:, None] + plgpu.dot(p, v).astype(jnp.float32)
            return acc, m_new, denom

        init = (jnp.zeros((rows, head_dim), jnp.float32),
                jnp.full((rows,), _MASKED, jnp.float32), jnp.zeros((rows,), jnp.float32))
        blocks = pl.cdiv(jnp.maximum(stop - start, 0), pages_per_block)
        acc, m, denom = jax.lax.fori_loop(0, blocks, body, init)
        safe = jnp.maximum(denom, jnp.finfo(jnp.float32).tiny)
        out = acc / safe[:, None]  # rows that see nothing: 0 / tiny = 0
        plgpu.store(o_ref.at[pl.ds(r0, rows), :], out.astype(o_ref.dtype),
                    mask=row_ok[:, None])
        lse = jnp.where(denom > 0, m + jnp.log(safe), _MASKED)
        plgpu.store(lse_ref.at[pl.ds(r0, rows)], lse, mask=row_ok)


def _merge_splits(out, lse):
    """Combine per-split outputs [S, ..., D] by their log-sum-exp [S, ...]."""
    peak = jnp.max(lse, axis=0)
    w = jnp.exp(lse - peak)
    return jnp.sum(out * w[..., None], axis=0) / jnp.sum(w, axis=0)[..., None]


def default_splits(batch: int, kv_heads: int, q_blocks: int, pages: int,
                   pages_per_block: int) -> int:
    """Enough splits that ~2 programs per SM (H200: 132) have work, within the pages."""
    programs = batch * kv_heads * q_blocks
    want = pl.cdiv(264, programs)
    return max(1, min(want, pl.cdiv(pages, pages_per_block)))


@functools.partial(jax.jit, static_argnames=(
    "max_q_len", "layer", "sliding_window", "softcap", "pages_per_block", "k_splits",
    "interpret"))
def ragged_paged_attention_pallas(q, k_pages, v_pages, block_tables, lengths, cu_q_lens,
                                  q_positions, k_scales=None, v_scales=None, *,
                                  max_q_len: int, layer: int | None = None, sliding_window=None,
                                  softcap=None, pages_per_block: int | None = None,
                                  k_splits: int | None = None, interpret: bool = False):
    """Attention of ragged queries q [T, H, D] over paged KV; returns [T, H, D].

    Sequence b owns tokens cu_q_lens[b]:cu_q_lens[b+1] (at most `max_q_len`),
    each at q_positions[t]. k/v pages [num_pages, kv_heads, page_size, D], or
    all layers' [layers, num_pages, ...] with `layer` naming the one to read
    (read in place: slicing it out first would copy the layer's whole pool).
    """
    tokens, num_heads, head_dim = q.shape
    num_pages, kv_heads, page_size, _ = k_pages.shape[-4:]
    batch, table_width = block_tables.shape
    group = num_heads // kv_heads
    gp = _pow2(group)
    # >= 16 rows (Triton's smallest matmul), up to 64 when there are tokens to fill them
    block_q = max(16 // gp, min(_pow2(max_q_len), 64 // gp), 1)
    if pages_per_block is None:
        pages_per_block = max(1, 64 // page_size)
    q_blocks = pl.cdiv(max_q_len, block_q)
    if k_splits is None:
        k_splits = default_splits(batch, kv_heads, q_blocks, table_width, pages_per_block)
    rows = block_q * gp

    # rows [kv_heads, T * gp (+ one block of padding), D]: row t * gp + g is
    # token t's query head kv_head * group + g
    qr = (q * jnp.asarray(head_dim ** -0.5, q.dtype)).reshape(tokens, kv_heads, group, head_dim)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, gp - group), (0, 0))).transpose(1, 0, 2, 3)
    qr = jnp.pad(qr.reshape(kv_heads, tokens * gp, head_dim), ((0, 0), (0, rows), (0, 0)))
    pos = jnp.pad(jnp.repeat(q_positions.astype(jnp.int32), gp), (0, rows), constant_values=-1)
    # padding lets a block read past the last used page without going out of bounds
    bt = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, pages_per_block)))
    quantized = k_scales is not None
    num_rows = tokens * gp + rows

    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    lead = () if layer is None else (None,)  # the layer axis, squeezed
    at = () if layer is None else (layer,)
    per_head = pl.BlockSpec((*lead, num_pages, None, page_size, head_dim),
                            lambda b, h, i, s: (*at, 0, h, 0, 0))
    in_specs = [whole(cu_q_lens.shape), whole(lengths.shape), whole(bt.shape),
                whole(pos.shape), pl.BlockSpec((None, num_rows, head_dim),
                                               lambda b, h, i, s: (h, 0, 0)),
                per_head, per_head]
    operands = [cu_q_lens.astype(jnp.int32), lengths.astype(jnp.int32), bt, pos, qr,
                k_pages, v_pages]
    if quantized:
        scale_spec = pl.BlockSpec((*lead, num_pages, None, page_size),
                                  lambda b, h, i, s: (*at, 0, h, 0))
        in_specs += [scale_spec, scale_spec]
        operands += [k_scales.astype(jnp.float32), v_scales.astype(jnp.float32)]
    out_dtype = jnp.float32 if k_splits > 1 else q.dtype
    kernel = functools.partial(_kernel, gp=gp, block_q=block_q,
                               pages_per_block=pages_per_block, k_splits=k_splits,
                               sliding_window=sliding_window, softcap=softcap,
                               quantized=quantized)
    out, lse = pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, q_blocks, k_splits),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, num_rows, head_dim), lambda b, h, i, s: (s, h, 0, 0)),
                   pl.BlockSpec((None, None, num_rows), lambda b, h, i, s: (s, h, 0))],
        out_shape=[jax.ShapeDtypeStruct((k_splits, kv_heads, num_rows, head_dim), out_dtype),
                   jax.ShapeDtypeStruct((k_splits, kv_heads, num_rows), jnp.float32)],
        interpret=interpret,
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=4, num_stages=2),
        name="xlr_paged_attention",
    )(*operands)
    out = out[0] if k_splits == 1 else _merge_splits(out, lse)
    out = out[:, :tokens * gp].reshape(kv_heads, tokens, gp, head_dim)[:, :, :group]
    return out.transpose(1, 0, 2, 3).reshape(tokens, num_heads, head_dim).astype(q.dtype)
