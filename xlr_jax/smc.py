"""Sequential Monte Carlo pieces for SMC speculative decoding, as pure jitted functions.

Particles carry log-weights. After each speculative block a particle's
log-weight grows by alpha * log p_target - log q_draft summed over the block's
draft tokens (alpha = 1 targets p itself, alpha != 1 targets p^alpha). When the
effective sample size 1 / sum(w^2) of the normalized weights falls below
threshold * N, the population is resampled: `resample` returns ancestor
indices (systematic by default, multinomial as an option), which the engine
applies by re-pointing block tables, never by copying KV. After a resample all
log-weights are reset to the mean (equal weights), and the log-normalizer
estimate accumulates log(mean w) at each resample and at the end.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


def normalized(log_w):
    """Normalized weights [N] from log-weights [N]."""
    return jax.nn.softmax(log_w)


def ess(log_w):
    """Effective sample size 1 / sum(w_bar^2), between 1 and N."""
    w = normalized(log_w)
    return 1.0 / jnp.sum(w * w)


def log_mean_weight(log_w):
    """log(mean w): this step's factor of the normalizing-constant estimate."""
    return jax.nn.logsumexp(log_w) - jnp.log(log_w.shape[0])


def block_increment(logp_target, logq_draft, mask=None, alpha: float = 1.0):
    """Per-particle log-weight increment of one block: sum over its draft tokens of
    alpha * log p_target - log q_draft. Inputs [N, gamma]; `mask` drops positions."""
    inc = alpha * logp_target - logq_draft
    if mask is not None:
        inc = jnp.where(mask, inc, 0.0)
    return jnp.sum(inc, axis=-1)


@partial(jax.jit, static_argnames=("method", "num"))
def resample(key, log_w, method: str = "systematic", num: int | None = None):
    """Ancestor index for each of `num` (default N) new particles, drawn in proportion to
    the weights; a different `num` grows or shrinks the population."""
    n = log_w.shape[0] if num is None else num
    w = normalized(log_w)
    if method == "multinomial":
        return jax.random.categorical(key, jnp.log(w + 1e-38), shape=(n,)).astype(jnp.int32)
    if method != "systematic":
        raise ValueError(f"unknown resampling method {method!r}; use systematic or multinomial")
    # one uniform offset, N evenly spaced points through the weights' CDF
    points = (jax.random.uniform(key) + jnp.arange(n)) / n
    cdf = jnp.cumsum(w)
    cdf = cdf.at[-1].set(1.0)  # rounding must not leave the last point unassigned
    return jnp.searchsorted(cdf, points, side="right").astype(jnp.int32).clip(0, w.shape[0] - 1)


def pick_answer(key, log_w):
    """The particle returned as the answer: one drawn in proportion to its weight."""
    return jax.random.categorical(key, log_w)
