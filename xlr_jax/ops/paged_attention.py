"""Attention over the paged KV cache: the single entry point the model calls.

Layouts (one layer):
  q            padded: [batch, q_len, num_heads, head_dim], with q_positions [batch, q_len];
               ragged: [tokens, num_heads, head_dim], with cu_q_lens [batch + 1]
               (sequence b owns tokens cu_q_lens[b]:cu_q_lens[b+1]) and optional
               q_positions [tokens] (default: the sequence's last positions)
  kv_pages     (k_pages, v_pages), each [num_pages, kv_heads, page_size, head_dim],
               or every layer's [layers, num_pages, ...] with `layer` picking one
  kv_scales    None, or (k_scales, v_scales) [(layers,) num_pages, kv_heads, page_size]
               f32 for int8/fp8 pages: a stored value times its scale is the K/V
  block_tables [batch, pages_per_seq] int32: page ids of each sequence, in order;
               unused entries point at any page (they are masked by `lengths`)
  lengths      [batch] int32: tokens in the cache per sequence, new ones included

A query at position p sees cache positions s with s <= p and s < length (and
s > p - sliding_window when a window is set: the walks skip the pages before it).
Scores are q.k / sqrt(head_dim), soft-capped as softcap * tanh(score / softcap) when a
cap is set (Gemma-2). Query heads are grouped per KV
head (GQA): head h reads KV head h // (num_heads // kv_heads). A query that sees
no position (padding) returns zeros.

impl: "xla" is the pure-JAX reference below; "pallas" the kernel in
`pallas_attention` (interpret mode off the GPU); "cpu" the CPU's kernel in
`cpu_attention` (an XLA custom call) for f32 pages in the padded form, the XLA path for
the rest (and for soft-capped scores); "auto" is Pallas on GPU and XLA elsewhere
(XLA:CPU runs the reference faster than interpreted kernels; the plan picks "cpu" when
its kernel builds).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from xlr_jax.kv.paged_kv import page_values
from xlr_jax.ops import cpu_attention, cpu_kernels

IMPLS = ("auto", "pallas", "xla", "cpu")


def resolve_impl(impl: str) -> str:
    """The implementation `impl` stands for on this backend."""
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; choose one of {IMPLS}")
    if impl == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return impl


def soft_cap(x, cap: float):
    """cap * tanh(x / cap): x squashed into (-cap, cap), near x where |x| << cap."""
    return cap * jnp.tanh(x / cap)


def paged_attention(q, kv_pages, block_tables, lengths, q_positions=None, *,
                    cu_q_lens=None, max_q_len=None, kv_scales=None, layer=None,
                    sliding_window=None, softcap=None, impl="auto", pages_per_block=None):
    """Causal GQA attention of `q` over each sequence's pages; returns q's shape.

    Padded form when `cu_q_lens` is None, ragged otherwise (see the module
    docstring). `max_q_len` (static) bounds a ragged sequence's token count.
    `pages_per_block` (padded form, XLA): walk only the pages the queries see, that
    many at a time (`paged_attention_blocked`), instead of the whole block table.
    """
    impl = resolve_impl(impl)
    if cu_q_lens is None:
        if q.ndim != 4 or q_positions is None or q_positions.shape != q.shape[:2]:
            raise ValueError("padded attention takes q [batch, q_len, heads, dim] and "
                             "q_positions [batch, q_len]; pass cu_q_lens for ragged q")
        if impl == "cpu":
            if cpu_attention.supports(q.shape, kv_pages, kv_scales) and softcap is None \
                    and cpu_kernels.build_error() is None:
                return cpu_attention.attention(q, kv_pages, block_tables, lengths, q_positions,
                                               layer=layer, sliding_window=sliding_window)
            impl = "xla"  # pages or a chunk the kernel does not take: the XLA walk
        if impl == "xla" and pages_per_block:
            return paged_attention_blocked(q, kv_pages, block_tables, lengths, q_positions,
                                           pages_per_block=pages_per_block,
                                           kv_scales=kv_scales, layer=layer,
                                           sliding_window=sliding_window, softcap=softcap)
        if impl == "xla":
            return paged_attention_xla(q, kv_pages, block_tables, lengths, q_positions,
                                       kv_scales=kv_scales, sliding_window=sliding_window,
                                       softcap=softcap, layer=layer)
        # the kernel takes ragged queries: each row's q_len tokens, back to back
        batch, q_len = q.shape[:2]
        out = paged_attention(q.reshape(batch * q_len, *q.shape[2:]), kv_pages, block_tables,
                              lengths, q_positions.reshape(-1),
                              cu_q_lens=jnp.arange(batch + 1, dtype=jnp.int32) * q_len,
                              max_q_len=q_len, kv_scales=kv_scales, layer=layer,
                              sliding_window=sliding_window, softcap=softcap, impl=impl)
        return out.reshape(q.shape)
    impl = "xla" if impl == "cpu" else impl  # ragged q: the CPU kernel takes padded decode
    if q.ndim != 3 or cu_q_lens.shape != (block_tables.shape[0] + 1,):
        raise ValueError("ragged attention takes q [tokens, heads, dim] and cu_q_lens "
                         "[batch + 1]")
    # each token's sequence (the kernel finds it from cu_q_lens itself)
    seq = None if q_positions is not None and impl == "pallas" else \
        jnp.searchsorted(cu_q_lens, jnp.arange(q.shape[0]), side="right") - 1
    if q_positions is None:  # the new tokens are each sequence's last ones
        first = lengths - (cu_q_lens[1:] - cu_q_lens[:-1])
        q_positions = first[seq] + jnp.arange(q.shape[0]) - cu_q_lens[seq]
    if impl == "xla":
        # each token is a one-token query over its own sequence's pages
        out = paged_attention_xla(q[:, None], kv_pages, block_tables[seq], lengths[seq],
                                  q_positions[:, None], kv_scales=kv_scales,
                                  sliding_window=sliding_window, softcap=softcap, layer=layer)
        return out[:, 0]
    from xlr_jax.ops.pallas_attention import ragged_paged_attention_pallas  # see ops/__init__

    ks, vs = kv_scales if kv_scales is not None else (None, None)
    kv_pages = tuple(page_values(x) for x in kv_pages)  # the kernel in interpret mode on the CPU
    return ragged_paged_attention_pallas(
        q, *kv_pages, block_tables, lengths, cu_q_lens, q_positions, ks, vs,
        max_q_len=max_q_len or q.shape[0], layer=layer, sliding_window=sliding_window,
        softcap=softcap, interpret=jax.default_backend() != "gpu")


def gather_pages(pages, table, layer=None):
    """The pages `table` lists (any shape of page ids), of `layer` when `pages` holds
    every layer: [*table.shape, *one page's shape]. Gathered as rows of a 2-D view, a
    page a row: XLA:CPU copies contiguous rows faster than it gathers the same pages
    from the 5-D layout (batch-1 decode 4% faster at 1,000-1,800 tokens, measured)."""
    lead = 0 if layer is None else 1
    page_shape = pages.shape[lead + 1:]
    rows = pages.reshape(-1, math.prod(page_shape))
    ids = table if layer is None else layer * pages.shape[1] + table
    return page_values(rows[ids].reshape(*table.shape, *page_shape))


def _softmax_product(scores, visible, v, spec, softcap=None):
    """Masked softmax of f32 `scores` (soft-capped first, with `softcap`), then the
    product with `v` (einsum `spec`).

    The division comes after the product (fewer passes over the scores), and a
    row that sees nothing gives zeros, not NaN: NaN written to the shared scratch
    page would reach every sequence (0 * NaN).
    """
    if softcap is not None:
        scores = soft_cap(scores, softcap)
    scores = jnp.where(visible, scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores - jnp.where(jnp.isfinite(peak), peak, 0.0))
    total = jnp.sum(weights, axis=-1, keepdims=True)
    out = jnp.einsum(spec, weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out / jnp.maximum(total, jnp.finfo(jnp.float32).tiny)


def paged_attention_xla(q, kv_pages, block_tables, lengths, q_positions, *,
                        kv_scales=None, sliding_window=None, softcap=None, layer=None):
    """Reference (padded q): gather the block table's pages, masked softmax in f32."""
    k_pages, v_pages = kv_pages
    batch, q_len, num_heads, head_dim = q.shape
    kv_heads, page_size = k_pages.shape[-3], k_pages.shape[-2]
    group = num_heads // kv_heads
    pages = block_tables.shape[1]
    out_dtype = q.dtype
    # whole pages, in block-table order: [batch, pages, kv_heads, page_size, head_dim]
    k, v = (gather_pages(x, block_tables, layer) for x in kv_pages)
    if kv_scales is not None:
        k = k.astype(jnp.float32) * gather_pages(kv_scales[0], block_tables, layer)[..., None]
        v = v.astype(jnp.float32) * gather_pages(kv_scales[1], block_tables, layer)[..., None]
        q = q.astype(jnp.float32)
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
        out = _softmax_product(scores, visible, v, "bhc,bcd->bhd", softcap)
        return out[:, None].astype(out_dtype)

    # Prefill and multi-token steps: per-KV-head products over one run per sequence
    span = pages * page_size
    k = k.transpose(0, 2, 1, 3, 4).reshape(batch, kv_heads, span, head_dim)
    v = v.transpose(0, 2, 1, 3, 4).reshape(batch, kv_heads, span, head_dim)
    qg = q.reshape(batch, q_len, kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4)
    scores = jnp.einsum("bkgtd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32)
    visible = visible_at(jnp.arange(span, dtype=jnp.int32))[:, None, None]
    out = _softmax_product(scores, visible, v, "bkgts,bksd->bkgtd", softcap)
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, q_len, num_heads, head_dim).astype(out_dtype)



def walk_sizes(pages_per_block: int, table_width: int, rows: int = 1) -> tuple[int, ...]:
    """The pages each of `rows` decode rows' attention walk reads at a time, largest
    first: the block shared by the rows, its quarter, single pages. A piece gathers every
    row's pages at once, and past a block of rows x pages they leave the CPU's caches (8
    rows at 4,000 tokens, SmolLM2's layout: 5.3 ms a layer in 4-page pieces, 12.1 ms in
    16-page ones; one row the same either way). None as wide as the table: its slice
    would be the whole table, which XLA hoists out of the loop and gathers every step,
    even when the loop runs no iteration (decode at half speed with a 16-page table)."""
    block = max(pages_per_block // rows, 1)
    sizes = {s for s in (block, quarter_block(block)) if s < table_width}
    return tuple(sorted(sizes | {1}, reverse=True))


def quarter_block(pages_per_block: int) -> int:
    return max(pages_per_block // 4, 1)


def paged_attention_blocked(q, kv_pages, block_tables, lengths, q_positions, *,
                            pages_per_block: int, kv_scales=None, sliding_window=None,
                            softcap=None, layer=None):
    """The XLA path whose cost follows the pages the queries can see (padded q).

    Walks the block tables with an online softmax in f32, from the first page any query
    sees to the last, in loops with dynamic trip counts, so a block table may be as wide
    as the longest context and a short sequence still reads only its own few pages.
    On XLA:CPU each piece of the walk costs ~30 us beside its pages' gather (~20 us a
    page), so decode (one query per row) walks the pages in the sizes of `walk_sizes` for
    its row count, each size's last piece reading up to a quarter of itself past the last
    seen page: few pieces, few pages over (one row, 16-page blocks: 14 pages, one piece of
    16; 18: 16 + 1 + 1; 30: 16 + 16). A chunk's
    products outweigh a piece's cost: it walks the pages every query sees whole in
    unmasked half blocks (and a last quarter), then the diagonal in masked quarters.
    `block_tables` must be a whole number of blocks wide.
    One query per sequence (decode) reads the gathered pages as they lie, [batch, pages,
    kv heads, slots, dim]: its queries are repeated per page, so every product is
    batched over (batch, page, KV head) and neither transposes the pages nor scores a
    head against another head's keys.
    """
    k_pages, v_pages = kv_pages
    batch, q_len, num_heads, head_dim = q.shape
    kv_heads, page_size = k_pages.shape[-3], k_pages.shape[-2]
    group = num_heads // kv_heads
    if block_tables.shape[1] % pages_per_block:
        raise ValueError(f"block tables {block_tables.shape[1]} pages wide are not a whole "
                         f"number of {pages_per_block}-page blocks")
    out_dtype = q.dtype
    q = q.astype(jnp.float32) * head_dim ** -0.5
    valid = q_positions >= 0
    last = jnp.max(jnp.where(valid, jnp.minimum(q_positions + 1, lengths[:, None]), 0))
    first_page = 0  # the first page any query sees
    if sliding_window is not None:
        lowest = jnp.min(jnp.where(valid, q_positions, jnp.iinfo(jnp.int32).max))
        first_page = jnp.maximum(lowest - sliding_window + 1, 0) // page_size
    decode = q_len == 1
    if decode:  # [B, 1, kvh, group, D]: broadcast over a piece's pages
        qs = q.reshape(batch, 1, kv_heads, group, head_dim)
        rows = (batch, kv_heads, group)
    else:  # [B, kvh, group, Q, D]; per KV head, the piece's positions in order
        qs = q.reshape(batch, q_len, kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4)
        rows = (batch, kv_heads, group, q_len)

    def piece(start, pages, carry, masked=True):
        """Fold pages [start, start + pages) of each row (`pages` static) into carry;
        unmasked: every query sees every position of them (no mask pass)."""
        peak, total, acc = carry
        span = pages * page_size
        table = jax.lax.dynamic_slice_in_dim(block_tables, start, pages, axis=1)
        k, v = (gather_pages(x, table, layer) for x in kv_pages)   # [B, P, kvh, ps, D]
        if kv_scales is not None:
            k = k.astype(jnp.float32) * gather_pages(kv_scales[0], table, layer)[..., None]
            v = v.astype(jnp.float32) * gather_pages(kv_scales[1], table, layer)[..., None]
        pos = start * page_size + jnp.arange(span, dtype=jnp.int32)
        seen = (pos <= q_positions[..., None]) & (pos < lengths[:, None, None])
        if sliding_window is not None:
            seen &= pos > q_positions[..., None] - sliding_window
        if decode:  # scores [B, P, kvh, group, slots]; the softmax runs over (page, slot)
            qp = jnp.broadcast_to(qs, (batch, pages, kv_heads, group, head_dim))
            scores = jnp.einsum("bpkgd,bpksd->bpkgs", qp, k, preferred_element_type=jnp.float32)
            seen = seen.reshape(batch, pages, 1, 1, page_size)
            axes = (1, 4)
        else:  # scores [B, kvh, group, Q, span]
            k, v = (x.transpose(0, 2, 1, 3, 4).reshape(batch, kv_heads, span, head_dim)
                    for x in (k, v))
            scores = jnp.einsum("bkgtd,bksd->bkgts", qs, k, preferred_element_type=jnp.float32)
            seen = seen[:, None, None]
            axes = (-1,)
        if softcap is not None:
            scores = soft_cap(scores, softcap)
        if masked:
            scores = jnp.where(seen, scores, -jnp.inf)
        new_peak = jnp.maximum(peak, jnp.max(scores, axis=axes))
        safe = jnp.where(jnp.isfinite(new_peak), new_peak, 0.0)
        weights = jnp.exp(scores - jnp.expand_dims(safe, axes))
        rescale = jnp.exp(peak - safe)  # 0 while nothing was seen (peak -inf)
        total = total * rescale + jnp.sum(weights, axis=axes)
        weights = weights.astype(v.dtype)
        if decode:  # summed over pages after the product: batch dims stay leading
            out = jnp.einsum("bpkgs,bpksd->bpkgd", weights, v,
                             preferred_element_type=jnp.float32).sum(axis=1)
        else:
            out = jnp.einsum("bkgts,bksd->bkgtd", weights, v, preferred_element_type=jnp.float32)
        acc = acc * rescale[..., None] + out
        return new_peak, total, acc

    carry = (jnp.full(rows, -jnp.inf, jnp.float32), jnp.zeros(rows, jnp.float32),
             jnp.zeros((*rows, head_dim), jnp.float32))
    seen_pages = -(-last // page_size)
    walk = lambda lo, hi, start, pages, c, masked=True: jax.lax.fori_loop(  # noqa: E731
        lo, hi, lambda i, c: piece(start + i * pages, pages, c, masked), c)
    if decode:  # each size's pieces from where the larger ones stopped
        start, width = 0, block_tables.shape[1]
        for size in walk_sizes(pages_per_block, width, batch):
            rest = jnp.maximum(seen_pages - start, 0)
            # one piece more when it reads at most a quarter of itself past the end: a
            # few unseen pages cost less than the smaller pieces that would cover them
            n = rest // size + (rest % size >= size - max(size // 4, 1)) * (size > 1)
            n = jnp.minimum(n, (width - start) // size)  # inside the table
            carry = walk(jnp.maximum(first_page - start, 0) // size, n, start, size, carry)
            start = start + n * size
    else:
        quarter = quarter_block(pages_per_block)
        # Quarters before the lowest query are seen whole by every query: they go
        # unmasked (no mask to build and apply), two at a time where they can (larger
        # products): a chunk's attention 10-15% faster at positions 1,024-7,680,
        # measured. Only the quarters the diagonal crosses are masked. Padding queries
        # see what they please in the unmasked ones and are zeroed below.
        pair, full = min(2 * quarter, block_tables.shape[1]) // quarter, 0
        if sliding_window is None:
            lowest = jnp.min(jnp.where(valid, q_positions, jnp.iinfo(jnp.int32).max))
            full = jnp.maximum(jnp.minimum(lowest + 1, jnp.min(lengths)), 0) // (
                quarter * page_size)
        carry = walk(0, full // pair, 0, pair * quarter, carry, masked=False)
        carry = walk(full // pair * pair, full, 0, quarter, carry, masked=False)
        carry = walk(jnp.maximum(full, first_page // quarter), -(-seen_pages // quarter),
                     0, quarter, carry)
    _, total, acc = carry
    out = acc / jnp.maximum(total, jnp.finfo(jnp.float32).tiny)[..., None]
    if decode:
        return out.reshape(batch, 1, num_heads, head_dim).astype(out_dtype)
    out = jnp.where(valid[:, None, None, :, None], out, 0.0)
    return out.transpose(0, 3, 1, 2, 4).reshape(q.shape).astype(out_dtype)
