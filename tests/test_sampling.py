"""The pure sampler and the request-level sampling behaviour."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlr_jax import InvalidRequestError
from xlr_jax.model.sampling import (CANDIDATES, SamplingBatch, sample_rows, sampler_for, token_probs)
from xlr_jax.model.sampling_params import SamplingParams


def draw(logits, n=400, **kw):
    """Tokens drawn from one row of logits under n different steps."""
    params = SamplingParams(**kw)
    rows = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, len(logits)))
    return np.asarray(sample_rows(rows, SamplingBatch.build([params] * n, list(range(n)), n)))


def kept_distribution(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """The filtered distribution by definition, token by token (no ranking): a token is
    kept when fewer than top_k tokens, and less than top_p of the probability, lie
    strictly above it, and its probability is at least min_p times the largest."""
    scaled = np.asarray(logits, np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    above = scaled[None, :] > scaled[:, None]  # [i, j]: j strictly above i
    keep = (above.sum(1) < top_k) if top_k else np.ones(len(probs), bool)
    if top_p < 1:
        keep &= (above * probs[None, :]).sum(1) < top_p
    keep &= probs >= min_p * probs.max()
    kept = np.where(keep, probs, 0.0)
    return kept / kept.sum()


def total_variation_by_rank(tokens, expected, bins=32):
    """Total variation between drawn tokens and `expected`, over bins of tokens in rank
    order (bins of equal expected mass keep every bin's count large)."""
    order = np.argsort(-expected)
    edges = np.searchsorted(np.cumsum(expected[order]), np.linspace(0, 1, bins + 1)[1:-1])
    bin_of = np.empty(len(expected), int)
    bin_of[order] = np.searchsorted(edges, np.arange(len(expected)), side="right")
    got = np.bincount(bin_of[tokens], minlength=bins) / len(tokens)
    want = np.bincount(bin_of, weights=expected, minlength=bins)
    return 0.5 * np.abs(got - want).sum()


@pytest.fixture
def logits():
    return np.random.default_rng(0).normal(size=64).astype(np.float32) * 2


def test_greedy_is_argmax(logits):
    assert (draw(logits, n=8, temperature=0.0) == logits.argmax()).all()


def test_top_k_restricts_support(logits):
    top3 = set(np.argsort(-logits)[:3])
    got = set(draw(logits, temperature=1.5, top_k=3))
    assert got <= top3 and len(got) == 3


def test_top_p_keeps_smallest_nucleus(logits):
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    nucleus = set(order[:np.searchsorted(np.cumsum(probs[order]), 0.6) + 1])
    got = set(draw(logits, temperature=1.0, top_p=0.6))
    assert got <= nucleus and len(got) > 1


def test_min_p_drops_unlikely_tokens(logits):
    probs = np.exp(logits - logits.max())
    keep = set(np.flatnonzero(probs >= 0.2 * probs.max()))
    got = set(draw(logits, temperature=1.0, min_p=0.2))
    assert got <= keep and len(got) > 1


def test_temperature_matches_softmax_distribution(logits):
    n = 4000
    got = draw(logits, n=n, temperature=0.7)
    probs = np.asarray(jax.nn.softmax(jnp.asarray(logits) / 0.7))
    counts = np.bincount(got, minlength=len(logits)) / n
    assert 0.5 * np.abs(counts - probs).sum() < 0.05  # total variation


# A vocabulary past CANDIDATES: with flat logits the kept tokens reach beyond the ranked
# candidates, which the sampler reaches by rejection from the whole vocabulary
@pytest.mark.parametrize("kw", [
    dict(temperature=1.0),                      # nothing filtered: every token
    dict(temperature=2.0, top_p=0.7),           # a nucleus of about 1,100 tokens
    dict(temperature=1.0, top_k=CANDIDATES + 200),
    dict(temperature=1.0, min_p=0.05),
    dict(temperature=0.3, top_p=0.9),           # peaked: inside the candidates
    dict(temperature=0.5, top_k=40, top_p=0.8, min_p=0.02),
])
def test_draws_follow_the_kept_distribution_past_the_candidates(kw):
    vocab, n = 4 * CANDIDATES + 3, 20_000
    logits = np.random.default_rng(1).normal(size=vocab).astype(np.float32)
    expected = kept_distribution(logits, **kw)
    probs = np.asarray(token_probs(jnp.asarray(logits)[None], *(
        jnp.asarray([kw.get(k, d)]) for k, d in (("temperature", 0.0), ("top_k", 0),
                                                  ("top_p", 1.0), ("min_p", 0.0))),
        sampler="filtered"))[0]
    np.testing.assert_allclose(probs, expected, atol=2e-6)
    tokens = draw(logits, n=n, **kw)
    assert set(tokens) <= set(np.flatnonzero(expected))
    assert total_variation_by_rank(tokens, expected) < 0.03
    beyond = np.argsort(-logits)[CANDIDATES:]  # drawn past the candidates as often as kept
    assert abs(np.isin(tokens, beyond).mean() - expected[beyond].sum()) < 0.015


def test_tied_tokens_are_kept_or_dropped_together():
    logits = np.array([3.0, 2.0, 2.0, 2.0, 1.0, 0.0], np.float32)
    got = set(draw(logits, temperature=1.0, top_k=2))
    assert got == {0, 1, 2, 3}  # three tied for second place: all kept, as transformers does
    np.testing.assert_allclose(kept_distribution(logits, 1.0, top_k=2),
                               np.asarray(token_probs(jnp.asarray(logits)[None],
                                                      jnp.ones(1), jnp.full(1, 2),
                                                      jnp.ones(1), jnp.zeros(1),
                                                      sampler="filtered"))[0], atol=1e-6)


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=5.0, top_p=0.99),
                                dict(temperature=1.0, min_p=0.0, top_k=CANDIDATES + 1)])
