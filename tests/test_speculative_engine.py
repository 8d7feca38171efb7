"""Speculative decoding in the engine: exact SD against AR, its sampled distribution on a
tiny model, SMC-SD weights and particle counts, page-pool consistency under rollback."""
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import xlr_jax
from xlr_jax.errors import InvalidRequestError
from xlr_jax.paged_kv import PagePool, SequencePages
from xlr_jax.sampling import SamplingParams
from xlr_jax.speculative import SpecConfig

V = 8          # small enough to enumerate every 2-token continuation
PROMPT = [1, 5, 2, 7, 3]
CODE = ("Rename the variables to snake_case and return the code.\n"
        "def computeTotal(itemList):\n    totalValue = 0\n    for itemPrice in itemList:\n"
        "        totalValue += itemPrice\n    return totalValue\n")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer random Llama over 8 tokens and its first layer alone (the same weights,
    final norm and head), as directories; the 1-layer model is exactly "self:1"."""
    root = tmp_path_factory.mktemp("spec_models")
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=128,
                         vocab_size=V, max_position_embeddings=256, initializer_range=0.3,
                         tie_word_embeddings=False)
    target = LlamaForCausalLM(config).float().eval()
    target.save_pretrained(root / "target", safe_serialization=True)
    target.model.layers = target.model.layers[:1]
    target.config.num_hidden_layers = 1
    target.save_pretrained(root / "first_layer", safe_serialization=True)
    return root / "target", root / "first_layer"


def load(path, **kw):
    opts = dict(dtype="float32", params_cache=False, page_size=4, max_batch=64, prefill_chunk=16,
                max_context=128)
    return xlr_jax.load_model(str(path), **{**opts, **kw})


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def continuation_probs(model, prompt):
    """P[t1, t2, t3] of the next three tokens, enumerated from the model's logits."""
    p1 = softmax(model.logits(prompt)[-1])
    joint = np.zeros((V, V, V))
    for t1 in range(V):
        rows = softmax(np.stack([model.logits(prompt + [t1, t2])[-2:] for t2 in range(V)]))
        # rows[t2, 0] = P(t2 | t1) (the same for every t2), rows[t2, 1] = P(t3 | t1, t2)
        joint[t1] = p1[t1] * rows[0, 0][:, None] * rows[:, 1]
    return joint


def tv(a, b):
    return 0.5 * np.abs(a - b).sum()


def test_exact_sampling_matches_the_enumerated_target_distribution(tiny):
    """3,000 seeds, three tokens each (the first from prefill, then one speculative cycle
    with a real draft distribution q). The (t2, t3) joint over 64 outcomes must be within
    the 99.9th percentile of multinomial noise of the target's; the distribution one gets
    by always accepting the draft must lie outside it (so the check can fail)."""
    target_dir, draft_dir = tiny
    target, draft = load(target_dir), load(draft_dir)
    n = 3000
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=3) for s in range(n)]
    spec = SpecConfig(method="exact", draft=str(draft_dir), gamma=2)
    resolved = target._speculation(spec)[1]
    outs, rates = [], []
    for _, _, done in target.engine.run([PROMPT] * n, params, spec=spec, draft=resolved):
        if done is not None:
            outs.append(done.token_ids)
            rates.append(done.metrics["acceptance_rate"])
    assert len(outs) == n and all(len(o) == 3 for o in outs)
    assert 0.05 < np.mean(rates) < 0.95  # both acceptance and rejection were exercised
    got = np.zeros((V, V))
    for _, t2, t3 in outs:
        got[t2, t3] += 1 / n

    P = continuation_probs(target, PROMPT)
    expected = P.sum(0)
    rng = np.random.default_rng(0)
    noise = [tv(rng.multinomial(n, expected.ravel()) / n, expected.ravel()) for _ in range(2000)]
    threshold = np.quantile(noise, 0.999)
    assert tv(got, expected) < threshold

    # always accepting the draft: t2 ~ q(. | t1), then t3 ~ p(. | t1, t2)
    p1 = P.sum((1, 2))
    accept_all = np.zeros((V, V))
    for t1 in range(V):
        q2 = softmax(draft.logits(PROMPT + [t1])[-1])
        p3 = P[t1] / P[t1].sum(1, keepdims=True)
        accept_all += p1[t1] * q2[:, None] * p3
    assert tv(accept_all, expected) > 2 * threshold


