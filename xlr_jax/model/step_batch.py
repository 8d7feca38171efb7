"""One device step's inputs as one pytree: a flat, ragged batch of tokens.

A step holds `Bd` decode rows (one token each, at its sequence's next position) and
at most one prefill chunk (`C` tokens of one sequence, from `chunk_start`), so a long
prompt is prefilled chunk by chunk beside the running decodes and no stream waits
more than one step with one chunk in it. The shapes (Bd, C) are the plan's buckets;
block tables are always as wide as the longest context (the attention walks only
the pages a row can see), so (Bd, C) alone names a compiled step.

Rows: decode rows first, then the chunk's sequence (when C > 0); each row samples
one token (the chunk's after its last real token).
"""
from __future__ import annotations

import jax
import numpy as np

from xlr_jax.model.sampling import SamplingBatch
from xlr_jax.model.sampling_params import SamplingParams
from xlr_jax.pytree import pytree_dataclass


@pytree_dataclass
class StepBatch:
    decode_tokens: jax.Array     # [Bd] int32 (padding rows: 0, on the scratch page)
    decode_positions: jax.Array  # [Bd] int32
    chunk_tokens: jax.Array      # [C] int32, padded after chunk_len
    chunk_start: jax.Array       # [] int32: the chunk's first position
    chunk_len: jax.Array         # [] int32: its real tokens
    block_tables: jax.Array      # [rows, W] int32: the decode rows', then the chunk's
    sampling: SamplingBatch      # [rows]
    bias: jax.Array              # [rows, V] f32 added to the logits a row samples from

    @property
    def decode_rows(self) -> int:
        return self.decode_tokens.shape[0]

    @property
    def chunk(self) -> int:
        return self.chunk_tokens.shape[0]

    @staticmethod
    def rows_of(decode_rows: int, chunk: int) -> int:
        return decode_rows + (chunk > 0)

    @staticmethod
    def empty(decode_rows: int, chunk: int, width: int, bias) -> "StepBatch":
        """A step of (decode_rows, chunk) shape touching only the scratch page, with
        `bias` [rows, V] (zeros: no logits processing)."""
        rows = StepBatch.rows_of(decode_rows, chunk)
        ints = lambda *s: np.zeros(s, np.int32)  # noqa: E731
        return StepBatch(ints(decode_rows), ints(decode_rows), ints(chunk), ints(), ints(),
                         ints(rows, width), SamplingBatch.build([], [], rows), bias)


class StepBuilder:
    """Fills a StepBatch's host arrays, row by row, for a (decode_rows, chunk) bucket.
    `zero_bias` (a device array of zeros [rows, V]) is the bias of a step where no row
    has one, so such steps send nothing of vocabulary size to the device."""

    def __init__(self, decode_rows: int, chunk: int, width: int, zero_bias):
        self.batch = StepBatch.empty(decode_rows, chunk, width, zero_bias)
        self.biased: np.ndarray | None = None
        self.params: list[SamplingParams] = []
        self.steps: list[int] = []
        self.decoded = 0

    def decode(self, token: int, position: int, table: np.ndarray,
               params: SamplingParams, step: int) -> None:
        """The next decode row: `token` fed at `position`, drawing its `step`-th token."""
        b, j = self.batch, self.decoded
        b.decode_tokens[j], b.decode_positions[j], b.block_tables[j] = token, position, table
        self.params.append(params)
        self.steps.append(step)
        self.decoded += 1

    def prefill(self, tokens: list[int], start: int, table: np.ndarray,
                params: SamplingParams, step: int) -> None:
        """The step's chunk: `tokens` written from position `start`."""
        b = self.batch
        b.chunk_tokens[:len(tokens)] = tokens
        b.block_tables[b.decode_rows] = table
        self.params += [SamplingParams()] * (b.decode_rows - self.decoded) + [params]
        self.steps += [0] * (b.decode_rows - self.decoded) + [step]
        self.batch = b.replace(chunk_start=np.int32(start), chunk_len=np.int32(len(tokens)))

    def bias(self, row: int, values: np.ndarray) -> None:
        """Add `values` [V] to row `row`'s logits before it samples (a mask: -inf)."""
        if self.biased is None:
            self.biased = np.zeros(self.batch.bias.shape, np.float32)
        self.biased[row] = values

    def build(self, decode_feed=None) -> StepBatch:
        """The batch; `decode_feed` (device tokens of the previous step, same rows)
        replaces the decode tokens written on the host."""
        return place(self.host(), self.batch.bias, decode_feed)

    def host(self) -> StepBatch:
        """The batch in host arrays only, its bias None where no row has one: what
        another process places the same step from (`place`)."""
        rows = self.batch.block_tables.shape[0]
        sampling = SamplingBatch.build(self.params, self.steps, rows)
        return self.batch.replace(sampling=sampling, bias=self.biased)


def place(host: StepBatch, zero_bias, decode_feed=None) -> StepBatch:
    """`host` (StepBuilder.host) ready to run: its decode tokens on the device, or
    `decode_feed` (the previous step's device tokens, same rows) instead, and `zero_bias`
    (the shape's zeros on the device) where it has no bias."""
    # put, not jnp.asarray: that compiles a program (lax.stage) per row count
    tokens = jax.device_put(host.decode_tokens) if decode_feed is None else decode_feed
    bias = zero_bias if host.bias is None else host.bias
    return host.replace(decode_tokens=tokens, bias=bias)
