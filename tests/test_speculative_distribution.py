"""Speculative decoding against the exact distribution of a model small enough to enumerate.

A 2-layer random Llama over 8 tokens (token 0 is EOS, which ends a sequence) gives the exact
probability of every continuation of up to 4 tokens after a fixed prompt. Exact speculative
decoding must reproduce it (sampled, with a real draft, a point-mass n-gram draft and with
top-k / top-p / min-p), and SMC-SD, run through `Model.generate` over 2,000 seeds, must give
unbiased weighted estimates of it at any particle count while the answer it returns is
biased at few particles, less so at more.

The statistics compare the three pair marginals (t1, t2), (t2, t3), (t3, t4) of the sampled
continuations (shorter ones padded after EOS) with the enumerated ones.
"""
import itertools

import numpy as np
import pytest

import xlr_jax
from xlr_jax.model.sampling_params import SamplingParams
from xlr_jax.speculative.config import SpecConfig

V, EOS = 8, 0
PROMPT = [1, 5, 2, 7, 3]
LENGTH = 4            # tokens enumerated: t1 from prefill, then drafts and bonus tokens
SMC_SEEDS = 2000
EXACT_SEEDS = 3000
Z_BOUND = 4.5         # per cell, ~55 cells: a false alarm below 1 in 2,000 under the CLT


def load(path, **kw):
    opts = dict(dtype="float32", params_cache=False, page_size=4, max_batch=64,
                prefill_chunk=16, max_context=128, num_pages=256)
    return xlr_jax.load_model(str(path), **{**opts, **kw})


