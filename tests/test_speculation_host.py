"""The host side of speculation without a model: what a verdict gives a request (tokens,
pages, metrics) and an SMC population that follows the free pages, on a real KV manager
and scheduler. The model's side is in tests/test_speculative_engine.py."""
import numpy as np
import pytest

from xlr_jax.model.sampling_params import SamplingParams
from xlr_jax.planning.mapper import SpeculativePolicy
from xlr_jax.runtime.request import Request
from xlr_jax.speculative.config import LayerDraft, NgramDraft, SpecConfig
from xlr_jax.speculative.outcome import Kept, Verdict
from xlr_jax.speculative.population import SmcRun, start_metrics
from xlr_jax.speculative.proposals import Proposal
from xlr_jax.speculative.runner import SpecRunner

from test_scheduler import CONTEXT, iterate, make_scheduler

POLICY = SpeculativePolicy(draft=None, gamma=4, particle_cap=4, rule="test")


def prefilled(s, spec, draft, prompt_len=8, **params):
    """A speculating request admitted and prefilled by the scheduler, its first token
    drawn."""
    r = Request(0, list(range(1, prompt_len + 1)),
                SamplingParams(max_tokens=12, ignore_eos=True, **params), s.kv.new_sequence(),
                None, CONTEXT, 0.0, (0, 0), spec, draft, start_metrics(spec))
    s.add(r)
    while not r.generated:
        iterate(s)
    return r


def test_a_verdict_keeps_its_drafts_and_gives_back_the_rest():
    s = make_scheduler()
    r = prefilled(s, SpecConfig(method="exact", draft="ngram", gamma=4), NgramDraft())
    spec = SpecRunner(s, None, s.buckets, POLICY)
    start, first = r.seq.length, r.generated[0]
    out = s.step([], None, [Proposal(r, [11, 12, 13])])
    assert out.tokens == [first, 11, 12, 13] and r.seq.length == start + 4
    reqs, pieces = spec.take_verified(out.verify, [Verdict(accepted=2, next=99)], now=1.0)
    assert reqs == [r] and r.generated == [first, 11, 12, 99]
    # the last token and two drafts are in the KV; the rejected one's position is not
    assert r.seq.length == start + 3 and len(r.seq.pages) == -(-(start + 3) // s.kv.page_size)
    assert {k: r.spec_metrics[k] for k in ("target_passes", "draft_tokens",
                                           "accepted_tokens")} == {
        "target_passes": 1, "draft_tokens": 3, "accepted_tokens": 2}
    assert spec.totals["accepted_tokens"] == 2


def pass_of(run, log_ratio):
    """A pass that keeps both drafts and a bonus token for every live particle, each
    draft weighing `log_ratio[j]` (log p - log q); the step's positions advanced."""
    for p in run.rows:
        p.seq.length += 3
    n = len(run.rows)
    log_q = np.zeros((n, 2))
    return Kept([[7, 8, 9]] * n, np.full(n, 2), np.repeat(np.asarray(log_ratio, float)[:, None],
                                                          2, 1), log_q, np.ones((n, 2)))


def test_an_smc_population_follows_the_free_pages_both_ways():
    s = make_scheduler(num_pages=64)
    spec = SpecConfig(method="smc", draft="self:2", gamma=2, min_agreement=0)
    r = prefilled(s, spec, LayerDraft(2), temperature=1.0, seed=0)
    run = SmcRun(r, cap=4)
    held, own = s.kv.available, len(r.seq.pages)
    # plenty of pages: split to the cap; the particles share the prompt's pages
    assert run.prepare(s.kv, s.kv.available)
    assert len(run.particles) == len(run.rows) == 4
    assert len({p.seq.pages[0] for p in run.particles}) == 1
    # one particle's drafts weigh far more: the next pass resamples onto it
    run.absorb(pass_of(run, [0.0, 0.0, 8.0, 0.0]))
    heavy = run.particles[2]
    assert run.log_w[2] == pytest.approx(16.0)
    assert run.prepare(s.kv, s.kv.available)
    assert run.watch.resamples == 1 and len(run.particles) == 4
    assert all(p.generated == heavy.generated for p in run.particles)
    assert np.all(run.log_w == 0)
    # a population that does not fit the rows it is offered is left as it is
    before = [p.seq for p in run.particles]
    assert not run.prepare(s.kv, s.kv.available, max_rows=4 * 3 - 1)
    assert [p.seq for p in run.particles] == before
    # no free pages: it shrinks to one particle and gives the others' pages back
    run.absorb(pass_of(run, [0.0] * 4))
    taken = s.kv.available
    assert run.prepare(s.kv, 0)
    assert len(run.particles) == 1 and run.single and run.method == "exact"
    assert s.kv.available > taken
    # its answer is that particle; its pages are all the population still holds
    chosen = run.conclude()
    assert chosen is run.particles[0] and r.finish_reason == chosen.finish_reason
    chosen.seq.release()
    assert s.kv.available == held + own
