"""Speculative decoding in the engine: exact SD against AR, SMC-SD weights, particle counts and
fallback, page-pool consistency under rollback, refused requests. (The sampled distributions
are tested in test_speculative_distribution.py.)"""
import numpy as np
import pytest

import xlr_jax
from xlr_jax.errors import InvalidRequestError, PlanError
from xlr_jax.kv.pages import PagePool, SequencePages
from xlr_jax.loading.weights import read_config
from xlr_jax.planning.hardware import HardwareProfile
from xlr_jax.planning.mapper import draft_bytes
from xlr_jax.speculative.config import SpecConfig

PROMPT = [1, 5, 2, 7, 3]
CODE = ("Rename the variables to snake_case and return the code.\n"
        "def computeTotal(itemList):\n    totalValue = 0\n    for itemPrice in itemList:\n"
        "        totalValue += itemPrice\n    return totalValue\n")


def load(path, **kw):
    opts = dict(dtype="float32", params_cache=False, page_size=4, max_batch=64, prefill_chunk=16,
                max_context=128)
    return xlr_jax.load_model(str(path), **{**opts, **kw})


def log_softmax(x):
    x = x.astype(np.float64) - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_self_draft_equals_the_truncated_model_draft(tiny_models):
    """"self:1" is the target's first layer with its norm and head: the same draws as the
    separately saved 1-layer model for the same seeds."""
    target_dir, draft_dir = tiny_models.target, tiny_models.first_layer
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
    assert model.engine.kv.pool.refcounts.sum() == 0  # every page given back


def test_sampled_ngram_speculation_draws_what_plain_sampling_draws(model):
    """Point-mass drafts are accepted by matching the plain sampler's own draws
    (acceptance.accept_by_matching): a seeded n-gram request generates plain sampling's
    tokens exactly, alone (in its own cycles) and beside a plain stream (as rows of the
    stream's ragged steps: no cycle runs)."""
    spec = {"draft": "ngram", "gamma": 4}
    cycles = lambda: model.stats()["speculative"]["cycles"]  # noqa: E731
    for kw in ({"temperature": 0.8, "seed": 3}, {"temperature": 1.0, "top_p": 0.9, "seed": 5}):
        plain = model.generate(CODE, max_tokens=32, **kw)
        before = cycles()
        alone = model.generate(CODE, max_tokens=32, speculative=spec, **kw)
        assert alone.token_ids == plain.token_ids
        assert alone.metrics["accepted_tokens"] > 0 and cycles() > before
        stream = dict(max_tokens=96, ignore_eos=True, temperature=0.7, seed=9)
        solo_stream = model.generate("Tell me about the sea.", **stream)
        before = cycles()
        other = model.submit("Tell me about the sea.", **stream)
        beside = model.submit(CODE, max_tokens=32, speculative=spec, **kw).result()
        assert other.result().token_ids == solo_stream.token_ids
        assert beside.token_ids == plain.token_ids
        assert beside.metrics["accepted_tokens"] > 0 and cycles() == before
    assert model.engine.kv.pool.refcounts.sum() == 0


def test_device_drafts_verify_as_rows_beside_other_streams(model):
    """Beside a plain stream, a self:K request proposes in a draft pass of its own and
    verifies as rows of the stream's ragged steps (no cycle runs). Its drafts are judged
    with the keys its own cycle uses: the same tokens as alone (in cycles), greedy and
    seeded-sampled, and the stream's tokens are its tokens alone."""
    spec = {"draft": "self:26", "gamma": 3}
    cycles = lambda: model.stats()["speculative"]["cycles"]  # noqa: E731
    stream = dict(max_tokens=96, ignore_eos=True, temperature=0.7, seed=9)
    solo_stream = model.generate("Tell me about the sea.", **stream)
    for kw in ({"temperature": 0.0}, {"temperature": 0.8, "seed": 3}):
        before = cycles()
        alone = model.generate(CODE, max_tokens=24, speculative=spec, **kw)
        assert cycles() > before
        before = cycles()
        other = model.submit("Tell me about the sea.", **stream)
        beside = model.submit(CODE, max_tokens=24, speculative=spec, **kw).result()
        assert other.result().token_ids == solo_stream.token_ids
        assert beside.token_ids == alone.token_ids and cycles() == before
        assert beside.metrics["draft_tokens"] > 0
        assert beside.metrics["accepted_tokens"] == alone.metrics["accepted_tokens"]
    assert model.engine.kv.pool.refcounts.sum() == 0


