"""The prefix cache: KV pages indexed by the tokens they hold, shared by refcount.

Keys form a hash chain: a page's key hashes its parent's key, the namespace
(model, dtype, page size) and the page's token ids, so equal keys mean equal
prefixes. Full pages are indexed as sequences finish their prompts; a
stable tier's last, partial page is indexed too (a sharer copies it before
writing: copy-on-write), so a tier that ends mid-page still hits in full, and
so is a finished sequence's last page, where its next turn starts.

The tokens a key names are never written again: a partial page is written past
them only by the sequence that wrote them (a stable tier is indexed as soon as
its prefill reaches the tier's end), and a sharer reads none of that. While
sequences use a page its refcount holds
it; at refcount 0 it stays cached in LRU order until the pool needs pages.
Pages of a registered stable tier are pinned: never evicted while the tier
is registered. Tiers are unpinned least recently used first when they would
pin more than half the pool, and when the engine runs short of pages.
"""
from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from dataclasses import dataclass

import numpy as np

from xlr_jax.kv.pages import pages_for

TIERS = ("stable", "context", "volatile")


def _key(parent: bytes, run) -> bytes:
    return hashlib.sha256(parent + b"|" + np.asarray(run, np.int64).tobytes()).digest()


def chain_keys(namespace: str, tokens, page_size: int) -> list[bytes]:
    """The key of each full page of `tokens`: hash of the parent's key and the page's ids."""
    keys, parent = [], namespace.encode()
    for start in range(0, len(tokens) - page_size + 1, page_size):
        parent = _key(parent, tokens[start:start + page_size])
        keys.append(parent)
    return keys


def partial_key(namespace: str, full_keys: list[bytes], tokens, end: int,
                page_size: int) -> tuple[bytes, bytes]:
    """(parent key, key) of the partial page holding tokens[end // page_size * ps : end]."""
    page = end // page_size
    parent = full_keys[page - 1] if page else namespace.encode()
    return parent, _key(parent, tokens[page * page_size:end])


def tier_counts(bounds: tuple[int, int, int], cached: int) -> dict:
    """Per-tier prompt tokens and tokens served from cache, for tier ends `bounds`
    (stable, context, prompt) and the `cached` leading tokens."""
    out, start = {}, 0
    for tier, end in zip(TIERS, bounds):
        out[f"{tier}_tokens"] = end - start
        out[f"{tier}_cached_tokens"] = max(0, min(cached, end) - start)
        start = end
    return out


@dataclass
class TierCount:
    tokens: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.tokens if self.tokens else None


