"""Sampling: host-side validated parameters and a pure, per-sequence seeded sampler.

Each sequence's randomness is `fold_in(key(seed), step)` with step the index of
the token being drawn, so a sequence draws the same tokens alone or in any batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from xlr_jax.errors import InvalidRequestError
from xlr_jax.pytree import pytree_dataclass

MAX_LOGPROBS = 20  # top log-probabilities a request may ask for per token (OpenAI's cap)


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler; temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0          # 0: off
    top_p: float = 1.0      # 1: off
    min_p: float = 0.0      # 0: off
    seed: int = 0
    max_tokens: int = 256
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)  # end like EOS
    logprobs: int | None = None  # per token: its log-probability and this many top ones
    # called before each step that samples for the request with the token ids generated
    # so far; returns a bias [vocab] added to the logits (-inf masks a token), or None.
    # A pure function of those ids (it may be called again with the same ones)
    logits_processor: Callable[[list[int]], np.ndarray | None] | None = field(
        default=None, compare=False)

    def __post_init__(self):
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0 (got {self.temperature}); use 0 for greedy"),
            (self.top_k >= 0, f"top_k must be >= 0 (got {self.top_k}); use 0 to turn it off"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1] (got {self.top_p}); use 1 to turn it off"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1] (got {self.min_p}); use 0 to turn it off"),
            (self.max_tokens >= 1, f"max_tokens must be >= 1 (got {self.max_tokens})"),
            (0 <= self.seed < 2 ** 32, f"seed must be in [0, 2**32) (got {self.seed})"),
            (self.logits_processor is None or callable(self.logits_processor),
             "logits_processor must be a callable (token ids -> bias array) or None"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"logprobs must be in [0, {MAX_LOGPROBS}] (got {self.logprobs}); None turns "
             "them off"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filtered(self) -> bool:
        """Top-k, top-p or min-p is on (the sampler must sort the vocabulary)."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


@pytree_dataclass
class SamplingBatch:
    """Per-row sampling values for one step; rows are sequences."""

    temperature: jax.Array  # [B] f32
    top_k: jax.Array        # [B] i32
    top_p: jax.Array        # [B] f32
    min_p: jax.Array        # [B] f32
    seed: jax.Array         # [B] u32
    step: jax.Array         # [B] i32, index of the token being drawn
    logprobs: jax.Array     # [B] bool: report log-probabilities for this row

    @classmethod
    def build(cls, params: list[SamplingParams], steps, batch: int) -> "SamplingBatch":
        pad = batch - len(params)
        params = list(params) + [SamplingParams()] * pad
        steps = list(steps) + [0] * pad
        return cls(
            temperature=np.array([p.temperature for p in params], np.float32),
            top_k=np.array([p.top_k for p in params], np.int32),
            top_p=np.array([p.top_p for p in params], np.float32),
            min_p=np.array([p.min_p for p in params], np.float32),
            seed=np.array([p.seed for p in params], np.uint32),
            step=np.array(steps, np.int32),
            logprobs=np.array([p.logprobs is not None for p in params], bool))


def _kept_sorted(logits, temperature, top_k, top_p, min_p):
    """Scaled logits sorted descending, their order, and which survive the filters."""
    vocab = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled)
    sorted_logits = scaled[order]
    probs = jax.nn.softmax(sorted_logits)
    rank = jnp.arange(vocab)
    keep = rank < jnp.where(top_k > 0, top_k, vocab)
    keep &= (jnp.cumsum(probs) - probs) < top_p      # smallest set reaching top_p
    keep &= probs >= min_p * probs[0]
    keep = keep.at[0].set(True)
    return order, sorted_logits, keep


def _sample_row(logits, temperature, top_k, top_p, min_p, seed, step):
    order, sorted_logits, keep = _kept_sorted(logits, temperature, top_k, top_p, min_p)
    # back in vocabulary order: an unfiltered row draws exactly what `_draw_row` draws
    masked = jnp.full_like(sorted_logits, -jnp.inf).at[order].set(
        jnp.where(keep, sorted_logits, -jnp.inf))
    return _draw_row(masked, 1.0, seed, step)