def test_self_draft_equals_the_truncated_model_draft(tiny):
    """"self:1" is the target's first layer with its norm and head: the same draws as the
    separately saved 1-layer model for the same seeds."""
    target_dir, draft_dir = tiny
    target = load(target_dir)
    kw = dict(max_tokens=12, temperature=1.0, ignore_eos=True)
    for seed in range(3):
        a = target.generate(PROMPT, seed=seed, speculative={"draft": "self:1", "gamma": 3}, **kw)
        b = target.generate(PROMPT, seed=seed, speculative={"draft": str(draft_dir), "gamma": 3},
                            **kw)
        assert a.token_ids == b.token_ids
        assert a.metrics["draft_tokens"] > 0


def test_greedy_exact_speculation_equals_greedy_decoding(model):
    """Token for token on the embedded model, every draft, a batch of different prompts."""
    prompts = [CODE, "The capital of France is", CODE + "\n# The same code, renamed:\n"]
    ar = model.generate(prompts, max_tokens=24)
    for spec in ({"draft": "ngram", "gamma": 4}, {"draft": "self:12", "gamma": 3}):
        out = model.generate(prompts, max_tokens=24, speculative=spec)
        for a, b in zip(ar, out):
            assert b.token_ids == a.token_ids and b.text == a.text
            assert b.finish_reason == a.finish_reason
        passes = sum(r.metrics["target_passes"] for r in out)
        assert passes < sum(len(r.token_ids) - 1 for r in out)  # it did speculate
    assert model.engine.pool.refcounts.sum() == 0  # every page given back


def test_ngram_speculation_compiles_once_per_bucket(model):
    spec = {"draft": "ngram", "gamma": 4}
    model.generate(CODE, max_tokens=16, speculative=spec)
    before = model.engine.spec_steps.compilations()
    model.generate(CODE, max_tokens=16, speculative=spec)
    assert model.engine.spec_steps.compilations() == before


def test_smc_with_the_target_as_draft_keeps_equal_weights(tiny):
    """p_target / q_draft = 1 at every token: no resampling, log-normalizer 0."""
    target_dir, _ = tiny
    target = load(target_dir)
    r = target.generate(PROMPT, max_tokens=13, temperature=1.0, seed=1, speculative={
        "method": "smc", "draft": str(target_dir), "gamma": 3, "particles": 4})
    m = r.metrics
    assert len(r.token_ids) == 13 and r.finish_reason == "length"
    assert m["particles"] == [4] * m["target_passes"]
    assert m["resamples"] == 0 and abs(m["log_normalizer"]) < 1e-4
    assert m["accepted_per_pass"] == pytest.approx(4.0)  # gamma + 1 per pass
    assert target.engine.pool.refcounts.sum() == 0


def test_smc_particles_follow_free_pages(tiny):
    """A tiny page budget: N starts above 1, falls as the particles' pages grow, and the
    request still completes; a poor draft (one layer) makes it resample."""
    target_dir, _ = tiny
    target = load(target_dir, num_pages=26, max_batch=4)
    resamples = 0
    for seed in range(3):
        r = target.generate(PROMPT, max_tokens=40, temperature=1.0, seed=seed, speculative={
            "method": "smc", "draft": "self:1", "gamma": 3, "particles": "auto"})
        counts = r.metrics["particles"]
        assert len(r.token_ids) == 40
        assert counts[0] > 1 and min(counts[1:]) < counts[0]
        assert np.isfinite(r.metrics["log_normalizer"])
        resamples += r.metrics["resamples"]
    assert resamples > 0
    assert target.engine.pool.refcounts.sum() == 0


def test_smc_runs_on_the_embedded_model(model):
    r = model.generate(CODE, max_tokens=20, temperature=0.7, seed=0, speculative={
        "method": "smc", "draft": "ngram", "gamma": 4, "particles": 2})
    assert len(r.token_ids) <= 20 and r.text and r.metrics["target_passes"] >= 1
    assert set(r.metrics["particles"]) <= {1, 2}