def test_a_draft_model_verifies_as_rows_with_its_own_kv(tiny_models):
    """A separate draft model keeps its KV across draft passes and ragged steps: beside
    plain streams its seeded outputs equal its outputs alone."""
    target = load(tiny_models.target)
    spec = {"draft": str(tiny_models.flat_head), "gamma": 3}
    kw = dict(max_tokens=20, temperature=1.0, ignore_eos=True)
    cycles = lambda: target.stats()["speculative"]["cycles"]  # noqa: E731
    alone = [target.generate(PROMPT, seed=seed, speculative=spec, **kw) for seed in range(3)]
    before = cycles()
    streams = [target.submit(PROMPT[:3], seed=9, max_tokens=80, ignore_eos=True,
                             temperature=1.0) for _ in range(2)]
    beside = [target.submit(PROMPT, seed=seed, speculative=spec, **kw) for seed in range(3)]
    assert [h.result().token_ids for h in beside] == [r.token_ids for r in alone]
    assert all(h.result().metrics["accepted_tokens"] > 0 for h in beside)
    assert all(s.result().finish_reason == "length" for s in streams)
    assert cycles() == before
    assert target.engine.kv.pool.refcounts.sum() == 0


@pytest.mark.parametrize("min_agreement", [0, 0.01], ids=["smc", "probation-then-smc"])
def test_smc_particles_verify_as_rows_beside_other_streams(tiny_models, min_agreement):
    """Beside a plain stream, two SMC requests' particles propose in draft passes and
    verify as rows of the stream's ragged steps (no cycle runs), probation's one-particle
    exact cycles too: every answer, its particles and their weights are those of the
    request alone (in cycles), and the stream's tokens its own."""
    target = load(tiny_models.target)
    spec = {"method": "smc", "draft": str(tiny_models.flat_head), "gamma": 2,
            "particles": 2, "min_agreement": min_agreement}
    kw = dict(max_tokens=20, temperature=1.0, ignore_eos=True, speculative=spec)
    stream = dict(seed=9, max_tokens=90, ignore_eos=True, temperature=1.0)
    cycles = lambda: target.stats()["speculative"]["cycles"]  # noqa: E731
    solo_stream = target.generate(PROMPT[:3], **stream)
    alone = [target.generate(PROMPT, seed=seed, **kw) for seed in (1, 2)]
    before = cycles()
    other = target.submit(PROMPT[:3], **stream)
    beside = [h.result() for h in [target.submit(PROMPT, seed=seed, **kw) for seed in (1, 2)]]
    assert other.result().token_ids == solo_stream.token_ids
    assert cycles() == before, "a population ran a cycle of its own"
    for got, ref in zip(beside, alone):
        assert got.metrics["smc_cycles"] > 0 and got.metrics["smc_fallback"] is None
        assert got.token_ids == ref.token_ids
        assert [p["token_ids"] for p in got.particles] == [p["token_ids"] for p in ref.particles]
        assert np.allclose([p["log_weight"] for p in got.particles],
                           [p["log_weight"] for p in ref.particles], atol=1e-4)
        assert got.metrics["log_normalizer"] == pytest.approx(ref.metrics["log_normalizer"],
                                                              abs=1e-3)
    assert target.engine.kv.pool.refcounts.sum() == 0


def test_rows_or_a_cycle_as_measured(tiny_models):
    """A long-context exact request beside one plain stream verifies in cycles of its own
    (rows measured slower there: the plan's rows_up_to_context), beside three as rows; a
    short one as rows beside one. The same tokens every way."""
    target = load(tiny_models.target, max_context=1024)
    policy = target.plan.speculative
    spec = {"draft": "self:1", "gamma": 3}
    kw = dict(max_tokens=12, temperature=1.0, ignore_eos=True, seed=4, speculative=spec)
    cycles = lambda: target.stats()["speculative"]["cycles"]  # noqa: E731
    for prompt, streams, in_rows in (
            (PROMPT * 120, 1, False), (PROMPT * 120, policy.rows_from_streams, True),
            (PROMPT, 1, True)):
        assert (len(prompt) > policy.rows_up_to_context) != in_rows or streams > 1
        alone = target.generate(prompt, **kw)
        before = cycles()
        others = [target.submit(PROMPT[:3], seed=i, max_tokens=150, ignore_eos=True,
                                temperature=1.0) for i in range(streams)]
        beside = target.submit(prompt, **kw).result()
        assert all(h.result().finish_reason == "length" for h in others)
        assert beside.token_ids == alone.token_ids
        assert (cycles() == before) == in_rows
    assert target.engine.kv.pool.refcounts.sum() == 0