class PrefixCache:
    def __init__(self, pool, namespace: str, max_pinned_share: float = 1.0):
        self.pool, self.namespace = pool, namespace
        self.page_size = pool.page_size
        self._page_of: dict[bytes, int] = {}
        self._keys_of: dict[int, list[bytes]] = {}  # a page may hold a full and a partial key
        # partial pages: parent key -> {key: tokens on the page}, and key -> parent key
        self._partials: dict[bytes, dict[bytes, int]] = {}
        self._partial_parent: dict[bytes, bytes] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # refcount-0 pages, oldest first
        self._pinned_keys: Counter[bytes] = Counter()
        # registered stable tiers (token tuples), least recently used first
        self._tiers: OrderedDict[tuple, None] = OrderedDict()
        # pins beyond this share of the pool unpin the least recently used tiers
        self.max_pinned_pages = int(max_pinned_share * (pool.num_pages - 1))
        self.tiers = {t: TierCount() for t in TIERS}
        self.requests = 0
        pool.attach_cache(self)

    # ---- lookups
    def match(self, tokens, limit: int, take: bool = True) -> tuple[list[int], int]:
        """Take (refcount +1) the longest cached run of `tokens`' pages covering at most
        `limit` tokens; returns (pages, tokens covered). The last page may be partial.
        `take=False` only looks."""
        pages, covered, parent = [], 0, self.namespace.encode()
        ps = self.page_size
        while covered + ps <= limit:
            key = _key(parent, tokens[covered:covered + ps])
            if key not in self._page_of:
                break
            pages.append(self._page_of[key])
            covered, parent = covered + ps, key
        best = None  # the longest partial page after the full ones
        for key, n in self._partials.get(parent, {}).items():
            if covered + n <= limit and n > (best[1] if best else 0) and \
                    key == _key(parent, tokens[covered:covered + n]):
                best = key, n
        if best:
            pages.append(self._page_of[best[0]])
            covered += best[1]
        for page in pages if take else ():
            if self.pool.refcounts[page] == 0:  # revived from the LRU
                self._lru.pop(page, None)
                self.pool.revive(page)
            else:
                self.pool.incref([page])
        return pages, covered

    def holds(self, page: int) -> bool:
        return page in self._keys_of

    # ---- publishing
    def publish(self, tokens, pages: list[int], partial_at: int | None = None) -> None:
        """Index the pages holding `tokens` (a sequence's written prefix): every full page,
        and the partial page ending at `partial_at` (a tier boundary, or where a finished
        sequence ends), if any."""
        keys = chain_keys(self.namespace, tokens, self.page_size)
        for key, page in zip(keys, pages):
            self._index(key, page)
        if partial_at and partial_at % self.page_size:
            parent, key = partial_key(self.namespace, keys, tokens, partial_at, self.page_size)
            if self._index(key, pages[partial_at // self.page_size]):
                self._partials.setdefault(parent, {})[key] = partial_at % self.page_size
                self._partial_parent[key] = parent

    def _index(self, key: bytes, page: int) -> bool:
        if key in self._page_of:
            return False  # already cached (maybe on another page): keep the first
        self._page_of[key] = page
        self._keys_of.setdefault(page, []).append(key)
        return True

    def _unindex(self, page: int) -> None:
        for key in self._keys_of.pop(page):
            del self._page_of[key]
            parent = self._partial_parent.pop(key, None)
            if parent is not None:
                siblings = self._partials[parent]
                del siblings[key]
                if not siblings:
                    del self._partials[parent]

    def _pinned(self, page: int) -> bool:
        return any(self._pinned_keys[k] for k in self._keys_of.get(page, ()))

    def retain(self, page: int) -> bool:
        """The pool asks before freeing a page at refcount 0: keep it cached if indexed."""
        if page not in self._keys_of:
            return False
        if not self._pinned(page):
            self._lru[page] = None
        return True

    def forget(self, pages) -> None:
        """Drop pages from the index (e.g. volatile pages under memory pressure); one
        cached at refcount 0 goes back to the free list."""
        for page in pages:
            if page in self._keys_of and not self._pinned(page):
                self._unindex(page)
                if self._lru.pop(page, 0) is None:
                    self.pool.release_to_free(page)

    # ---- eviction and pinning
    @property
    def evictable(self) -> int:
        return len(self._lru)

    def evict(self, n: int) -> int:
        """Free up to n unpinned refcount-0 pages, least recently used first."""
        freed = 0
        while freed < n and self._lru:
            page, _ = self._lru.popitem(last=False)
            self._unindex(page)
            self.pool.release_to_free(page)
            freed += 1
        return freed

    def register_stable(self, tokens) -> None:
        """Pin the stable tier `tokens`: its pages are never evicted until unregistered
        (by the caller, by `unpin_lru` under page pressure, or when newer tiers would pin
        more than `max_pinned_pages`: the least recently used go first)."""
        tokens = tuple(int(t) for t in tokens)
        if tokens in self._tiers:
            self.touch(tokens)
            return
        self._tiers[tokens] = None
        while self._tier_pages() > self.max_pinned_pages and self.unpin_lru(keep=tokens):
            pass
        for key in self._tier_keys(tokens):
            self._pinned_keys[key] += 1
            if key in self._page_of:
                self._lru.pop(self._page_of[key], None)

    def unregister_stable(self, tokens) -> None:
        """Unpin a stable tier: its pages become ordinary cached pages (LRU)."""
        tokens = tuple(int(t) for t in tokens)
        if tokens not in self._tiers:
            raise KeyError("this stable tier is not registered")
        del self._tiers[tokens]
        for key in self._tier_keys(tokens):
            self._pinned_keys[key] -= 1
            if not self._pinned_keys[key]:
                del self._pinned_keys[key]
            page = self._page_of.get(key)
            if page is not None and self.pool.refcounts[page] == 0 and not self._pinned(page):
                self._lru[page] = None

    def touch(self, tokens) -> None:
        """A request used this registered tier: it is the most recently used now."""
        self._tiers.move_to_end(tuple(tokens))

    def unpin_lru(self, keep: tuple | None = None) -> bool:
        """Unregister the least recently used tier (not `keep`); False if there is none."""
        lru = next((t for t in self._tiers if t != keep), None)
        if lru is not None:
            self.unregister_stable(lru)
        return lru is not None

    def _tier_pages(self) -> int:
        return sum(pages_for(len(t), self.page_size) for t in self._tiers)

    def registered(self) -> list[tuple]:
        """The registered stable tiers' token ids."""
        return list(self._tiers)

    def _tier_keys(self, tokens) -> list[bytes]:
        keys = chain_keys(self.namespace, tokens, self.page_size)
        if len(tokens) % self.page_size:
            keys.append(partial_key(self.namespace, keys, tokens, len(tokens), self.page_size)[1])
        return keys

    @property
    def pinned_pages(self) -> int:
        return sum(1 for page in self._keys_of if self._pinned(page))

    # ---- counters
    def record(self, counts: dict) -> None:
        """Add one request's `tier_counts` to the totals."""
        self.requests += 1
        for tier in TIERS:
            self.tiers[tier].tokens += counts[f"{tier}_tokens"]
            self.tiers[tier].hits += counts[f"{tier}_cached_tokens"]

    def stats(self) -> dict:
        return {
            "requests": self.requests,
            **{f"{t}_hit_rate": c.hit_rate for t, c in self.tiers.items()},
            **{f"{t}_tokens": c.tokens for t, c in self.tiers.items()},
            **{f"{t}_cached_tokens": c.hits for t, c in self.tiers.items()},
            "pages_pinned": self.pinned_pages, "pages_cached": len(self._keys_of),
            "pages_evictable": self.evictable, "pages_free": self.pool.num_free,
            "stable_tiers": len(self._tiers),
        }
