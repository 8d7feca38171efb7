"""The KV pages on the host: which are free, who holds which, and each sequence's table.

`PagePool` owns the free list and refcounts of the device pages (page 0, the scratch page,
is never handed out); a `SequencePages` is one sequence's block table (its page ids in
order) and length. Pages may be shared between sequences (refcount > 1); a shared page is
never written: before a sequence appends into a shared partial page, `reserve` gives it a
private copy (copy-on-write) and reports the (src, dst) copy for the device. Plain Python
and numpy, no jax: the scheduler's side of the KV (`xlr_jax.kv.manager`).
"""
from __future__ import annotations

from collections import deque

import numpy as np

from xlr_jax.errors import OutOfPagesError

SCRATCH_PAGE = 0


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` positions."""
    return -(-tokens // page_size)


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
        self.cache = None  # see attach_cache

    def attach_cache(self, cache) -> None:
        """Let `cache` (a PrefixCache over this pool) keep pages at refcount 0 and give
        them back when the free list runs short."""
        self.cache = cache

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

    def revive(self, page: int) -> None:
        """A cached page at refcount 0 taken again (the cache matched it)."""
        assert self.refcounts[page] == 0, f"page {page} is in use"
        self.refcounts[page] = 1

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
