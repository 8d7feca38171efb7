"""The pure pieces of speculative decoding: exact acceptance, SMC weights and resampling,
n-gram proposals."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xlr_jax.speculative.acceptance import accept_block
from xlr_jax.speculative.drafts import ngram_propose
from xlr_jax.speculative.smc import (block_increment, draw_keys, ess, log_mean_weight, normalized,
                                     resample, split)

V = 4


def tables(seed):
    """Target conditionals P1, P2[x1], P3[x1, x2] and draft Q1, Q2[x1] over V tokens."""
    rng = np.random.default_rng(seed)
    d = lambda *s: rng.dirichlet(np.ones(V) * 0.7, size=s)  # noqa: E731
    return d(1)[0], d(V), d(V, V), d(1)[0], d(V)


def test_exact_sampling_matches_the_target_distribution():
    """First two emitted tokens over 40,000 seeds against P1(x1) P2(x2 | x1): total variation
    under 0.02 (sampling noise over 16 outcomes is ~0.008)."""
    P1, P2, P3, Q1, Q2 = (jnp.asarray(t, jnp.float32) for t in tables(0))
    n = 40_000
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    d1 = jax.random.categorical(k1, jnp.log(Q1), shape=(n,))
    d2 = jax.random.categorical(k2, jnp.log(Q2[d1]))
    draft = jnp.stack([d1, d2], 1)
    q = jnp.stack([jnp.broadcast_to(Q1, (n, V)), Q2[d1]], 1)
    p = jnp.stack([jnp.broadcast_to(P1, (n, V)), P2[d1], P3[d1, d2]], 1)
    accepted, nxt = accept_block(k3, draft, q, p)
    x1 = jnp.where(accepted >= 1, d1, nxt)
    # a rejection at the first token emits only x1: the next block (exact by the same
    # argument) would draw x2 from the target given x1
    fresh = jax.random.categorical(k4, jnp.log(P2[x1]))
    x2 = jnp.where(accepted == 2, d2, jnp.where(accepted == 1, nxt, fresh))
    counts = np.bincount(np.asarray(x1 * V + x2), minlength=V * V) / n
    expected = (np.asarray(P1)[:, None] * np.asarray(P2)).reshape(-1)
    assert 0.5 * np.abs(counts - expected).sum() < 0.02
    assert 0 < float(jnp.mean(accepted == 2)) < 1  # both branches were exercised


def test_greedy_acceptance_returns_the_targets_tokens():
    target = jnp.array([[3, 1, 2, 0]])          # greedy target tokens at 4 positions
    for draft, kept in (([3, 1, 2], 3), ([3, 0, 2], 1), ([2, 1, 2], 0)):
        d = jnp.array([draft])
        q = jax.nn.one_hot(d, V)
        p = jax.nn.one_hot(target, V)
        accepted, nxt = accept_block(jax.random.key(1), d, q, p)
        assert int(accepted[0]) == kept and int(nxt[0]) == int(target[0, kept])


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 64), st.integers(0, 2 ** 31 - 1))
def test_systematic_counts_within_one_of_n_times_weight(n, seed):
    rng = np.random.default_rng(seed)
    log_w = jnp.asarray(rng.normal(0, 2, n), jnp.float32)
    ancestors = np.asarray(resample(jax.random.key(seed), log_w))
    counts = np.bincount(ancestors, minlength=n)
    assert counts.sum() == n
    assert np.all(np.abs(counts - n * np.asarray(normalized(log_w))) <= 1 + 1e-4)


def test_multinomial_counts_average_to_n_times_weight():
    log_w = jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05]))
    keys = jax.random.split(jax.random.key(2), 4000)
    draws = jax.vmap(lambda k: resample(k, log_w, "multinomial"))(keys)
    freq = np.bincount(np.asarray(draws).reshape(-1), minlength=4) / draws.size
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.01)
    with pytest.raises(ValueError, match="unknown resampling method"):
        resample(jax.random.key(0), log_w, "stratified-ish")


def test_weight_update_against_a_hand_computation():
    logp = np.log([[0.5, 0.25, 0.8], [0.1, 0.9, 0.5], [0.3, 0.2, 0.1]])
    logq = np.log([[0.25, 0.5, 0.4], [0.2, 0.3, 0.5], [0.6, 0.1, 0.1]])
    # particle 0 kept all 3 drafts: log(0.5/0.25) + log(0.25/0.5) + log(0.8/0.4) = log 2
    # particle 1 stopped at its 2nd draft: log(0.1/0.2) + log(0.9/0.3) = log 1.5
    # particle 2 stopped at its 1st draft: log(0.3/0.6) = log 0.5
    inc = block_increment(logp, logq, kept=[3, 2, 1])
    np.testing.assert_allclose(inc, np.log([2.0, 1.5, 0.5]), rtol=1e-12)
    w = jnp.log(jnp.array([1.0, 3.0]))
    assert float(ess(w)) == pytest.approx(1 / (0.25 ** 2 + 0.75 ** 2))
    assert float(log_mean_weight(w)) == pytest.approx(np.log(2.0))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8), st.integers(1, 24), st.integers(0, 2 ** 31 - 1))
def test_splitting_keeps_the_weighted_particles_and_their_mean(n, extra, seed):
    """Growing N to N + extra by splitting: every particle keeps at least one copy, its
    copies share its normalized weight, and the mean weight (the normalizer estimate) is
    unchanged. Extra copies go to live particles only."""
    rng = np.random.default_rng(seed)
    log_w = rng.normal(0, 3, n)
    live = rng.random(n) < 0.7
    parents, new_w = split(log_w, n + extra, live)
    assert len(parents) == len(new_w) == n + extra
    assert set(parents) == set(range(n))
    before = np.asarray(normalized(jnp.asarray(log_w)))
    after = np.bincount(parents, weights=np.exp(new_w - np.logaddexp.reduce(new_w)),
                        minlength=n)
    np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-12)
    assert np.logaddexp.reduce(new_w) - np.log(n + extra) == pytest.approx(
        np.logaddexp.reduce(log_w) - np.log(n))
    if live.any():
        assert np.all(np.bincount(parents, minlength=n)[~live] == 1)


def test_every_host_draw_of_a_request_has_its_own_key():
    """Resampling at each cycle and the answer draw use distinct keys (the answer key is
    no cycle's resample key, whatever the cycle counter is when the loop ends)."""
    for seed in (0, 7):
        resample_key, answer_key = draw_keys(seed)
        keys = {tuple(np.asarray(jax.random.key_data(resample_key(c)))) for c in range(512)}
        assert len(keys) == 512
        assert tuple(np.asarray(jax.random.key_data(answer_key))) not in keys


def test_degenerate_weights_resample_to_the_heavy_particle():
    log_w = jnp.array([0.0, -30.0, -30.0, -30.0])
    assert float(ess(log_w)) < 0.5 * 4
    for method in ("systematic", "multinomial"):
        assert np.all(np.asarray(resample(jax.random.key(4), log_w, method)) == 0)


def test_resampling_grows_or_shrinks_the_population():
    log_w = jnp.log(jnp.array([0.5, 0.5]))
    grown = np.asarray(resample(jax.random.key(5), log_w, num=8))
    assert grown.shape == (8,) and np.bincount(grown, minlength=2).tolist() == [4, 4]
    shrunk = np.asarray(resample(jax.random.key(6), jnp.log(jnp.array([0.7, 0.1, 0.1, 0.1])),
                                 num=1))
    assert shrunk.shape == (1,) and 0 <= int(shrunk[0]) < 4


def test_ngram_lookup_proposes_what_followed_the_latest_match():
    text = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7, 3, 4, 5, 6]
    assert ngram_propose(text, 3) == [7, 3, 4]       # "5 6" last seen before "7 3 4"
    assert ngram_propose(text + [7], 2) == [3, 4]    # "5 6 7": the latest match wins
    assert ngram_propose([1, 2, 3], 4) == []          # nothing repeats
    assert ngram_propose([4, 4], 3) == [4]            # a run repeats itself


def test_smc_falls_back_when_the_agreement_drops_under_smc():
    """A probation passed on a good stretch, then poor agreement at the particles' draft
    positions over a window of cycles: the request falls back to exact speculation."""
    from xlr_jax.speculative.population import SMC_PROBATION, SmcWatch

    watch = SmcWatch(min_agreement=0.7)
    for _ in range(SMC_PROBATION):
        assert watch.single  # on probation: one particle, exact speculation
        watch.observe_exact(np.full(4, 0.9), positions=4)
    assert not watch.single and watch.fallback is None
    for _ in range(SMC_PROBATION):  # a good window keeps SMC
        watch.observe_smc(np.zeros(2), np.full((2, 4), 0.9), np.array([4, 4]))
    assert not watch.single
    bad = (np.zeros(2), np.full((2, 4), 0.3), np.array([4, 2]))  # 6 positions at 0.3
    watch.observe_smc(*bad)  # window mean (3 * 7.2 + 1.8) / 30 = 0.78: still SMC
    assert not watch.single
    watch.observe_smc(*bad)  # (2 * 7.2 + 3.6) / 28 = 0.64 < 0.7: exact from here
    assert watch.single and "under SMC" in watch.fallback
    assert watch.metrics()["smc_fallback"] == watch.fallback
