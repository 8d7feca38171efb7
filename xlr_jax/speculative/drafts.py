"""Draft proposals for speculative decoding that need no model.

`ngram_propose` is prompt lookup: find the latest earlier place where the last
n tokens occurred (longest n first) and propose what followed them there. Its
proposal probability is a point mass (q = 1 on each proposed token).
"""
from __future__ import annotations


def ngram_propose(tokens: list[int], gamma: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Up to `gamma` tokens that followed the latest earlier match of the last n tokens."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest match first
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + gamma]
    return []
