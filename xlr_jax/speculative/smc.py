"""Sequential Monte Carlo pieces for SMC speculative decoding, as pure functions.

What SMC-SD targets: the model's own distribution p over whole completions, at
the request's temperature (no top-k/top-p/min-p), exactly as plain sampling
does. Each particle extends itself by gamma draft tokens d ~ q and a bonus
token from p; its log-weight grows by log p(d) - log q(d) summed over the draft
tokens it keeps (none after it stops: EOS or a stop string). The bonus, drawn
from p itself, has weight 1. A tempered target p^alpha is not offered: the first
token (sampled at prefill, before particles exist) and single-particle cycles
(exact speculation) sample p, and cannot be reweighted toward p^alpha.

When the effective sample size 1 / sum(w^2) of the normalized weights falls below
threshold * N, the population is resampled: `resample` returns ancestor indices
(systematic by default, multinomial as an option), which the engine applies by
re-pointing block tables, never by copying KV; afterwards the weights are equal.
The population grows without resampling by splitting particles (`split`), which
leaves the weighted particle measure unchanged. The log-normalizer estimate
accumulates log(mean w) at each resample and at the end; for p (normalized)
its exponential is an unbiased estimate of 1, and exp(log Z) * sum_i w_i f(x_i)
an unbiased estimate of E_p[f] at any N.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

SMC_STREAM = 0x534D43  # folded into a request's seed for its host-side draws


def draw_keys(seed: int):
    """One SMC request's host-side keys, each draw on its own stream so that none reuses
    another's key: (resample_key(cycle), answer_key). The cycle's draft and acceptance
    keys come from (seed, token index, particle) instead (see speculative._row_keys)."""
    base = jax.random.fold_in(jax.random.key(seed), SMC_STREAM)
    resamples, answer = jax.random.fold_in(base, 0), jax.random.fold_in(base, 1)
    return (lambda cycle: jax.random.fold_in(resamples, cycle)), answer


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


def block_increment(logp_target, logq_draft, kept):
    """Per-particle log-weight increment of one block: the sum over its first `kept`
    draft tokens of log p_target - log q_draft. Inputs [N, gamma] and `kept` [N]: the
    draft tokens each particle kept (up to and including the one that stopped it)."""
    logp_target, logq_draft = np.asarray(logp_target), np.asarray(logq_draft)
    counted = np.arange(logp_target.shape[1]) < np.asarray(kept)[:, None]
    return np.where(counted, logp_target - logq_draft, 0.0).sum(axis=1)


def split(log_w, num: int, live=None):
    """Grow N particles to `num` > N without resampling: returns (the particle each new
    one copies [num], their log-weights [num]). A particle split into k copies gives
    each 1/k of its weight, so the weighted particle measure is unchanged; the weights
    are scaled by num / N so that their mean (the normalizer estimate) is too. Extra
    copies go to the heaviest particles that are still `live` (bool [N])."""
    log_w = np.asarray(log_w, np.float64)
    n = log_w.shape[0]
    live = np.ones(n, bool) if live is None else np.asarray(live, bool)
    copies = np.ones(n, np.int64)
    order = [i for i in np.argsort(-log_w, kind="stable") if live[i]] or list(range(n))
    for j in range(num - n):
        copies[order[j % len(order)]] += 1
    parents = np.repeat(np.arange(n), copies)
    return parents, (log_w - np.log(copies) + np.log(num / n))[parents]


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
