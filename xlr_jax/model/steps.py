"""The jitted ragged step over the paged KV (donated), with shape buckets.

Every step is one StepBatch (see step_batch): decode rows and at most one prefill
chunk, their counts rounded up to the plan's buckets, so the step compiles once per
(rows, chunk) pair: a few dozen executables, run ahead of time, which an
`ExecutableStore` keeps across processes.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from xlr_jax.kv.paged_kv import PagedKV
from xlr_jax.model.config import ModelConfig
from xlr_jax.model.decoder import Params, RowProducts, forward, forward_step, lm_head
from xlr_jax.model.executables import ExecutableStore, compile_fresh
from xlr_jax.model.sampling import row_logprobs, sample_rows
from xlr_jax.model.tensor_parallel import TensorParallel, place_array
from xlr_jax.ops import cpu_kernels
from xlr_jax.planning.buckets import Buckets, step_shape, step_shapes
from xlr_jax.model.step_batch import StepBatch, StepBuilder


def _step(params: Params, kv: PagedKV, batch: StepBatch, *, config: ModelConfig,
          attn_impl: str, pages_per_block: int, products: RowProducts,
          tp: TensorParallel | None):
    """One ragged step (see step_batch): a token per row, each row paying only for its
    own sampler; the rows' logits; and their log-probabilities where asked (see
    sampling.row_logprobs)."""
    hidden, kv = forward_step(params, kv, batch, config=config, attn_impl=attn_impl,
                              pages_per_block=pages_per_block, products=products, tp=tp)
    logits = lm_head(params, hidden, config, products, tp)
    tokens = sample_rows(logits + batch.bias, batch.sampling)
    return tokens, logits, row_logprobs(logits, tokens, batch.sampling), kv


@jax.jit
def _redraw(logits, tokens, bias, masked, sampling):
    """Rows `masked` [rows] drawn again from the step's logits plus `bias` (their logits
    processors' answer came after the step was dispatched), the others' tokens kept;
    with every row's log-probabilities, as the step gives them."""
    tokens = jnp.where(masked, sample_rows(logits + bias, sampling), tokens)
    return tokens, row_logprobs(logits, tokens, sampling)


def _all_logits(params: Params, kv: PagedKV, tokens, start, num_new, block_tables, *,
                config: ModelConfig, attn_impl: str, tp: TensorParallel | None):
    """Prefill a chunk and return logits at every position [B, T, V] (for scoring/tests)."""
    offs = jnp.arange(tokens.shape[1], dtype=jnp.int32)
    hidden, kv = forward(params, kv, tokens, start[:, None] + offs,
                         offs < num_new[:, None], block_tables,
                         config=config, attn_impl=attn_impl, tp=tp)
    return lm_head(params, hidden, config, tp=tp), kv


@lru_cache(maxsize=4)  # bounded, as speculative.cycle's `_jitted`
def _jitted_all_logits(config: ModelConfig, attn_impl: str, compiler_options: tuple,
                       tp: TensorParallel | None):
    """One jitted `_all_logits` for every model with this config, attention, compile
    options and mesh, so a second load in one process does not trace it again (see
    speculative.cycle's `_jitted`)."""
    return jax.jit(partial(_all_logits, config=config, attn_impl=attn_impl, tp=tp),
                   donate_argnames="kv", compiler_options=dict(compiler_options) or None)