def test_masked_tokens_are_never_drawn(kw):
    """A logits processor's mask (-inf) leaves 5 tokens of a vocabulary past the
    candidates: every draw is one of them, whatever the filters."""
    logits = np.full(4 * CANDIDATES, -np.inf, np.float32)
    allowed = np.random.default_rng(2).choice(len(logits), 5, replace=False)
    logits[allowed] = np.random.default_rng(3).normal(size=5)
    got = set(draw(logits, n=2000, **kw))
    assert got == set(allowed)


def test_samplers_pick_the_cheapest_that_serves_the_batch():
    greedy, plain, top_k = SamplingParams(), SamplingParams(temperature=1), SamplingParams(
        temperature=1, top_k=5)
    assert sampler_for([greedy, greedy]) == "greedy"
    assert sampler_for([greedy, plain]) == "softmax"
    assert sampler_for([plain, top_k]) == "filtered"
    assert sampler_for([greedy, SamplingParams(top_k=5)]) == "greedy"  # filters unused at T=0


def test_seeded_rows_do_not_depend_on_batch(logits):
    """A row draws the same token alone and beside a greedy and a top-k row (400
    steps)."""
    a = SamplingParams(temperature=1.0, seed=7)
    others = [SamplingParams(), SamplingParams(temperature=1.0, seed=8, top_k=4)]
    rows = jnp.asarray(np.stack([logits, logits[::-1], logits[::2].repeat(2)]))
    sample = jax.jit(sample_rows)
    for step in range(400):
        together = sample(rows, SamplingBatch.build([a] + others, [step] * 3, 3))
        alone = sample(rows[:1], SamplingBatch.build([a], [step], 1))
        assert int(together[0]) == int(alone[0])


def test_a_draw_past_the_candidates_survives_rounding_noise():
    """A seeded row draws the same token when its logits move by rounding (1e-3: the
    engine's logits of a row batched with others differ from its logits alone by up to
    1.5e-3), also when the draw lands past the candidates, in the vocabulary's long tail
    (temperature 3 over the embedded model's 49,152 tokens: most draws do). A cumulative
    sum over the tail fails this: there any shift moves every later token's interval."""
    rng = np.random.default_rng(3)
    logits = rng.normal(size=49152).astype(np.float32)
    noisy = logits + rng.uniform(-1e-3, 1e-3, size=logits.shape).astype(np.float32)
    ranked = np.sort(logits)[::-1]
    tail_mass = np.exp(ranked[CANDIDATES:] / 3).sum() / np.exp(ranked / 3).sum()
    assert tail_mass > 0.5  # most draws past the candidates
    a, b = draw(logits, n=300, temperature=3.0), draw(noisy, n=300, temperature=3.0)
    assert (a != b).sum() <= 3


@pytest.mark.parametrize("kw, word", [
    ({"temperature": -1}, "temperature"), ({"top_k": -2}, "top_k"), ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"min_p": 2}, "min_p"), ({"max_tokens": 0}, "max_tokens"),
    ({"seed": -1}, "seed"), ({"stop": ("",)}, "stop"),
])
def test_invalid_values_are_refused(kw, word):
    with pytest.raises(InvalidRequestError, match=word):
        SamplingParams(**kw)


def test_generation_is_reproducible_per_seed(model):
    # EOS ignored: it is this raw prompt's likeliest first token (0.61 at this temperature)
    kw = dict(max_tokens=16, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    first = model.generate("Write a short poem about the sea.", **kw)
    again = model.generate("Write a short poem about the sea.", **kw)
    other = model.generate("Write a short poem about the sea.", **{**kw, "seed": 12})
    assert first.token_ids == again.token_ids
    assert first.token_ids != other.token_ids


def test_sampled_batch_equals_each_alone(model):
    prompts = ["Tell me about cats.", "List some fruits:"]
    kw = dict(max_tokens=12, temperature=1.0, top_k=40, seed=5)
    alone = [model.generate(p, **kw).token_ids for p in prompts]
    assert [r.token_ids for r in model.generate(prompts, **kw)] == alone


def test_stop_strings_and_max_tokens(model):
    full = model.generate("The capital of France is", max_tokens=12)
    assert full.finish_reason == "length" and len(full.token_ids) == 12
    stop = full.text[full.text.index("answer"):][:6]  # a string the greedy text contains
    cut = model.generate("The capital of France is", max_tokens=12, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[:full.text.index(stop)]
    assert stop not in cut.text


def test_stream_pieces_concatenate_to_the_result(model):
    result = []
    pieces = list(model.stream("Emoji test: 🙂 and more", max_tokens=20, stop=["\n\n"],
                               result=result))
    assert "".join(pieces) == result[0].text
    assert result[0].text == model.generate("Emoji test: 🙂 and more", max_tokens=20,
                                            stop=["\n\n"]).text


def test_early_finisher_in_a_batch_leaves_the_others_exact(model):
    """Decode runs one step ahead: a row that stops meanwhile must not disturb the rest."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    full = model.generate(prompts[0], max_tokens=16).text
    stop = full[full.index("answer"):][:6]  # ends the first row after a few tokens
    alone = [model.generate(prompts[0], max_tokens=16, stop=[stop]),
             model.generate(prompts[1], max_tokens=16, stop=[stop])]
    together = model.generate(prompts, max_tokens=16, stop=[stop])
    assert alone[0].finish_reason == "stop" and len(alone[0].token_ids) < 16
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert [r.text for r in together] == [r.text for r in alone]
    assert model.engine.kv.pool.num_available == model.engine.kv.pool.num_pages - 1
