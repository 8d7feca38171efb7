"""Sampling: host-side validated parameters and a pure, per-sequence seeded sampler.

Each sequence's randomness is `fold_in(key(seed), step)` with step the index of
the token being drawn, so a sequence draws the same tokens alone or in any batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from xlr_jax.errors import InvalidRequestError
from xlr_jax.pytree import pytree_dataclass


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

    def __post_init__(self):
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0 (got {self.temperature}); use 0 for greedy"),
            (self.top_k >= 0, f"top_k must be >= 0 (got {self.top_k}); use 0 to turn it off"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1] (got {self.top_p}); use 1 to turn it off"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1] (got {self.min_p}); use 0 to turn it off"),
            (self.max_tokens >= 1, f"max_tokens must be >= 1 (got {self.max_tokens})"),
            (0 <= self.seed < 2 ** 32, f"seed must be in [0, 2**32) (got {self.seed})"),
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
            step=np.array(steps, np.int32))


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