class Steps:
    """The jitted step functions of one model; KV is donated to every call.

    The ragged step compiles once per (decode rows, chunk) bucket ahead of time
    (`jit(...).lower(...).compile()`) and keeps the executable; `warmup` does so for
    every bucket, so serving compiles nothing. With a store (`use_store`), executables
    are saved to disk and the next process loads them instead of tracing and compiling.
    `tp`: the params and KV split over a mesh (model.tensor_parallel).
    """

    def __init__(self, config: ModelConfig, buckets: Buckets, attn_impl: str = "auto",
                 compiler_options: dict | None = None, tp: TensorParallel | None = None):
        self.config, self.buckets, self.attn_impl, self.tp = config, buckets, attn_impl, tp
        self.compiler_options = compiler_options or {}
        if attn_impl == "cpu" or buckets.kernel_rows:  # registered before a stored
            cpu_kernels.build_error()  # executable that calls them runs
        # how weight products of a few rows run (the speculative cycle's run so too)
        self.products = RowProducts(buckets.reduce_rows, buckets.kernel_rows)
        # the step is lowered and compiled per instance, ahead of time (`_executable`)
        self._step = jax.jit(partial(_step, pages_per_block=buckets.attn_block,
                                     products=self.products, config=config,
                                     attn_impl=attn_impl, tp=tp),
                             donate_argnames="kv", compiler_options=compiler_options or None)
        self._all_logits = _jitted_all_logits(config, attn_impl,
                                              tuple(sorted(self.compiler_options.items())), tp)
        # ("step", decode rows, chunk) -> executable
        self._aot: dict[tuple, jax.stages.Compiled] = {}
        self._zeros: dict[int, jax.Array] = {}  # rows -> zero bias on the device
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
                *_, kv = exe(params, kv, self._scratch(key))
                taken += 1
        return jax.block_until_ready(kv), taken

    def step(self, params, kv, batch: StepBatch):
        """Run `batch`: sampled tokens [rows], logits [rows, V], log-probabilities
        (chosen [rows], top ids and values [rows, MAX_LOGPROBS]) and the new KV."""
        key = ("step", batch.decode_rows, batch.chunk)
        return self._executable(key, params, kv)(params, kv, batch)

    @staticmethod
    def redraw(logits, tokens, bias: np.ndarray, masked: np.ndarray, sampling):
        """A dispatched step's tokens [rows] and log-probabilities with rows `masked`
        drawn again from its logits + `bias` [rows, V] (see `_redraw`); the same draw the
        step makes with that bias."""
        return _redraw(logits, tokens, bias, masked, sampling)

    def builder(self, decode_rows: int, chunk_tokens: int) -> StepBuilder:
        """A step's builder for this many decode rows and chunk tokens, in the shape
        `buckets.step_shape` gives them."""
        rows, chunk = step_shape(self.buckets, decode_rows, chunk_tokens)
        return StepBuilder(rows, chunk, self.buckets.table_width, self.zero_bias(rows, chunk))

    def zero_bias(self, rows: int, chunk: int) -> jax.Array:
        """The zeros [rows, V] of steps without logits processing, kept on the device."""
        n = StepBatch.rows_of(rows, chunk)
        if n not in self._zeros:  # put, not jnp.zeros: a fresh process compiles nothing
            zeros = np.zeros((n, self.config.vocab_size), np.float32)
            self._zeros[n] = (jax.device_put(zeros) if self.tp is None
                              else place_array(zeros, self.tp.sharding()))
        return self._zeros[n]

    def _executable(self, key: tuple, params, kv, use: bool = True) -> jax.stages.Compiled:
        """The executable for `key`: kept, loaded from the store, or compiled (and stored).
        `use` records it as needed by this process (a warmup's are not)."""
        exe = self._aot.get(key)
        if exe is None:
            exe = self.store.load(key) if self.store else None
            if exe is None:
                exe = compile_fresh(self._step.lower(params, kv, self._scratch(key)))
                if self.store:
                    self.store.save(key, exe)
            self._aot[key] = exe
        if use and self.store:
            self.store.note_use(key)
        return exe

    def _scratch(self, key: tuple) -> StepBatch:
        """A batch of the step `key` names that touches only the scratch page. Its chunk
        has one token, so the chunk's attention loop runs its body once: XLA:CPU builds
        the pipelines of what a run executes, and a loop that runs no iteration would
        leave the real prefill to build them."""
        _, rows, chunk = key
        batch = StepBatch.empty(rows, chunk, self.buckets.table_width,
                                self.zero_bias(rows, chunk))
        return batch.replace(chunk_len=np.int32(min(chunk, 1)))

    def all_logits(self, params, kv, tokens, start, num_new, block_tables):
        return self._all_logits(params, kv, tokens, start, num_new, block_tables)

    def keys(self) -> list[tuple]:
        """Every step shape serving may run (`buckets.step_shapes`), as executable keys."""
        return [("step", rows, chunk) for rows, chunk in step_shapes(self.buckets)]

    def warmup(self, params, kv, progress: bool = True, keys: list[tuple] | None = None
               ) -> list[dict]:
        """Compile every step shape (see `keys`; or those of `keys`), as many at once as
        there are CPU cores; returns each compile's shape and seconds (each one's own wall
        time)."""
        def compile_one(key):
            start = time.perf_counter()
            self._executable(key, params, kv, use=False)
            return {"decode_rows": key[1], "chunk": key[2],
                    "compile_s": time.perf_counter() - start}

        todo = [key for key in (keys or self.keys()) if key not in self._aot]
        with ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="xlr-compile") as pool:
            jobs = [pool.submit(compile_one, key) for key in todo]
            return [job.result() for job in tqdm(
                as_completed(jobs), total=len(jobs), desc="Compiling steps", unit="step",
                disable=not progress or None, leave=False)]

    def compilations(self) -> dict[str, int]:
        """Step shapes this instance holds; `_all_logits` compilations of every model
        sharing its jitted function."""
        return {"step": len(self._aot), "all_logits": self._all_logits._cache_size()}