def filtered(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The sampler's next-token distribution, written out in numpy: softmax at the
    temperature, then top-k, top-p (the smallest set reaching it) and min-p (relative to
    the top token), renormalized."""
    probs = np.exp((logits - logits.max()) / temperature)
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    sorted_p = probs[order]
    keep = np.ones(len(probs), bool)
    if top_k:
        keep[top_k:] = False
    keep &= np.cumsum(sorted_p) - sorted_p < top_p
    keep &= sorted_p >= min_p * sorted_p[0]
    keep[0] = True
    out = np.zeros_like(probs)
    out[order[keep]] = sorted_p[keep]
    return out / out.sum()


class Enumerated:
    """Every continuation of PROMPT up to LENGTH tokens (ending early at EOS) with its
    exact probability under `model` and the per-step distribution `dist(logits)`."""

    def __init__(self, model, prompt=PROMPT, dist=filtered):
        rows = {}
        for tail in itertools.product(range(V), repeat=LENGTH - 1):
            logits = model.logits(prompt + list(tail))[len(prompt) - 1:].astype(np.float64)
            for k in range(LENGTH):  # row k: the distribution of t_{k+1} after tail[:k]
                rows.setdefault(tail[:k], dist(logits[k]))
        self.probs: dict[tuple, float] = {}
        self._walk((), 1.0, rows)
        self.outcomes = list(self.probs)
        self.cells = sorted({c for o in self.outcomes for c in cells(o)})
        index = {c: i for i, c in enumerate(self.cells)}
        self.incidence = np.zeros((len(self.outcomes), len(self.cells)))
        for i, o in enumerate(self.outcomes):
            self.incidence[i, [index[c] for c in cells(o)]] = 1
        self.exact = np.array([self.probs[o] for o in self.outcomes]) @ self.incidence
        self._index = index

    def _walk(self, prefix, prob, rows):
        if len(prefix) == LENGTH or (prefix and prefix[-1] == EOS):
            self.probs[prefix] = prob
            return
        for t, p in enumerate(rows[prefix]):
            if p > 0:
                self._walk(prefix + (t,), prob * p, rows)

    def cell_vector(self, weighted_outcomes) -> np.ndarray:
        """Cell masses of [(token ids, weight), ...] (ids past LENGTH are ignored)."""
        out = np.zeros(len(self.cells))
        for ids, w in weighted_outcomes:
            for c in cells(tuple(ids[:LENGTH])):
                out[self._index[c]] += w
        return out

    def chi2(self, freq, n: int, floor: float = 0.005) -> float:
        """n * sum (f - P)^2 / P over the cells with P >= floor."""
        m = self.exact >= floor
        return float(n * np.sum((freq[m] - self.exact[m]) ** 2 / self.exact[m]))

    def chi2_null(self, n: int, draws: int = 2000, seed: int = 0) -> np.ndarray:
        """chi2 of `draws` samples of n exact draws each: the statistic's sampling noise."""
        rng = np.random.default_rng(seed)
        p = np.array([self.probs[o] for o in self.outcomes])
        counts = rng.multinomial(n, p / p.sum(), size=draws)
        return np.array([self.chi2(f, n) for f in counts @ self.incidence / n])


def cells(outcome: tuple) -> list[tuple]:
    padded = outcome + (-1,) * (LENGTH - len(outcome))
    return [(i, padded[i], padded[i + 1]) for i in range(LENGTH - 1)]


@pytest.fixture(scope="module")
def target(tiny_models):
    return load(tiny_models.target)


@pytest.fixture(scope="module")
def exact_p(target):
    return Enumerated(target)


# ---------------------------------------------------------------- exact speculative decoding

def run_batch(model, spec, n, prompt=PROMPT, **sampling):
    """n seeds of one prompt as one batched engine run (max_tokens = LENGTH)."""
    params = [SamplingParams(**{"temperature": 1.0, **sampling}, seed=s, max_tokens=LENGTH)
              for s in range(n)]
    spec = SpecConfig.parse(spec)
    draft = model._speculation(spec)[1]
    done = [r for _, _, r in model.engine.run([prompt] * n, params, spec=spec, draft=draft)
            if r is not None]
    assert len(done) == n
    return done


def frequencies(enum: Enumerated, results) -> np.ndarray:
    return enum.cell_vector((r.token_ids, 1 / len(results)) for r in results)


def test_exact_sampling_with_a_model_draft_is_the_target_distribution(tiny_models, target,
                                                                       exact_p):
    """gamma = 2 and 4 tokens: t1 from prefill, then one cycle with both draft positions
    and the bonus at position gamma (or the resample at a rejection)."""
    results = run_batch(target, {"draft": str(tiny_models.first_layer), "gamma": 2},
                        EXACT_SEEDS)
    kept = np.array([r.metrics["accepted_tokens"] for r in results if len(r.token_ids) > 1])
    assert (kept == 0).mean() > 0.05 and (kept == 2).mean() > 0.05  # every branch ran
    bound = np.quantile(exact_p.chi2_null(EXACT_SEEDS), 0.999)
    freq = frequencies(exact_p, results)
    assert exact_p.chi2(freq, EXACT_SEEDS) < bound
    # the draft's own distribution (what always accepting would give) is far outside it
    q = Enumerated(load(tiny_models.first_layer))
    assert q.chi2(frequencies(q, results), EXACT_SEEDS) > 3 * bound


@pytest.fixture(scope="module")
def target_int8(tiny_models):
    return load(tiny_models.target, weights="int8")


def test_a_4_bit_draft_for_an_8_bit_target_samples_the_target(tiny_models, target_int8):
    """Weights kept quantized: the target's matrices at 8 bits, its draft model's at 4
    (`draft_weights`); exact speculation samples the 8-bit target's own distribution."""
    spec = {"draft": str(tiny_models.first_layer), "gamma": 2, "draft_weights": "int4"}
    results = run_batch(target_int8, spec, EXACT_SEEDS)
    draft = target_int8._speculation(SpecConfig.parse(spec))[1]
    assert draft.params.layers[0].wqkv.format == "int4"
    assert target_int8.engine.runner.params.layers[0].wqkv.format == "int8"
    exact = Enumerated(target_int8)
    bound = np.quantile(exact.chi2_null(EXACT_SEEDS), 0.999)
    assert exact.chi2(frequencies(exact, results), EXACT_SEEDS) < bound
    kept = np.array([r.metrics["accepted_tokens"] for r in results if len(r.token_ids) > 1])
    assert (kept == 0).mean() > 0.05 and (kept == 2).mean() > 0.05


@pytest.mark.parametrize("sampling", [{"top_k": 3}, {"top_p": 0.7}, {"min_p": 0.2},
                                      {"top_k": 5, "top_p": 0.9, "min_p": 0.05,
                                       "temperature": 0.8}])
def test_exact_sampling_with_filters_is_the_filtered_target(target, sampling):
    """q and p are both filtered; the output follows the filtered target, which differs
    from the unfiltered one by far more than the noise."""
    enum = Enumerated(target, dist=lambda logits: filtered(logits, **sampling))
    results = run_batch(target, {"draft": "self:1", "gamma": 2}, EXACT_SEEDS, **sampling)
    bound = np.quantile(enum.chi2_null(EXACT_SEEDS), 0.999)
    assert enum.chi2(frequencies(enum, results), EXACT_SEEDS) < bound
    unfiltered = Enumerated(target, dist=lambda logits: filtered(
        logits, sampling.get("temperature", 1.0)))
    assert unfiltered.chi2(frequencies(unfiltered, results), EXACT_SEEDS) > 3 * bound


def test_exact_sampling_with_the_ngram_draft_is_the_target_distribution(target):
    """q is a point mass. The prompt holds every pair of tokens, so whatever t1 is, the
    lookup finds a 2-token match and proposes the 2 tokens after it."""
    prompt = _de_bruijn_pairs()
    enum = Enumerated(target, prompt=prompt)
    results = run_batch(target, {"draft": "ngram", "gamma": 2}, EXACT_SEEDS, prompt=prompt)
    proposed = [r for r in results if r.metrics["draft_tokens"]]
    assert len(proposed) > 0.9 * len([r for r in results if len(r.token_ids) > 1])
    rate = np.mean([r.metrics["acceptance_rate"] for r in proposed])
    assert 0.05 < rate < 0.95
    bound = np.quantile(enum.chi2_null(EXACT_SEEDS), 0.999)
    assert enum.chi2(frequencies(enum, results), EXACT_SEEDS) < bound


def _de_bruijn_pairs() -> list[int]:
    """A sequence over V tokens in which every ordered pair occurs (length V^2 + 1)."""
    seq, seen = [0], set()
    while len(seen) < V * V:
        nxt = next(t for t in range(V - 1, -1, -1) if (seq[-1], t) not in seen)
        seen.add((seq[-1], nxt))
        seq.append(nxt)
    return seq


# ---------------------------------------------------------------- SMC-SD

@pytest.fixture(scope="module")
def smc_runs(tiny_models, target):
    """SMC-SD through Model.generate, seeds 0..1999, N = 4 and 16 (the pool holds both), gamma
    2, 5 tokens (t1 from prefill, a whole cycle: 2 drafts and a bonus, then a bonus-only
    cycle). The draft is the target with its head scaled by 0.3: it proposes every token and
    its weights p / q stay bounded, so the noise bounds below hold, yet it is poor enough
    that 4 particles return visibly biased answers."""
    runs = {}
    for n in (4, 16):
        spec = {"method": "smc", "draft": str(tiny_models.flat_head), "gamma": 2,
                "particles": n, "min_agreement": 0}
        runs[n] = [target.generate(PROMPT, max_tokens=LENGTH + 1, temperature=1.0, seed=s,
                                   speculative=spec) for s in range(SMC_SEEDS)]
    return runs


def test_smc_on_quantized_weights_is_unbiased_for_the_target(tiny_models, target_int8):
    """SMC-SD with the target at 8 bits and its draft at 4: the weighted particles'
    estimates are unbiased for the 8-bit target's exact distribution (as with float
    weights below; 4 particles, 1,000 seeds)."""
    spec = {"method": "smc", "draft": str(tiny_models.flat_head), "gamma": 2,
            "particles": 4, "min_agreement": 0, "draft_weights": "int4"}
    runs = [target_int8.generate(PROMPT, max_tokens=LENGTH + 1, temperature=1.0, seed=s,
                                 speculative=spec) for s in range(SMC_SEEDS // 2)]
    exact = Enumerated(target_int8)
    z_hat = np.exp([r.metrics["log_normalizer"] for r in runs])
    est = np.stack([exact.cell_vector((ids, w * z) for ids, w in population(r))
                    for r, z in zip(runs, z_hat)])
    m = exact.exact >= 0.01
    z = (est.mean(0) - exact.exact)[m] / (est.std(0, ddof=1)[m] / np.sqrt(len(runs)))
    assert m.sum() > 40 and np.abs(z).max() < Z_BOUND, np.abs(z).max()
    assert sum(r.metrics["resamples"] for r in runs) > 0.1 * len(runs)


def population(r):
    """A result's final particles as (token ids, normalized weight); a request that ended
    at its first token (EOS) never had particles: it is its own single particle."""
    if r.particles is None:
        assert r.token_ids == [EOS]
        return [(r.token_ids, 1.0)]
    return [(p["token_ids"], np.exp(p["log_weight"])) for p in r.particles]


@pytest.mark.parametrize("n", [4, 16])
def test_smc_weighted_particles_are_unbiased_for_the_target(smc_runs, exact_p, n):
    """exp(log Z) * sum_i w_i [x_i in cell] is an unbiased estimate of the cell's exact
    probability at any N (SMC's normalizer is unbiased; here Z = 1): each cell with P >= 0.01
    within Z_BOUND standard errors (estimated across seeds), and exp(log Z) within Z_BOUND
    standard errors of 1."""
    runs = smc_runs[n]
    assert all(r.metrics["particles"] in ([], [n] * len(r.metrics["particles"]))
               for r in runs)
    assert sum(r.metrics["resamples"] for r in runs) > 0.1 * len(runs)
    z_hat = np.exp([r.metrics["log_normalizer"] for r in runs])
    est = np.stack([exact_p.cell_vector((ids, w * z) for ids, w in population(r))
                    for r, z in zip(runs, z_hat)])
    se = est.std(0, ddof=1) / np.sqrt(len(runs))
    m = exact_p.exact >= 0.01
    assert m.sum() > 40
    z = (est.mean(0) - exact_p.exact)[m] / se[m]
    assert np.abs(z).max() < Z_BOUND, np.abs(z).max()
    assert abs(z_hat.mean() - 1) < Z_BOUND * z_hat.std(ddof=1) / np.sqrt(len(runs))


def test_smc_answer_bias_shrinks_with_the_particle_count(smc_runs, exact_p):
    """The answer is one particle drawn by weight: biased toward the draft at finite N. Its
    chi2 excess over the noise's median measures the bias: at N = 4 it is beyond the 99.9th
    percentile of the noise, and at N = 16 less than half of that at N = 4."""
    null = exact_p.chi2_null(SMC_SEEDS)
    median, bound = np.median(null), np.quantile(null, 0.999)
    excess = {}
    for n, runs in smc_runs.items():
        answers = exact_p.cell_vector((r.token_ids, 1 / len(runs)) for r in runs)
        excess[n] = exact_p.chi2(answers, len(runs)) - median
    assert excess[4] > bound - median, excess
    assert excess[16] < 0.5 * excess[4], excess
