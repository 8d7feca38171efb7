"""The shapes every step compiles for, and the step's token budget: one home for both.

A compiled step is named by its shape, so every size the runtime passes to one comes from
here: decode rows and speculative rows (powers of two up to max_batch), prefill chunks
(powers of two from 16 to the chunk size), block-table widths, and how a prompt's tokens
are cut into chunks (`first_chunk` when it prefills alone, `chunk_room` beside decode
rows). The Capability Mapper chooses the sizes (`buckets_for`); the scheduler, the model
runner and speculation only pick among them. Imports no jax: the scheduler uses it.
"""
from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

ATTN_BLOCK_PAGES = 16      # XLA attention's largest piece of a row's pages
REDUCE_ROWS = 16           # XLA:CPU: products of up to this many rows as multiply-sums


def pick_bucket(n: int, sizes: tuple[int, ...]) -> int:
    """The smallest bucket >= n (sizes sorted ascending)."""
    i = bisect.bisect_left(sizes, n)
    if i == len(sizes):
        raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}")
    return sizes[i]


def powers_of_two_upto(n: int, start: int = 1) -> tuple[int, ...]:
    sizes = [min(start, n)]
    while sizes[-1] < n:
        sizes.append(min(sizes[-1] * 2, n))
    return tuple(sizes)


@functools.lru_cache(maxsize=4096)
def first_chunk(left: int, sizes: tuple[int, ...], step_cost: int) -> int:
    """The chunk bucket for the first piece of `left` prompt tokens prefilled alone, where a
    step costs its bucket's tokens plus `step_cost`: whole chunks while they fill, then the
    cheapest way through the tail in buckets, the last one padded (a tail of 171 at cost
    16: 128 then 64, 208 tokens' worth against 272 for one padded 256). Ties go to the
    larger bucket (fewer steps); a step_cost of 0 pads the tail into one bucket."""
    if step_cost <= 0 or left >= sizes[-1]:
        return sizes[-1]
    best, choice = [0] * (left + 1), [0] * (left + 1)  # best[n]: the cost of n tokens
    for n in range(1, left + 1):
        cost, larger = min((c + step_cost + best[max(0, n - c)], -c) for c in sizes)
        best[n], choice[n] = cost, -larger
    return choice[left]


@dataclass(frozen=True)
class Buckets:
    """The shapes steps compile for (decided by `buckets_for`, here only)."""
    batch: tuple[int, ...]   # decode rows (and speculative rows)
    chunk: tuple[int, ...]   # prefill chunk lengths; the last is the chunk size
    pages: tuple[int, ...]   # block-table widths of speculative cycles and scoring
    attn_block: int = ATTN_BLOCK_PAGES  # pages the ragged step's attention reads at a time
    # a step's weight products of 2..reduce_rows rows are a multiply and a sum, not a dot
    # (0: always a dot): XLA:CPU's dot of 2-8 rows costs 2-3x a matrix-vector product's
    reduce_rows: int = 0
    # products of 2..kernel_rows rows by the CPU kernel (ops.cpu_linear) where it takes
    # them, before reduce_rows applies (0: no kernel)
    kernel_rows: int = 0

    @property
    def table_width(self) -> int:
        """The ragged step's block-table width: the widest table, in whole blocks."""
        return -(-self.pages[-1] // self.attn_block) * self.attn_block


def buckets_for(max_batch: int, prefill_chunk: int, max_pages: int, dense: bool) -> Buckets:
    """The buckets of a plan's sizes: decode rows, a power of two up to max_batch; chunks,
    a power of two from 16 to prefill_chunk; block-table widths up to `max_pages` (see
    `page_width_buckets`). Dense (CPU) plans also take a step's products of up to 16
    rows as multiply-sums (Buckets.reduce_rows)."""
    return Buckets(powers_of_two_upto(max_batch), powers_of_two_upto(prefill_chunk, start=16),
                   page_width_buckets(max_pages, dense), reduce_rows=REDUCE_ROWS if dense else 0)


def page_width_buckets(max_pages: int, dense: bool) -> tuple[int, ...]:
    """Block-table widths. Dense (CPU): every 2 pages up to 32, then ~1.25x, because the
    XLA reference reads the whole width (measured ~4.3 ms per 1k positions on 2 cores).
    Sparse (GPU): powers of two, since the kernel skips pages past each row's length."""
    sizes = [min(2, max_pages)]
    while sizes[-1] < max_pages:
        if dense:
            step = 2 if sizes[-1] < 32 else sizes[-1] // 4
            sizes.append(min(sizes[-1] + step, max_pages))
        else:
            sizes.append(min(sizes[-1] * 2, max_pages))
    return tuple(sizes)


def step_shape(buckets: Buckets, decode_rows: int, chunk_tokens: int) -> tuple[int, int]:
    """The compiled shape (decode rows, chunk) of a step carrying this many decode rows and
    chunk tokens: each bucketed, and a step with a chunk pads its decode rows to the
    largest bucket (the chunk's tokens dominate its cost, and it halves the shapes to
    compile)."""
    chunk = pick_bucket(chunk_tokens, buckets.chunk) if chunk_tokens else 0
    rows = 0 if not decode_rows else (
        buckets.batch[-1] if chunk else pick_bucket(decode_rows, buckets.batch))
    return rows, chunk


def step_shapes(buckets: Buckets) -> list[tuple[int, int]]:
    """Every shape `step_shape` gives, the warm-up list: decode rows alone (a batch bucket),
    a chunk alone (a chunk bucket), or a chunk beside the largest batch."""
    return ([(rows, 0) for rows in buckets.batch]
            + [(rows, chunk) for rows in (0, buckets.batch[-1]) for chunk in buckets.chunk])


def draft_bucket(longest: int, gamma: int) -> int:
    """Draft positions a speculative cycle verifies for host proposals of at most `longest`
    tokens (they vary in number): a power of two up to the request's gamma."""
    return pick_bucket(max(longest, 1), powers_of_two_upto(gamma))


def chunk_room(buckets: Buckets, rows: int, left: int | None, max_step_tokens: int,
               step_cost: int) -> int:
    """Prompt tokens a step with `rows` decode rows carries: when nothing decodes, a whole
    chunk, or for `left` tokens short of one the bucket `first_chunk` picks (a step costs
    its bucket's tokens plus `step_cost`); beside decode rows, the largest chunk bucket
    within the step budget `max_step_tokens` (the smallest bucket if none fits, so a
    prompt always moves): a chunk costs its bucket's step, full or not."""
    if rows == 0:
        return first_chunk(left or buckets.chunk[-1], buckets.chunk, step_cost)
    fits = [c for c in buckets.chunk if c <= max_step_tokens - rows]
    return fits[-1] if fits else buckets.chunk[0]
