"""Jitted prefill and decode steps over the paged KV (donated), with shape buckets.

Every array a step sees has a bucketed shape: batch rows, chunk length and
block-table width are rounded up to the plan's buckets, so each step compiles
at most once per bucket combination. Prefill and decode run ahead-of-time
executables, one per shape, which an `ExecutableStore` keeps across processes.
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
from xlr_jax.executables import ExecutableStore, compile_fresh
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

    Prefill and decode compile once per shape ahead of time (`jit(...).lower(...)
    .compile()`) and keep the executable; `warmup` does so for every bucket, so
    serving compiles nothing. With a store (`use_store`), executables are saved to
    disk and the next process loads them instead of tracing and compiling.
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
        # (step, token shape, table width, sampler) -> executable
        self._aot: dict[tuple, jax.stages.Compiled] = {}
        self.store: ExecutableStore | None = None

    def use_store(self, store: ExecutableStore, params, kv: PagedKV) -> tuple[PagedKV, int]:
        """Keep executables in `store` (it must be keyed for these steps, params and KV;
        see executables), and take what it preloaded: each runs once on the scratch page,
        since an XLA:CPU executable builds its YNNPACK pipelines on its first run
        (0.1-0.6 s). Returns the KV (donated to those runs) and how many were taken."""
        self.store = store
        taken = 0
        for key, exe in store.take_preloaded():
            if key not in self._aot:
                self._aot[key] = exe
                *_, kv = exe(params, kv, *self._scratch_args(key))
                taken += 1
        return jax.block_until_ready(kv), taken

    def prefill(self, params, kv, tokens, start, num_new, block_tables, sampling, sampler):
        key = ("prefill", tokens.shape, block_tables.shape[1], sampler)
        return self._executable(key, params, kv)(params, kv, tokens, start, num_new,
                                                 block_tables, sampling)

    def decode(self, params, kv, tokens, positions, block_tables, sampling, sampler):
        key = ("decode", tokens.shape, block_tables.shape[1], sampler)
        return self._executable(key, params, kv)(params, kv, tokens, positions,
                                                 block_tables, sampling)

    def _executable(self, key: tuple, params, kv, use: bool = True) -> jax.stages.Compiled:
        """The executable for `key`: kept, loaded from the store, or compiled (and stored).
        `use` records it as needed by this process (a warmup's are not)."""
        exe = self._aot.get(key)
        if exe is None:
            exe = self.store.load(key) if self.store else None
            if exe is None:
                lowered = self._lower(key, params, kv)
                exe = compile_fresh(lowered) if self.store else lowered.compile()
                if self.store:
                    self.store.save(key, exe)
            self._aot[key] = exe
        if use and self.store:
            self.store.note_use(key)
        return exe

    @staticmethod
    def _scratch_args(key: tuple) -> tuple:
        """The arguments after (params, kv) of the step `key` names, touching only the
        scratch page: zero tokens, positions and block tables, no valid prefill token."""
        kind, shape, width, _ = key
        rows = shape[0]
        ints = lambda *s: np.zeros(s, np.int32)  # noqa: E731
        sampling = SamplingBatch.build([], [], rows)
        if kind == "decode":
            return ints(rows), ints(rows), ints(rows, width), sampling
        return ints(*shape), ints(rows), ints(rows), ints(rows, width), sampling

    def _lower(self, key: tuple, params, kv) -> jax.stages.Lowered:
        step = self._decode if key[0] == "decode" else self._prefill
        return step.lower(params, kv, *self._scratch_args(key), sampler=key[3])

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
            start = time.perf_counter()
            self._executable(key, params, kv, use=False)
            report.append({"step": kind, "batch": shape[0], "chunk": shape[1] if len(shape) > 1
                           else 1, "pages": width, "sampler": sampler,
                           "compile_s": time.perf_counter() - start})
        return report

    def compilations(self) -> dict[str, int]:
        aot = {kind: sum(k[0] == kind for k in self._aot) for kind in ("prefill", "decode")}
        return {**aot, "all_logits": self._all_logits._cache_size()}