def test_ngram_speculation_compiles_once_per_bucket(model):
    spec = {"draft": "ngram", "gamma": 4}
    model.generate(CODE, max_tokens=16, speculative=spec)
    before = model.engine.runner.spec_steps.compilations()
    model.generate(CODE, max_tokens=16, speculative=spec)
    assert model.engine.runner.spec_steps.compilations() == before


def draft_positions(max_tokens: int, gamma: int) -> set[int]:
    """Indices (in the generated tokens) that an SMC particle's drafts fill: token 0 comes
    from prefill, then each cycle adds min(gamma, tokens left - 1) drafts and a bonus."""
    drafts, length = set(), 1
    while length < max_tokens:
        b = min(gamma, max_tokens - length - 1)
        drafts.update(range(length, length + b))
        length += b + 1
    return drafts


def test_smc_weights_are_the_log_ratios_of_the_drafts_kept(tiny_models):
    """Without resampling, each final particle's log-weight is the sum, over the draft tokens
    it kept up to its stop (EOS), of log p_target - log q_draft, both recomputed here from
    the two models' logits; bonus tokens and positions after a stop add nothing. The
    log-normalizer is log mean w."""
    target = load(tiny_models.target, num_pages=256)
    draft = load(tiny_models.first_layer)  # the "self:1" draft as a model of its own
    max_tokens, gamma = 8, 2
    positions = draft_positions(max_tokens, gamma)
    stopped_mid_cycle = 0
    for seed in range(12):
        r = target.generate(PROMPT, max_tokens=max_tokens, temperature=1.0, seed=seed,
                            speculative={"method": "smc", "draft": "self:1", "gamma": gamma,
                                         "particles": 4, "ess_threshold": 1e-6,
                                         "min_agreement": 0})
        if r.particles is None:  # EOS as the first token: no particles ever existed
            continue
        m = r.metrics
        assert m["resamples"] == 0 and m["particles"] == [4] * m["smc_cycles"]
        expected = []
        for p in r.particles:
            ids = p["token_ids"]
            lp = log_softmax(target.logits(PROMPT + ids)[len(PROMPT) - 1:])
            lq = log_softmax(draft.logits(PROMPT + ids)[len(PROMPT) - 1:])
            expected.append(sum(lp[k, ids[k]] - lq[k, ids[k]]
                                for k in positions if k < len(ids)))
            stopped_mid_cycle += ids[-1] == 0 and len(ids) - 1 in positions and \
                len(ids) in positions  # a later draft of the same cycle was dropped
        expected = np.array(expected)
        total = np.logaddexp.reduce(expected)
        np.testing.assert_allclose([p["log_weight"] for p in r.particles], expected - total,
                                   atol=2e-3)
        assert m["log_normalizer"] == pytest.approx(total - np.log(4), abs=2e-3)
    assert stopped_mid_cycle > 0
    assert target.engine.kv.pool.refcounts.sum() == 0


def test_smc_particle_count_follows_free_pages_both_ways(tiny_models):
    """A tight pool: N starts at the cap, falls as the particles' pages grow, and grows back
    (by splitting particles) when a resample onto few ancestors frees pages. Every request
    completes and every page comes back."""
    target = load(tiny_models.target, num_pages=26, max_batch=4)
    grew = 0
    for seed in range(4):
        r = target.generate(PROMPT, max_tokens=40, temperature=1.0, seed=seed, ignore_eos=True,
                            speculative={"method": "smc", "draft": "self:1", "gamma": 3,
                                         "particles": 4, "min_agreement": 0})
        counts = r.metrics["particles"]
        assert len(r.token_ids) == 40
        assert counts[0] == 4 and min(counts) < 4
        assert np.isfinite(r.metrics["log_normalizer"])
        grew += any(b > a for a, b in zip(counts, counts[1:]))
    assert grew > 0
    assert target.engine.kv.pool.refcounts.sum() == 0


