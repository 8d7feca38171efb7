"""Timing one compiled ragged step in isolation, for experiments that compare two ways of
running it side by side (experiments/few_row_products.py, chunk_attention.py)."""
from __future__ import annotations

import statistics
import time

import numpy as np


def timed(fns: dict, rounds: int) -> dict:
    """Median seconds of each fn() (it blocks until done), the fns taking turns per round;
    each runs once first (compiles)."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def row_tables(engine, width: int, rows: int, seen: int) -> list[np.ndarray]:
    """Block tables of `width` pages for `rows` rows, row j on a run of `seen` pages of its
    own after row j - 1's (page 0, the scratch page, is skipped); the pages hold whatever
    they hold, which does not change a step's cost."""
    pages = engine.runner.kv.num_pages
    return [(np.arange(width, dtype=np.int32) + j * seen) % (pages - 1) + 1
            for j in range(rows)]


def step_batch(model, steps, decode_rows: int, chunk: int, position: int):
    """A StepBatch (for `steps`' buckets) of `decode_rows` random tokens at `position`,
    each row on pages of its own, and a `chunk`-token random chunk from there."""
    from xlr_jax.kv.pages import pages_for
    from xlr_jax.model.sampling_params import SamplingParams

    engine = model.engine
    seen = pages_for(position + chunk + 1, engine.runner.kv.page_size)
    tables = row_tables(engine, steps.buckets.table_width, decode_rows + 1, seen)
    builder = steps.builder(decode_rows, chunk)
    rng = np.random.default_rng(0)
    for j in range(decode_rows):
        builder.decode(int(rng.integers(engine.config.vocab_size)), position, tables[j],
                       SamplingParams(), 0)
    if chunk:
        ids = rng.integers(0, engine.config.vocab_size, chunk)
        builder.prefill(ids.tolist(), position, tables[-1], SamplingParams(), 0)
    return builder.build()


def step_runner(model, steps, decode_rows: int, chunk: int, position: int):
    """fn() running one compiled step (`steps`, over the model's params) of `step_batch`'s
    batch on the model's KV (`ModelRunner.run_step`)."""
    import jax

    batch = step_batch(model, steps, decode_rows, chunk, position)
    return lambda: jax.block_until_ready(model.engine.runner.run_step(batch, steps))


def time_steps(model, steps: dict, shapes, position: int, rounds: int) -> dict:
    """{(decode rows, chunk): {name: median seconds}} of each shape's step by each of
    `steps` (name -> Steps over the model's params and KV), taking turns in every round."""
    return {(rows, chunk): timed({name: step_runner(model, st, rows, chunk, position)
                                  for name, st in steps.items()}, rounds)
            for rows, chunk in shapes}
