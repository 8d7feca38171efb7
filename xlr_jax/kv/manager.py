"""The scheduler's only way to the KV pages: the pool, the prefix cache and the tier store.

Every question the scheduler asks of pages goes through `KVManager`, and every page
count is worked out here: what a request needs to be admitted and what a running one
is owed, whether the next step finds its pages, a sequence's pages reserved ahead
(copy-on-write of a shared partial page), a cached prefix matched and a stable tier
restored from disk, what a finished request publishes. It is plain Python over the
host-side pool: what must happen to the device pages (copies, a tier written in or
read out) is queued as page operations (`take_ops`), which the model runner applies
before the next step reads the pages.

Budgets: a plain request grows on need (admitted for its prompt plus one token's page,
then a page as it decodes; when the pool runs short the scheduler preempts); a
speculating request, or one preempted too often ("protected"), is budgeted its worst
case, prompt plus max_tokens, up front. What running requests are owed is never
taken by a newcomer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from xlr_jax.errors import PromptTooLongError
from xlr_jax.kv.pages import PagePool, SequencePages, pages_for
from xlr_jax.kv.prefix_cache import PrefixCache, tier_counts
from xlr_jax.kv.tier_store import TierStore
from xlr_jax.planning.buckets import pick_bucket


@dataclass
class PageCopy:
    """Copy pages src[i] -> dst[i] (a shared partial page a sequence is about to write)."""
    src: list[int]
    dst: list[int]


@dataclass
class PageWrite:
    """Write host arrays (every KV leaf's pages, {"k": [layers, n, ...], ...}) into
    `pages` (a stable tier restored from disk)."""
    pages: list[int]
    arrays: dict


@dataclass
class PageRead:
    """Read `pages` out of the device (dispatched, not waited for) and hand them to
    `deliver(arrays, compile_restore)`; `compile_restore()` compiles, for a later
    process, what restoring that many pages runs."""
    pages: list[int]
    deliver: Callable[[dict, Callable[[], None]], None]


PageOp = PageCopy | PageWrite | PageRead


class KVManager:
    """The page pool with its prefix cache and tier store, and the page arithmetic of
    admission, growth, preemption and publishing (see the module docstring).

    `kv_layout`: each KV leaf's (dtype, shape) with the page axis second, as the device
    pool has it: what a stable tier read from disk must match."""

    def __init__(self, num_pages: int, page_size: int, kv_layout: dict, *,
                 prefix_cache: bool = True, namespace: str = "", max_pinned_share: float = 1.0,
                 tier_store: TierStore | None = None):
        self.pool = PagePool(num_pages, page_size)
        # full prompt pages shared across requests; the namespace keeps models apart
        self.cache = (PrefixCache(self.pool, namespace, max_pinned_share)
                      if prefix_cache else None)
        self.tier_store = tier_store if prefix_cache else None  # stable tiers on disk
        self.kv_layout = kv_layout
        self._persisted: set[tuple] = set()
        self._ops: list[PageOp] = []

    # ------------------------------------------------------------ sizes

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def usable(self) -> int:
        """Pages requests may hold (every page but the scratch one)."""
        return self.pool.num_pages - 1

    @property
    def available(self) -> int:
        """Pages free or cached and evictable."""
        return self.pool.num_available

    def pages_for(self, tokens: int) -> int:
        return pages_for(tokens, self.page_size)

    def new_sequence(self) -> SequencePages:
        return SequencePages(self.pool)

    def max_pages(self, req) -> int:
        """Pages a request may ever hold: its prompt plus every token it may generate."""
        return self.pages_for(len(req.prompt_ids) + req.limit)

    def check_fits(self, req) -> None:
        """Refuse a request the pool can never hold: its prompt and first token, or for a
        speculating request (budgeted every page up front) its prompt plus max_tokens."""
        if req.spec is not None and self.max_pages(req) > self.usable:
            raise PromptTooLongError(
                f"{len(req.prompt_ids)} prompt tokens plus up to {req.limit} new ones need "
                f"{self.max_pages(req)} KV pages but the pool has {self.usable}; lower "
                "max_tokens or load the model with more num_pages")
        if self.pages_for(len(req.prompt_ids) + 1) > self.usable:
            raise PromptTooLongError(
                f"the prompt's {len(req.prompt_ids)} tokens need more KV pages than the "
                f"pool's {self.usable}; shorten it or load the model with more num_pages")

    # ------------------------------------------------------------ budgets

    @staticmethod
    def grows_on_need(req) -> bool:
        """Whether the request takes pages as it decodes (else its worst case up front)."""
        return req.spec is None and not req.protected

    def need(self, req) -> int:
        """The pages a request must be able to hold when it is admitted."""
        if self.grows_on_need(req):
            return self.pages_for(req.context_len + 1)
        return min(self.max_pages(req), self.usable)

    def owed(self, req) -> int:
        """Pages a running request may still take that no newcomer may use (an SMC
        request: what one particle needs to finish)."""
        if self.grows_on_need(req):
            return 1  # its next token's page
        held = len(req.seq.pages) if req.smc is None else req.smc.most_pages()
        return max(0, min(self.max_pages(req), self.usable) - held)

    def owed_to(self, reqs) -> int:
        return sum(self.owed(r) for r in reqs)

    def room_for_a_step(self, running) -> bool:
        """Whether every running plain request finds its next step's pages (a decode
        token's, or, with forced tokens, what its context has grown to) beside what the
        speculating ones are owed."""
        need = sum(r.seq.pages_to_reserve(max(r.seq.length + 1, r.context_len))
                   for r in running if r.spec is None)
        owed = self.owed_to(r for r in running if r.spec is not None)
        return need <= self.available - owed

    # ------------------------------------------------------------ pages of a sequence

    def reserve(self, seq: SequencePages, length: int) -> None:
        """Pages for positions [seq.length, length); the copy of a shared partial page
        is queued for the device."""
        copies = seq.reserve(length)
        if copies:
            src, dst = zip(*copies)
            self._ops.append(PageCopy(list(src), list(dst)))

    def block_tables(self, seqs, rows: int, widths: tuple[int, ...]) -> np.ndarray:
        """Block tables [rows, width] of `seqs` (padding rows: the scratch page), the
        width the smallest of `widths` that holds the longest."""
        width = pick_bucket(max(len(s.pages) for s in seqs), widths)
        tables = np.zeros((rows, width), np.int32)
        for i, seq in enumerate(seqs):
            tables[i] = seq.block_table(width)
        return tables

    def release(self, req) -> None:
        """Give back every page a request holds: its own, or its SMC particles'."""
        req.seq.release()
        if req.smc is not None:
            req.smc.release()

    def check(self, running) -> None:
        """The pool's invariants against the sequences `running` holds pages by (an SMC
        request's: its particles'), a debug check."""
        self.pool.check([s for r in running for s in
                         ([p.seq for p in r.smc.particles] if r.smc is not None else [r.seq])])

    # ------------------------------------------------------------ admission

    def admit(self, req, owed: int) -> bool:
        """Take the request's pages if its need fits beside the `owed` ones: the longest
        cached run of its prompt (its stable tier pinned, restored from disk if an earlier
        process saved it), then the rest of its context reserved. False, with nothing
        taken, if it does not fit."""
        if not self._take_cached_prefix(req, owed, self.need(req)):
            return False
        self.reserve(req.seq, req.context_len)
        return True

    def free_pinned(self) -> bool:
        """Unpin the least recently used stable tier (its idle pages become evictable);
        False if none is pinned."""
        return self.cache is not None and self.cache.unpin_lru()

    def tier_in_flight(self, req, running) -> bool:
        """Whether a running request is still prefilling `req`'s stable tier (agents
        starting together on one system prompt): `req` then waits until that tier is
        published (at its end) and shares it. Prefill runs one request at a time, so
        waiting costs `req` nothing."""
        n = req.stable_end
        return self.cache is not None and n > 0 and any(
            r.prefilled < r.stable_end == n and r.prompt_ids[:n] == req.prompt_ids[:n]
            for r in running)

    def _take_cached_prefix(self, req, owed: int, need: int) -> bool:
        """Share the longest cached run of the prompt's pages (at least one token is left
        to prefill: its logits give the first sampled token), pinning the stable tier and
        restoring it from disk, if the request's `need` of pages then fits beside the
        `owed` ones. Otherwise undo all of it (pinning takes cached pages out of the
        evictable LRU) and return False."""
        cache = self.cache
        stable = req.prompt_ids[:req.stable_end] if cache is not None else []
        pinned_here = bool(stable) and tuple(stable) not in cache.registered()
        if stable:  # registers it, or marks it the most recently used
            cache.register_stable(stable)
        if stable and self.tier_store and \
                cache.match(stable, len(stable), take=False)[1] < len(stable):
            self._restore_tier(stable, owed)
        if cache is not None:
            ids = req.context_ids
            req.seq.pages, req.seq.length = cache.match(ids, len(ids) - 1)
        shared_tail = bool(req.seq.length % self.page_size)  # copied on write
        if need - len(req.seq.pages) + shared_tail <= self.available - owed:
            if not req.generated:  # a resumed request keeps its first admission's count
                req.cached_tokens = req.seq.length
            return True
        req.seq.release()
        if pinned_here:  # its pages (restored ones too) become evictable again
            cache.unregister_stable(stable)
        return False

    # ------------------------------------------------------------ stable tiers on disk

    def _restore_tier(self, stable: list[int], owed: int) -> None:
        """Load a stable tier's pages saved by an earlier process into the pool (pinned),
        if they fit beside the `owed` pages."""
        n = self.pages_for(len(stable))
        if n > self.available - owed:
            return
        expect = {name: (dtype, (shape[0], n, *shape[2:]))
                  for name, (dtype, shape) in self.kv_layout.items()}
        arrays = self.tier_store.load(stable, expect)
        if arrays is None:
            return
        pages = self.pool.allocate(n)
        self._ops.append(PageWrite(pages, arrays))
        self.cache.publish(stable, pages, partial_at=len(stable))
        self.pool.decref(pages)  # cached and pinned: the tier is registered
        self._persisted.add(tuple(stable))

    def persist_tier(self, req) -> None:
        """Snapshot a freshly prefilled stable tier to disk, off the decode loop's path:
        its pages are read out by the runner and written by the tier store's thread,
        which then compiles what a later process restoring it runs."""
        stable = tuple(req.prompt_ids[:req.stable_end])
        if not self.tier_store or not stable or stable in self._persisted:
            return
        self._persisted.add(stable)
        pages = req.seq.pages[:self.pages_for(len(stable))]
        store = self.tier_store
        self._ops.append(PageRead(pages, lambda arrays, compile_restore:
                                  store.save_async(stable, arrays, then=compile_restore)))

    def flush(self) -> None:
        """Wait for the tier snapshots being written."""
        if self.tier_store:
            self.tier_store.flush()

    # ------------------------------------------------------------ publishing

    def publish(self, req, finished: bool) -> None:
        """Index what the request has written: its prompt once prefilled (with the stable
        tier's partial last page when the prompt runs past that page), and at the end
        every page of prompt + generated tokens, the last one partial."""
        cache = self.cache
        if cache is None:
            return
        ps = self.page_size
        if not finished:  # the prompt as far as it is written
            boundary = req.stable_end if req.stable_end and (
                len(req.prompt_ids) >= self.pages_for(req.stable_end) * ps) else None
            cache.publish(req.prompt_ids[:req.prefilled], req.seq.pages, partial_at=boundary)
            return
        # the last token was never fed; a request ended mid-prefill wrote less. Its last,
        # partial page too: the next turn of a conversation starts with all of it
        written = (req.prompt_ids + req.generated[:-1])[:req.seq.length]
        cache.publish(written, req.seq.pages, partial_at=len(written))
        # tight (few pages free or evictable, not only few free: a warm pool is full of
        # cached pages): keep volatile pages out
        if self.available < self.pool.num_pages // 4:
            cache.forget(req.seq.pages[max(req.context_end, req.stable_end) // ps + 1:])

    def count(self, req) -> None:
        """The request's prompt tokens and cache hits per tier, in its metrics and the
        cache's totals."""
        bounds = (req.stable_end, max(req.context_end, req.stable_end), len(req.prompt_ids))
        req.cache_metrics = tier_counts(bounds, req.cached_tokens)
        if self.cache is not None:
            self.cache.record(req.cache_metrics)

    # ------------------------------------------------------------ device work and stats

    def take_ops(self) -> list[PageOp]:
        """The page operations queued since the last call, in order: the runner applies
        them before anything reads those pages."""
        ops, self._ops = self._ops, []
        return ops

    def stats(self) -> dict:
        """KV pages (usable, free, held by requests, cached at refcount 0, pinned by stable
        tiers) and the prefix cache's counters."""
        pool, cache = self.pool, self.cache
        held = int((pool.refcounts[1:] > 0).sum())
        return {"pages_total": self.usable, "pages_free": pool.num_free, "pages_held": held,
                "pages_cached": self.usable - pool.num_free - held,
                "pages_pinned": cache.pinned_pages if cache else 0,
                "prefix_cache": cache.stats() if cache else None}