def test_smc_falls_back_to_exact_speculation_with_a_poor_draft(model):
    """The first 8 of 30 layers agree too little with the target for SMC: the probation's
    exact cycles measure it, the request stays on exact speculation and says why. With
    min_agreement 0 (no probation) the same request runs SMC from its first cycle."""
    prompt = model.chat_prompt([{"role": "user", "content": "Tell me a story about a fox."}])
    spec = {"method": "smc", "draft": "self:8", "gamma": 4, "particles": 2}
    r = model.generate(prompt, max_tokens=32, temperature=0.8, seed=3, speculative=spec)
    m = r.metrics
    assert m["smc_fallback"] and "agreement" in m["smc_fallback"]
    assert m["draft_agreement"] < SpecConfig().min_agreement
    assert m["smc_cycles"] == 0 and set(m["particles"]) == {1}
    kept = model.generate(prompt, max_tokens=32, temperature=0.8, seed=3,
                          speculative={**spec, "min_agreement": 0})
    k = kept.metrics
    assert k["smc_fallback"] is None and k["draft_agreement"] is None
    assert set(k["particles"]) == {2} and k["smc_cycles"] == len(k["particles"])
    assert model.engine.kv.pool.refcounts.sum() == 0


def test_smc_particles_that_stop_early_end_cleanly(model):
    """Particles hit a stop string at different cycles and freeze; resampling may land on
    finished ones only. Every answer honours the stop and every page comes back."""
    stops = 0
    for seed in range(6):
        r = model.generate("List three fruits, one per line:\n1.", max_tokens=40,
                           temperature=1.0, seed=seed, stop=["\n"], speculative={
                               "method": "smc", "draft": "self:24", "gamma": 3, "particles": 4,
                               "min_agreement": 0})
        assert "\n" not in r.text and r.finish_reason in ("stop", "length")
        stops += r.finish_reason == "stop"
    assert stops > 0
    assert model.engine.kv.pool.refcounts.sum() == 0


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
    ({"method": "smc", "draft": "self:4"}, "set temperature > 0"),
    ({"method": "smc"}, "SMC-SD needs a draft that can propose every token"),
    ({"method": "smc", "draft": "ngram"}, "n-gram lookup proposes one fixed token"),
    ({"method": "smc", "draft": "self:4", "alpha": 2.0}, "alpha must be 1"),
    ({"min_agreement": 1.5}, "min_agreement must be in"),
])
def test_bad_speculative_requests_are_refused(model, spec, message):
    with pytest.raises(InvalidRequestError, match=message):
        model.generate("Hello", max_tokens=4, speculative=spec)
    assert model.generate("Hello", max_tokens=4).token_ids  # the engine still serves


def test_smc_refuses_filters_that_would_hide_tokens_from_the_draft(model):
    for kw in ({"top_k": 40}, {"top_p": 0.9}, {"min_p": 0.05}):
        with pytest.raises(InvalidRequestError, match="temperature only"):
            model.generate("Hello", max_tokens=4, temperature=0.8, **kw,
                           speculative={"method": "smc", "draft": "self:4"})
    assert model.generate("Hello", max_tokens=4).token_ids


def test_a_draft_with_another_vocabulary_is_refused(model, tiny_models):
    with pytest.raises(InvalidRequestError, match="must share the tokenizer"):
        model.generate("Hello", max_tokens=4, speculative={"draft": str(tiny_models.target)})


