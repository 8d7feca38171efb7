"""The paged KV cache: a device pytree of pages plus the host-side page pool.

Device layout: `PagedKV.k` and `PagedKV.v` are
    [layers, num_pages, kv_heads, page_size, head_dim]
so one layer's slice is the (k_pages, v_pages) pair that
`xlr_jax.ops.paged_attention` reads. Page-major: each page (all its KV heads)
is one contiguous block, so gathering a sequence's pages is a row copy (on
XLA:CPU ~3.5x cheaper than gathering per head from a head-major pool).

Quantized KV: with an int8 or fp8 page dtype, `k_scale`/`v_scale`
[layers, num_pages, kv_heads, page_size] hold one f32 scale per token and head
(stored value * scale = K/V); `write_layer` quantizes, the attention dequantizes.

Page 0 is a scratch page: it is never handed out, padded batch rows and padded
chunk positions write into it, and block tables are padded with it.

Host side: `PagePool` owns the free list and refcounts; a `SequencePages` is one
sequence's block table (its page ids in order) and length. Pages may be shared
between sequences (refcount > 1); a shared page is never written: before a
sequence appends into a shared partial page, `SequencePages.reserve` gives it a
private copy (copy-on-write) and reports the (src, dst) copy for the device.
"""
from __future__ import annotations

from collections import deque

import jax
import jax.numpy as jnp
import numpy as np

from xlr_jax.errors import OutOfPagesError
from xlr_jax.pytree import pytree_dataclass

SCRATCH_PAGE = 0


# largest magnitude a quantized page dtype stores
QUANT_MAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


def is_quantized(dtype) -> bool:
    return jnp.dtype(dtype) in QUANT_MAX


def quantize_kv(values, dtype):
    """values [..., head_dim] -> (stored [..., head_dim] in `dtype`, f32 scales [...])."""
    values = values.astype(jnp.float32)
    amax = jnp.max(jnp.abs(values), axis=-1)
    scale = jnp.where(amax > 0, amax / QUANT_MAX[jnp.dtype(dtype)], 1.0)
    scaled = values / scale[..., None]
    if jnp.issubdtype(dtype, jnp.integer):
        scaled = jnp.round(scaled)
    return scaled.astype(dtype), scale


@pytree_dataclass
class PagedKV:
    k: jax.Array  # [layers, num_pages, kv_heads, page_size, head_dim]
    v: jax.Array
    k_scale: jax.Array | None = None  # [layers, num_pages, kv_heads, page_size], quantized only
    v_scale: jax.Array | None = None

    @classmethod
    def create(cls, *, num_layers, num_kv_heads, head_dim, num_pages, page_size,
               dtype=jnp.float32) -> "PagedKV":
        shape = (num_layers, num_pages, num_kv_heads, page_size, head_dim)
        # two separate buffers: the steps donate each leaf
        scales = ([jnp.ones(shape[:-1], jnp.float32) for _ in "kv"] if is_quantized(dtype)
                  else [None, None])
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), *scales)

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree_util.tree_leaves(self))


def write_layer(pages, scales, layer, page_ids, offsets, values):
    """Store `values` [n, kv_heads, head_dim] at (page_ids[n], offsets[n]) of one layer.

    Returns the new (pages, scales); `scales` is None for unquantized pages.
    """
    if scales is None:
        return pages.at[layer, page_ids, :, offsets].set(values.astype(pages.dtype)), None
    stored, scale = quantize_kv(values, pages.dtype)
    return (pages.at[layer, page_ids, :, offsets].set(stored),
            scales.at[layer, page_ids, :, offsets].set(scale))


def _copy_pages(kv: PagedKV, src, dst) -> PagedKV:
    return jax.tree.map(lambda a: a.at[:, dst].set(a[:, src]), kv)


copy_pages = jax.jit(_copy_pages, donate_argnums=0)


def read_pages(kv: PagedKV, ids) -> dict:
    """Every leaf's pages `ids` ({"k": [layers, n, ...], ...}); dispatched, not waited for."""
    ids = jnp.asarray(ids, jnp.int32)
    return {name: leaf[:, ids] for name, leaf in leaves(kv).items()}


def _write_pages(kv: PagedKV, ids, pages: dict) -> PagedKV:
    return kv.replace(**{name: getattr(kv, name).at[:, ids].set(pages[name])
                         for name in leaves(kv)})


write_pages = jax.jit(_write_pages, donate_argnums=0)


def restore_lowering(kv: PagedKV, num_pages: int):
    """A function lowering what restoring a `num_pages`-page tier into a pool shaped like
    `kv` runs: `write_pages`, and `copy_pages` of one page (a tier's partial last page
    is copied on write). Compiled beside the loop when a tier is saved, they go to JAX's
    persistent cache, so the process that restores the tier compiles neither (0.2 s of
    its first turn otherwise). Shapes are read now: `kv` may be donated before it runs."""
    # no shardings: the calls pass plain arrays, and JAX's cache key counts them
    pool = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), kv)
    pages = {name: jax.ShapeDtypeStruct((x.shape[0], num_pages, *x.shape[2:]), x.dtype)
             for name, x in leaves(kv).items()}
    ids = lambda n: jax.ShapeDtypeStruct((n,), jnp.int32)  # noqa: E731
    return lambda: [write_pages.lower(pool, ids(num_pages), pages),
                    copy_pages.lower(pool, ids(1), ids(1))]


