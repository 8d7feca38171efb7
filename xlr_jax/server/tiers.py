"""Where a chat request's stable tier ends, so an agent's repeated system prompt stays
pinned in the prefix cache while the part of it that changes does not.

`Model.encode` makes the system messages and the tools the stable tier. An agent's
system message often ends in a line that changes between requests (hermes-agent's
date and session id), which would make every request a new stable tier. Two ways
to find the real end:

- The client marks it: a content part of a system (or developer) message carrying
  `cache_control` (as Anthropic-style clients send) ends the stable tier after
  that part (`marked_messages`, then the tokens it renders to).
- Otherwise `RecentHeads` compares the request's system part with those of recent
  requests: when one shares at least a page with it but not all of it, the stable
  tier is cut to the shared prefix, in whole pages, and the rest counts as context.
  The first request of a kind, and one whose system part repeats a recent one
  whole (the later turns of one agent session), keep their whole system part stable.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

from xlr_jax.loading.prompts import shared_prefix

SYSTEM_ROLES = ("system", "developer")


def marked_messages(messages) -> list | None:
    """The conversation cut after the last `cache_control` part of its leading system
    messages (that message's later parts dropped), or None when nothing is marked.
    `messages` are protocol.ChatMessage."""
    cut = None
    for i, m in enumerate(messages):
        if m.role not in SYSTEM_ROLES:
            break
        if isinstance(m.content, list):
            marks = [j for j, part in enumerate(m.content)
                     if (part.model_extra or {}).get("cache_control") is not None]
            if marks:
                cut = (i, marks[-1])
    if cut is None:
        return None
    i, j = cut
    return [*messages[:i], messages[i].model_copy(update={"content": messages[i].content[:j + 1]})]


class RecentHeads:
    """The system parts (token ids) of the last `keep` distinct requests; thread-safe."""

    def __init__(self, page_size: int, keep: int = 32):
        self.page_size, self.keep = page_size, keep
        self._heads: OrderedDict[tuple, None] = OrderedDict()
        self._lock = threading.Lock()

    def cut(self, ids: list[int], tiers: tuple[int, int]) -> tuple[int, int]:
        """`tiers` (stable end, context end), the stable end cut to the longest prefix,
        in whole pages, that the system part `ids[:stable end]` shares with a recent
        request's, when that is at least a page and the part is not itself a recent
        one; the part is remembered either way."""
        stable, context = tiers
        if not stable:
            return tiers
        head = tuple(ids[:stable])
        with self._lock:
            seen = head in self._heads  # it repeats whole: all of it stays stable
            shared = 0 if seen else max((shared_prefix(head, h) for h in self._heads),
                                        default=0)
            self._heads.pop(head, None)
            self._heads[head] = None
            while len(self._heads) > self.keep:
                self._heads.popitem(last=False)
        pages = shared - shared % self.page_size
        if seen or pages < self.page_size:
            return tiers
        return pages, max(context, pages)
