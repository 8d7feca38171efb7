"""Jitted prefill and decode steps over the paged KV (donated), with shape buckets.

Every array a step sees has a bucketed shape: batch rows, chunk length and
block-table width are rounded up to the plan's buckets, so each step compiles
at most once per bucket combination.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from xlr_jax.config import ModelConfig
from xlr_jax.model import Params, forward, lm_head
from xlr_jax.paged_kv import PagedKV
from xlr_jax.sampling import SamplingBatch, sample


def pick_bucket(n: int, sizes: tuple[int, ...]) -> int:
    """The smallest bucket >= n (sizes sorted ascending)."""
    i = bisect.bisect_left(sizes, n)
    if i == len(sizes):
        raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}")
    return sizes[i]


@dataclass(frozen=True)
class Buckets:
    batch: tuple[int, ...]
    chunk: tuple[int, ...]   # prefill chunk lengths; the last is the chunk size
    pages: tuple[int, ...]   # block-table widths


def _prefill(params: Params, kv: PagedKV, tokens, start, num_new, block_tables,
             sampling: SamplingBatch, *, config: ModelConfig, attn_impl: str,
             greedy_only: bool):
    """Append chunk `tokens` [B, T] after `start` [B]; sample after each row's last token."""
    batch, chunk = tokens.shape
    offs = jnp.arange(chunk, dtype=jnp.int32)
    positions = start[:, None] + offs
    valid = offs < num_new[:, None]
    hidden, kv = forward(params, kv, tokens, positions, valid, block_tables,
                         config=config, attn_impl=attn_impl)
    last = hidden[jnp.arange(batch), jnp.maximum(num_new - 1, 0)]
    logits = lm_head(params, last)
    return sample(logits, sampling, greedy_only=greedy_only), logits, kv


def _decode(params: Params, kv: PagedKV, tokens, positions, block_tables,
            sampling: SamplingBatch, *, config: ModelConfig, attn_impl: str,
            greedy_only: bool):
    """Append one token per row at `positions` [B]; sample the next."""
    hidden, kv = forward(params, kv, tokens[:, None], positions[:, None],
                         jnp.ones_like(tokens, bool)[:, None], block_tables,
                         config=config, attn_impl=attn_impl)
    logits = lm_head(params, hidden[:, 0])
    return sample(logits, sampling, greedy_only=greedy_only), logits, kv


def _all_logits(params: Params, kv: PagedKV, tokens, start, num_new, block_tables, *,
                config: ModelConfig, attn_impl: str):
    """Prefill a chunk and return logits at every position [B, T, V] (for scoring/tests)."""
    offs = jnp.arange(tokens.shape[1], dtype=jnp.int32)
    hidden, kv = forward(params, kv, tokens, start[:, None] + offs,
                         offs < num_new[:, None], block_tables,
                         config=config, attn_impl=attn_impl)
    return lm_head(params, hidden), kv


class Steps:
    """The jitted step functions of one model; KV is donated to every call."""

    def __init__(self, config: ModelConfig, attn_impl: str = "auto"):
        static = ("config", "attn_impl", "greedy_only")
        self.config, self.attn_impl = config, attn_impl
        self._prefill = jax.jit(_prefill, donate_argnames="kv", static_argnames=static)
        self._decode = jax.jit(_decode, donate_argnames="kv", static_argnames=static)
        self._all_logits = jax.jit(_all_logits, donate_argnames="kv",
                                   static_argnames=static[:2])

    def prefill(self, params, kv, tokens, start, num_new, block_tables, sampling, greedy_only):
        return self._prefill(params, kv, tokens, start, num_new, block_tables, sampling,
                             config=self.config, attn_impl=self.attn_impl,
                             greedy_only=greedy_only)

    def decode(self, params, kv, tokens, positions, block_tables, sampling, greedy_only):
        return self._decode(params, kv, tokens, positions, block_tables, sampling,
                            config=self.config, attn_impl=self.attn_impl,
                            greedy_only=greedy_only)

    def all_logits(self, params, kv, tokens, start, num_new, block_tables):
        return self._all_logits(params, kv, tokens, start, num_new, block_tables,
                                config=self.config, attn_impl=self.attn_impl)

    def compilations(self) -> dict[str, int]:
        return {"prefill": self._prefill._cache_size(), "decode": self._decode._cache_size(),
                "all_logits": self._all_logits._cache_size()}