def leaves(kv: PagedKV) -> dict:
    """The pytree's arrays by name, quantization scales included when present."""
    names = ("k", "v", "k_scale", "v_scale")
    return {n: getattr(kv, n) for n in names if getattr(kv, n) is not None}


class PagePool:
    """Free list and refcounts of the device pages (page 0 is reserved).

    With a prefix cache attached (`cache`), a page whose refcount drops to 0
    stays cached if the cache indexes it, and `allocate` evicts cached pages
    (least recently used, never pinned ones) when the free list runs short.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError("a page pool needs at least 2 pages (page 0 is scratch)")
        self.num_pages = num_pages
        self.page_size = page_size
        self.refcounts = np.zeros(num_pages, np.int32)
        self._free = deque(range(1, num_pages))
        self.cache = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_available(self) -> int:
        """Free pages plus cached ones that may be evicted."""
        return len(self._free) + (self.cache.evictable if self.cache else 0)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free) and self.cache:
            self.cache.evict(n - len(self._free))
        if n > len(self._free):
            raise OutOfPagesError(
                f"need {n} KV pages but only {len(self._free)} of {self.num_pages - 1} "
                "are free; shorten the prompt or max_tokens, lower the batch, or "
                "load the model with more KV pages (num_pages=...)")
        pages = [self._free.popleft() for _ in range(n)]
        self.refcounts[pages] = 1
        return pages

    def incref(self, pages) -> None:
        for p in pages:
            assert self.refcounts[p] > 0, f"page {p} is not allocated"
            self.refcounts[p] += 1

    def decref(self, pages) -> None:
        for p in pages:
            assert self.refcounts[p] > 0, f"page {p} freed twice"
            self.refcounts[p] -= 1
            if self.refcounts[p] == 0 and not (self.cache and self.cache.retain(p)):
                self._free.append(p)

    def release_to_free(self, page: int) -> None:
        """A cached page at refcount 0 the cache lets go of."""
        assert self.refcounts[page] == 0, f"page {page} is in use"
        self._free.append(page)

    def check(self, sequences) -> None:
        """The pool's invariants (a debug check; tests turn it on): each page's refcount is
        the number of `sequences` holding it, and every page but the scratch one is
        exactly one of free, held, or cached at refcount 0."""
        held = np.zeros(self.num_pages, np.int32)
        for seq in sequences:
            np.add.at(held, np.asarray(seq.pages, np.int64), 1)
        assert (held[1:] == self.refcounts[1:]).all(), "a refcount differs from its holders"
        free = list(self._free)
        assert len(set(free)) == len(free) and 0 not in free, "the free list repeats a page"
        idle = {p for p in range(1, self.num_pages) if self.refcounts[p] == 0}
        cached = {p for p in idle if self.cache and self.cache.holds(p)}
        assert not set(free) & cached, "a free page is still cached"
        assert set(free) | cached == idle, "a page at refcount 0 is neither free nor cached"

    def is_shared(self, page: int) -> bool:
        """Writing the page would change what another reader sees: copy it first."""
        return self.refcounts[page] > 1 or bool(self.cache and self.cache.holds(page))


class SequencePages:
    """One sequence's block table and length over a `PagePool`."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        self.pages: list[int] = []
        self.length = 0

    def fork(self) -> "SequencePages":
        """A new sequence sharing every page of this one (refcounts bumped)."""
        child = SequencePages(self.pool)
        child.pages = list(self.pages)
        child.length = self.length
        self.pool.incref(child.pages)
        return child

    def pages_to_reserve(self, new_length: int) -> int:
        """Pages `reserve(new_length)` would allocate (new ones, and a copy of a shared
        partial last page)."""
        size = self.pool.page_size
        shared_tail = bool(self.length % size) and self.pool.is_shared(self.pages[-1])
        return max(0, -(-new_length // size) - len(self.pages)) + shared_tail

    def reserve(self, new_length: int) -> list[tuple[int, int]]:
        """Make room to write positions [length, new_length); returns COW copies (src, dst)."""
        size = self.pool.page_size
        shared_tail = bool(self.length % size) and self.pool.is_shared(self.pages[-1])
        fresh = self.pool.allocate(self.pages_to_reserve(new_length))  # all or nothing
        copies = []
        if shared_tail:
            copies.append((self.pages[-1], fresh[0]))
            self.pool.decref([self.pages[-1]])
            self.pages[-1] = fresh.pop(0)
        self.pages += fresh
        return copies

    def trim(self, length: int) -> None:
        """Keep positions [0, length) (drop rejected speculative tokens): pages past the
        new end go back to the pool; nothing is copied."""
        assert 0 <= length <= len(self.pages) * self.pool.page_size, "trim past the pages held"
        keep = -(-length // self.pool.page_size)
        self.pool.decref(self.pages[keep:])
        del self.pages[keep:]
        self.length = length

    def release(self) -> None:
        self.pool.decref(self.pages)
        self.pages, self.length = [], 0

    def block_table(self, width: int) -> np.ndarray:
        row = np.full(width, SCRATCH_PAGE, np.int32)
        row[:len(self.pages)] = self.pages
        return row
