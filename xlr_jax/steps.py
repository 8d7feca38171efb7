"""Jitted prefill and decode steps over the paged KV (donated), with shape buckets.

Every array a step sees has a bucketed shape: batch rows, chunk length and
block-table width are rounded up to the plan's buckets, so each step compiles
at most once per bucket combination.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from xlr_jax.config import ModelConfig
from xlr_jax.model import Params, forward, lm_head
from xlr_jax.paged_kv import PagedKV
from xlr_jax.sampling import SAMPLERS, SamplingBatch, sample


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
             sampler: str):
    """Append chunk `tokens` [B, T] after `start` [B]; sample after each row's last token."""
    batch, chunk = tokens.shape
    offs = jnp.arange(chunk, dtype=jnp.int32)
    positions = start[:, None] + offs
    valid = offs < num_new[:, None]
    hidden, kv = forward(params, kv, tokens, positions, valid, block_tables,
                         config=config, attn_impl=attn_impl)
    last = hidden[jnp.arange(batch), jnp.maximum(num_new - 1, 0)]
    logits = lm_head(params, last)
    return sample(logits, sampling, sampler=sampler), logits, kv


def _decode(params: Params, kv: PagedKV, tokens, positions, block_tables,
            sampling: SamplingBatch, *, config: ModelConfig, attn_impl: str,
            sampler: str):
    """Append one token per row at `positions` [B]; sample the next."""
    hidden, kv = forward(params, kv, tokens[:, None], positions[:, None],
                         jnp.ones_like(tokens, bool)[:, None], block_tables,
                         config=config, attn_impl=attn_impl)
    logits = lm_head(params, hidden[:, 0])
    return sample(logits, sampling, sampler=sampler), logits, kv


def _all_logits(params: Params, kv: PagedKV, tokens, start, num_new, block_tables, *,
                config: ModelConfig, attn_impl: str):
    """Prefill a chunk and return logits at every position [B, T, V] (for scoring/tests)."""
    offs = jnp.arange(tokens.shape[1], dtype=jnp.int32)
    hidden, kv = forward(params, kv, tokens, start[:, None] + offs,
                         offs < num_new[:, None], block_tables,
                         config=config, attn_impl=attn_impl)
    return lm_head(params, hidden), kv


class Steps:
    """The jitted step functions of one model; KV is donated to every call.

    `warmup` compiles every bucket ahead of time (`jit(...).lower(...).compile()`);
    a call whose shapes were warmed runs the stored executable, so serving
    compiles nothing.
    """

    def __init__(self, config: ModelConfig, attn_impl: str = "auto",
                 compiler_options: dict | None = None):
        self.config, self.attn_impl = config, attn_impl
        self.compiler_options = compiler_options or {}
        # config bound per instance: jit caches are per function object, so each Steps
        # counts (and owns) only its own compilations
        fixed = dict(config=config, attn_impl=attn_impl)
        jit = partial(jax.jit, donate_argnames="kv", compiler_options=compiler_options or None)
        self._prefill = jit(partial(_prefill, **fixed), static_argnames="sampler")
        self._decode = jit(partial(_decode, **fixed), static_argnames="sampler")
        self._all_logits = jit(partial(_all_logits, **fixed))
        self._aot: dict[tuple, jax.stages.Compiled] = {}

    def prefill(self, params, kv, tokens, start, num_new, block_tables, sampling, sampler):
        args = (params, kv, tokens, start, num_new, block_tables, sampling)
        exe = self._aot.get(("prefill", tokens.shape, block_tables.shape[1], sampler))
        return exe(*args) if exe else self._prefill(*args, sampler=sampler)

    def decode(self, params, kv, tokens, positions, block_tables, sampling, sampler):
        args = (params, kv, tokens, positions, block_tables, sampling)
        exe = self._aot.get(("decode", tokens.shape, block_tables.shape[1], sampler))
        return exe(*args) if exe else self._decode(*args, sampler=sampler)

    def all_logits(self, params, kv, tokens, start, num_new, block_tables):
        return self._all_logits(params, kv, tokens, start, num_new, block_tables)

    def warmup(self, params, kv, buckets: Buckets, progress: bool = True) -> list[dict]:
        """Compile prefill and decode for every bucket combination and sampler (see
        sampling.SAMPLERS); returns each compile's shapes and seconds."""
        jobs = [("decode", (rows,), width, sampler)
                for rows in buckets.batch for width in buckets.pages for sampler in SAMPLERS]
        jobs += [("prefill", (rows, chunk), width, sampler)
                 for rows in buckets.batch for chunk in buckets.chunk
                 for width in buckets.pages for sampler in SAMPLERS]
        report = []
        for kind, shape, width, sampler in tqdm(jobs, desc="Compiling buckets", unit="step",
                                                disable=not progress or None, leave=False):
            key = (kind, shape, width, sampler)
            if key in self._aot:
                continue
            rows = shape[0]
            ints = lambda *s: np.zeros(s, np.int32)  # noqa: E731
            sampling = SamplingBatch.build([], [], rows)
            start = time.perf_counter()
            if kind == "decode":
                lowered = self._decode.lower(params, kv, ints(rows), ints(rows), ints(rows, width),
                                             sampling, sampler=sampler)
            else:
                lowered = self._prefill.lower(params, kv, ints(*shape), ints(rows), ints(rows),
                                              ints(rows, width), sampling, sampler=sampler)
            self._aot[key] = lowered.compile()
            report.append({"step": kind, "batch": rows, "chunk": shape[1] if len(shape) > 1
                           else 1, "pages": width, "sampler": sampler,
                           "compile_s": time.perf_counter() - start})
        return report

    def compilations(self) -> dict[str, int]:
        aot = {kind: sum(k[0] == kind for k in self._aot) for kind in ("prefill", "decode")}
        return {"prefill": self._prefill._cache_size() + aot["prefill"],
                "decode": self._decode._cache_size() + aot["decode"],
                "all_logits": self._all_logits._cache_size()}