def test_smc_particles_that_stop_early_end_cleanly(model):
    """Particles hit a stop string at different cycles and freeze; resampling may land on
    finished ones only. Every answer honours the stop and every page comes back."""
    stops = 0
    for seed in range(6):
        r = model.generate("List three fruits, one per line:\n1.", max_tokens=40,
                           temperature=1.0, seed=seed, stop=["\n"], speculative={
                               "method": "smc", "draft": "self:24", "gamma": 3, "particles": 4})
        assert "\n" not in r.text and r.finish_reason in ("stop", "length")
        stops += r.finish_reason == "stop"
    assert stops > 0
    assert model.engine.pool.refcounts.sum() == 0


def test_rollback_keeps_the_page_pool_consistent():
    """1,000 random cycles of reserve -> trim (rejections), forks (resampling) and releases:
    every page is free xor held, and its refcount is the number of sequences holding it."""
    rng = np.random.default_rng(0)
    pool = PagePool(64, 4)
    seqs = [SequencePages(pool)]
    for _ in range(1000):
        op = rng.random()
        if op < 0.15 and len(seqs) < 6:
            seqs.append(seqs[rng.integers(len(seqs))].fork())
        elif op < 0.25 and len(seqs) > 1:
            seqs.pop(rng.integers(len(seqs))).release()
        else:
            s = seqs[rng.integers(len(seqs))]
            gamma = int(rng.integers(0, 6))
            need = -(-(s.length + gamma + 1) // 4) - len(s.pages) + 1
            if need > pool.num_free or s.length + gamma + 1 > 60:
                s.trim(int(rng.integers(0, s.length + 1)))  # a long rollback frees pages
                continue
            s.reserve(s.length + gamma + 1)
            s.trim(s.length + int(rng.integers(0, gamma + 1)) + 1)
        held = np.zeros(64, np.int32)
        for s in seqs:
            assert len(s.pages) == -(-s.length // 4)
            np.add.at(held, s.pages, 1)
        free = list(pool._free)
        assert len(set(free)) == len(free) and 0 not in free
        np.testing.assert_array_equal(pool.refcounts, held)
        assert set(free) == {p for p in range(1, 64) if held[p] == 0}
    for s in seqs:
        s.release()
    assert pool.num_free == 63


@pytest.mark.parametrize("spec, message", [
    ({"method": "beam"}, "method must be one of"),
    ({"gamma": 0}, "gamma must be an integer"),
    ({"particles": 0}, "particles must be"),
    ({"ess_threshold": 1.5}, "ess_threshold"),
    ({"draft": "self:0"}, "K must be an integer"),
    ({"draft": "self:30"}, "K must be an integer"),
    ({"draft": "/no/such/model"}, "not \"ngram\""),
    ({"gama": 4}, "unknown speculative key"),
    ({"method": "smc"}, "set temperature > 0"),
])
def test_bad_speculative_requests_are_refused(model, spec, message):
    with pytest.raises(InvalidRequestError, match=message):
        model.generate("Hello", max_tokens=4, speculative=spec)
    assert model.generate("Hello", max_tokens=4).token_ids  # the engine still serves


def test_a_draft_with_another_vocabulary_is_refused(model, tiny):
    with pytest.raises(InvalidRequestError, match="must share the tokenizer"):
        model.generate("Hello", max_tokens=4, speculative={"draft": str(tiny[0])})


def test_benchmark_quick_writes_json_and_plot(tmp_path):
    """experiments/speculative_decoding.py --quick: every method of the quick grid runs,
    greedy exact SD equals greedy AR, sampled methods carry a log-likelihood, JSON + PNG."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "experiments/speculative_decoding.py"
    spec = importlib.util.spec_from_file_location("speculative_decoding", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    (out,) = tmp_path.glob("speculative_decoding-*.json")
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert result["git"]["sha"] and result["environment"]["jax_version"]
    for w in result["workloads"].values():
        rows = w["methods"]
        assert {"ar_greedy", "ar_sampled", "exact_ngram_g4", "smc_ngram_n2_g4"} <= set(rows)
        for name, row in rows.items():
            assert row["decode_tokens_per_s"] > 0 and row["speedup_vs_ar"] > 0
            if row["mode"] == "greedy" and row["spec"]:
                assert row["equals_ar_greedy"], name
            if row["mode"] == "sampled":
                assert row["log_likelihood_per_token"] < 0
    assert set(result["targets"]["code_edit_best_speedup"]) == {"value", "min", "pass"}
