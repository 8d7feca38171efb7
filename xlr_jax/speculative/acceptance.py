"""Exact speculative sampling (Leviathan et al. 2022; Chen et al. 2023) as a pure function.

The draft proposed `gamma` tokens d_1..d_gamma with probabilities q_i(.) and the
target scored gamma + 1 positions, p_1..p_{gamma+1}, in one forward. Token d_i
is accepted with probability min(1, p_i(d_i) / q_i(d_i)), left to right; at the
first rejection the replacement is drawn from normalize(max(0, p_i - q_i)); if
all are accepted a bonus token is drawn from p_{gamma+1}. The emitted tokens
are then distributed exactly as the target's own samples. A point-mass draft
(n-gram lookup) is q = one-hot. With greedy (one-hot) p the result is exactly
the target's greedy tokens.

For a point-mass draft there is a simpler exact rule, `accept_by_matching`: draw
every position's token from p with the plain sampler's own key, and keep the
drafts up to the first one that differs from its draw. Drawing x ~ p and keeping
d when x == d accepts d with probability p(d), and on a mismatch emits x, which is
p conditioned on x != d: exactly the rule above with q = one-hot. Since every
emitted token is the draw plain sampling would make at that index, the output is
plain sampling's, token for token (same seed), however the drafts fell.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from xlr_jax.model.sampling import draw_from


def accept_block(key, draft_tokens, q_probs, p_probs, num_draft=None):
    """Accept/reject one speculative block per sequence.

    draft_tokens [B, gamma] int; q_probs [B, gamma, V]; p_probs [B, gamma + 1, V].
    `num_draft` [B] (default gamma) counts each row's real proposals; later ones are
    never accepted and the token after the last real one is a bonus from p.
    Returns (accepted [B]: draft tokens kept, 0..gamma; next_token [B]: the token
    after them, a resample at the first rejection or the bonus token). The sequence
    advances by accepted + 1 tokens; the KV of rejected positions is dropped by the
    caller (trimming lengths, not copying).
    """
    batch, gamma = draft_tokens.shape
    k_accept, k_next = jax.random.split(key)
    p_d = jnp.take_along_axis(p_probs[:, :gamma], draft_tokens[..., None], -1)[..., 0]
    q_d = jnp.take_along_axis(q_probs, draft_tokens[..., None], -1)[..., 0]
    u = jax.random.uniform(k_accept, (batch, gamma))
    ok = u * q_d < p_d  # u < p/q without dividing (q > 0 wherever the draft sampled)
    if num_draft is not None:
        ok &= jnp.arange(gamma) < num_draft[:, None]
    else:
        num_draft = jnp.full(batch, gamma, jnp.int32)
    accepted = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)
    # the distribution of the token after the accepted run
    at = jnp.minimum(accepted, gamma - 1)
    p_at = jnp.take_along_axis(p_probs, accepted[:, None, None], 1)[:, 0]
    q_at = jnp.take_along_axis(q_probs, at[:, None, None], 1)[:, 0]
    residual = jnp.maximum(p_at - q_at, 0.0)
    all_in = (accepted == num_draft)[:, None]
    # a residual that is all zero (p == q) cannot happen after a rejection, but guard it
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_at)
    dist = jnp.where(all_in, p_at, residual)
    return accepted, draw_from(k_next, dist)


def accept_by_matching(drawn, draft_tokens, num_draft, xp=jnp):
    """Exact acceptance of point-mass drafts (see the module): `drawn` [B, gamma + 1]
    holds each position's token drawn from p by the plain sampler, `draft_tokens`
    [B, gamma] the proposals, `num_draft` [B] how many are real. Returns (accepted
    [B], next_token [B]) as `accept_block` does. `xp=numpy` runs it on the host (on
    draws a ragged step already read back)."""
    gamma = draft_tokens.shape[1]
    same = (drawn[:, :gamma] == draft_tokens) & (xp.arange(gamma) < num_draft[:, None])
    accepted = xp.sum(xp.cumprod(same, axis=1), axis=1).astype(xp.int32)
    return accepted, xp.take_along_axis(drawn, accepted[:, None], 1)[:, 0]