def test_a_draft_model_is_budgeted_from_the_plans_memory(tiny_models):
    """A draft model's weights and its KV over the target's pages come out of what the plan
    left: on a device with room for the target's pool and only half the draft, the draft is
    refused with the numbers and the model still serves; with room it loads."""
    def cpu(memory):
        return HardwareProfile("cpu", "test CPU", 1, int(memory), int(memory), None, 2, 30.0,
                               0.4, "table")

    roomy = load(tiny_models.target, hardware=cpu(4e9), num_pages=256)
    plan = roomy.plan
    spare = plan.memory.kv_budget_bytes - plan.num_pages * plan.memory.page_bytes
    need = draft_bytes(plan, read_config(tiny_models.flat_head), "draft")
    tight = load(tiny_models.target, hardware=cpu(4e9 - 2 * (spare - need // 2)), num_pages=256)
    spec = {"draft": str(tiny_models.flat_head), "gamma": 2}
    with pytest.raises(PlanError, match=r"draft model .* needs .* MB .* but only .* MB is left"):
        tight.generate(PROMPT, max_tokens=4, speculative=spec)
    assert tight.generate(PROMPT, max_tokens=4).token_ids
    assert len(roomy.generate(PROMPT, max_tokens=4, speculative=spec).token_ids) == 4


def test_benchmark_quick_writes_json_and_plot(tmp_path, cache_dir):
    """experiments/speculative_decoding.py --quick: every method of the quick grid runs,
    greedy exact SD equals greedy AR, sampled methods carry a log-likelihood, the SMC quality
    check compares plain sampling with SMC (fallback and forced), JSON + PNG."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "experiments/speculative_decoding.py"
    spec = importlib.util.spec_from_file_location("speculative_decoding", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.max_pair_repeats([5, 1, 2, 1, 2, 1, 2, 7]) == 3
    assert bench.max_pair_repeats([1, 2, 3]) == 1
    assert bench.main(["--quick", "--out", str(tmp_path), "--cache-dir", str(cache_dir)]) == 0
    (out,) = tmp_path.glob("speculative_decoding-*.json")
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert result["git"]["sha"] and result["environment"]["jax_version"]
    for w in result["workloads"].values():
        rows = w["methods"]
        assert {"ar_greedy", "ar_sampled", "exact_ngram_g4", "smc_self:20_n2_g4"} <= set(rows)
        for name, row in rows.items():
            assert row["decode_tokens_per_s"] > 0 and row["speedup_vs_ar"] > 0
            if row["mode"] == "greedy" and row["spec"]:
                assert row["equals_ar_greedy"], name
            if row["mode"] == "sampled":
                assert row["log_likelihood_per_token"] < 0
    assert set(result["targets"]["code_edit_best_speedup"]) == {"value", "min", "pass"}
    quality = result["smc_quality"]
    settings = quality["settings"]
    assert len(quality["plain"]) == len(settings["prompts"]) * len(settings["seeds"])
    forced = quality["drafts"]["smc_self:20_n2_forced"]
    assert forced["fallbacks"] == 0 and forced["ll_ratio_vs_plain"] > 0
    assert set(quality["drafts"]) == {"smc_self:20_n2_fallback", "smc_self:20_n2_forced"}


def test_the_benchmarks_derived_drafts_keep_or_perturb_the_sources_weights(tmp_path):
    """experiments/speculative_decoding.py's GGUF drafts, from a tiny 3-layer GGUF with Q8_0
    matrices: "truncated" holds the first 2 blocks, loaded to the source's values exactly;
    "noisy" untied, every matrix off by about its noise times its standard deviation
    (the head's own noise, not the embedding's), the norms as they were."""
    import importlib.util
    from pathlib import Path

    from tiny_gguf import write_tiny_gguf

    from xlr_jax.loading.weights import load_weights

    path = Path(__file__).resolve().parents[1] / "experiments/speculative_decoding.py"
    spec = importlib.util.spec_from_file_location("speculative_decoding", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    source = write_tiny_gguf(tmp_path / "source.gguf", layers=3, matrix_type="Q8_0")
    bench.write_derived_gguf(tmp_path / "cut.gguf", layers=2, source=str(source))
    bench.write_derived_gguf(tmp_path / "noisy.gguf", noise=0.1, source=str(source))
    whole = load_weights(source).params
    cut, noisy = (load_weights(tmp_path / f"{n}.gguf").params for n in ("cut", "noisy"))
    assert read_config(tmp_path / "cut.gguf").num_layers == 2
    for name, w in whole["layers"].items():
        np.testing.assert_array_equal(np.asarray(cut["layers"][name]), np.asarray(w)[:2])
    np.testing.assert_array_equal(cut["embed"], whole["embed"])
    assert "lm_head" not in whole and not read_config(tmp_path / "noisy.gguf").tie_embeddings
    for got, w in [(noisy["layers"]["wqkv"], whole["layers"]["wqkv"]),
                   (noisy["embed"], whole["embed"]), (noisy["lm_head"], whole["embed"])]:
        got, w = np.asarray(got), np.asarray(w)
        assert 0.08 < np.std(got - w) / np.std(w) < 0.12
    assert not np.array_equal(noisy["lm_head"], noisy["embed"])
    np.testing.assert_array_equal(noisy["layers"]["attn_norm"], whole["layers"]["attn_norm"])
