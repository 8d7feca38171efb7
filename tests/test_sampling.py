"""The pure sampler and the request-level sampling behaviour."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlr_jax import InvalidRequestError
from xlr_jax.model.sampling import SamplingBatch, SamplingParams, sample, sampler_for


def draw(logits, n=400, sampler=None, **kw):
    """Tokens drawn from one row of logits under n different steps."""
    params = SamplingParams(**kw)
    rows = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, len(logits)))
    batch = SamplingBatch.build([params] * n, list(range(n)), n)
    return np.asarray(sample(rows, batch, sampler=sampler or sampler_for([params])))


@pytest.fixture
def logits():
    return np.random.default_rng(0).normal(size=64).astype(np.float32) * 2


def test_greedy_is_argmax(logits):
    assert (draw(logits, n=8, temperature=0.0) == logits.argmax()).all()
    batch = SamplingBatch.build([SamplingParams()], [0], 1)
    assert int(sample(jnp.asarray(logits)[None], batch, sampler="greedy")[0]) == logits.argmax()


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


@pytest.mark.parametrize("sampler", ["softmax", "filtered"])
def test_temperature_matches_softmax_distribution(logits, sampler):
    n = 4000
    got = draw(logits, n=n, sampler=sampler, temperature=0.7)
    probs = np.asarray(jax.nn.softmax(jnp.asarray(logits) / 0.7))
    counts = np.bincount(got, minlength=len(logits)) / n
    assert 0.5 * np.abs(counts - probs).sum() < 0.05  # total variation


def test_samplers_pick_the_cheapest_that_serves_the_batch():
    greedy, plain, top_k = SamplingParams(), SamplingParams(temperature=1), SamplingParams(
        temperature=1, top_k=5)
    assert sampler_for([greedy, greedy]) == "greedy"
    assert sampler_for([greedy, plain]) == "softmax"
    assert sampler_for([plain, top_k]) == "filtered"
    assert sampler_for([greedy, SamplingParams(top_k=5)]) == "greedy"  # filters unused at T=0


def test_seeded_rows_do_not_depend_on_batch(logits):
    """Alone a row takes the softmax sampler; beside a top-k row, the sorting one. It
    draws the same token either way (400 steps)."""
    a = SamplingParams(temperature=1.0, seed=7)
    b = SamplingParams(temperature=1.0, seed=8, top_k=4)
    rows = jnp.asarray(np.stack([logits, logits[::-1]]))
    for step in range(400):
        together = sample(rows, SamplingBatch.build([a, b], [step, step], 2), sampler="filtered")
        alone = sample(rows[:1], SamplingBatch.build([a], [step], 1), sampler="softmax")
        assert int(together[0]) == int(alone[0])


@pytest.mark.parametrize("kw, word", [
    ({"temperature": -1}, "temperature"), ({"top_k": -2}, "top_k"), ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"min_p": 2}, "min_p"), ({"max_tokens": 0}, "max_tokens"),
    ({"seed": -1}, "seed"), ({"stop": ("",)}, "stop"),
])
def test_invalid_values_are_refused(kw, word):
    with pytest.raises(InvalidRequestError, match=word):
        SamplingParams(**kw)


def test_generation_is_reproducible_per_seed(model):
    kw = dict(max_tokens=16, temperature=0.9, top_p=0.95, seed=11)
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
    assert model.engine.pool.num_available == model.engine.pool.num_pages - 1