def _draw_row(logits, temperature, seed, step):
    key = jax.random.fold_in(jax.random.key(seed), step)
    return jax.random.categorical(key, logits / jnp.maximum(temperature, 1e-6))


def _filtered_probs_row(logits, temperature, top_k, top_p, min_p):
    order, sorted_logits, keep = _kept_sorted(logits, temperature, top_k, top_p, min_p)
    kept = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf))
    return jnp.zeros_like(kept).at[order].set(kept)


def token_probs(logits, temperature, top_k, top_p, min_p, *, sampler: str):
    """The distribution `sample` draws from, as probabilities [R, V] for logits [R, V].

    Greedy rows (temperature 0) are one-hot at the argmax; the static `sampler` (see
    sampler_for) skips the softmax when every row is greedy and the sort unless some
    row uses top-k/top-p/min-p. Speculative decoding compares these for the target
    and the draft.
    """
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    if sampler == "greedy":
        return greedy
    if sampler == "filtered":
        probs = jax.vmap(_filtered_probs_row)(logits, temperature, top_k, top_p, min_p)
    else:
        probs = jax.nn.softmax(logits / jnp.maximum(temperature, 1e-6)[:, None], axis=-1)
    return jnp.where((temperature > 0)[:, None], probs, greedy)


SAMPLERS = ("greedy", "softmax", "filtered")


def sampler_for(params: list[SamplingParams]) -> str:
    """The cheapest sampler a batch needs: argmax only, a plain softmax draw, or the
    sorting one for top-k/top-p/min-p (a sort of the vocabulary per row)."""
    if all(p.greedy for p in params):
        return "greedy"
    return "filtered" if any(p.filtered for p in params if not p.greedy) else "softmax"


def sample(logits, batch: SamplingBatch, *, sampler: str):
    """Next token per row of `logits` [B, V] with the static `sampler` (see sampler_for)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if sampler == "greedy":
        return greedy
    if sampler == "softmax":
        drawn = jax.vmap(_draw_row)(logits, batch.temperature, batch.seed, batch.step)
    else:
        drawn = jax.vmap(_sample_row)(logits, batch.temperature, batch.top_k, batch.top_p,
                                      batch.min_p, batch.seed, batch.step)
    return jnp.where(batch.temperature > 0, drawn.astype(jnp.int32), greedy)


def sample_rows(logits, batch: SamplingBatch):
    """Next token per row of `logits` [B, V], each row paying only for what it asks:
    greedy rows an argmax, temperature rows a draw, top-k/top-p/min-p rows the sort
    (rows run one by one, each through its own branch). Draws what `sample` draws."""
    kind = jnp.where(batch.temperature == 0, 0,
                     jnp.where((batch.top_k > 0) | (batch.top_p < 1) | (batch.min_p > 0), 2, 1))
    branches = (lambda *a: jnp.argmax(a[0]).astype(jnp.int32),
                lambda l, t, k, p, m, s, n: _draw_row(l, t, s, n).astype(jnp.int32),
                lambda *a: _sample_row(*a).astype(jnp.int32))

    def row(args):
        which, *values = args
        return jax.lax.switch(which, branches, *values)

    return jax.lax.map(row, (kind, logits, batch.temperature, batch.top_k, batch.top_p,
                             batch.min_p, batch.seed, batch.step))


def row_logprobs(logits, chosen, batch: SamplingBatch):
    """For rows that ask (`batch.logprobs`): the chosen token's log-probability under
    the model's distribution (the raw logits, before temperature or filters) and the
    MAX_LOGPROBS (at most the vocabulary) most likely tokens' ids and log-probabilities;
    zeros for other rows,
    which pay nothing for it."""
    k = min(MAX_LOGPROBS, logits.shape[-1])  # a tiny test vocabulary has fewer
    zeros = (jnp.float32(0), jnp.zeros(k, jnp.int32), jnp.zeros(k, jnp.float32))

    def compute(row, token):
        log_p = jax.nn.log_softmax(row)
        values, ids = jax.lax.top_k(log_p, k)
        return log_p[token], ids.astype(jnp.int32), values

    def row(args):
        want, values, token = args
        return jax.lax.cond(want, compute, lambda *_: zeros, values, token)

    return jax.lax.map(row, (batch.logprobs, logits, chosen))
