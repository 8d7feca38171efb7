"""The prefix cache: shared pages by content, LRU eviction, pinned stable tiers, counters,
greedy outputs identical with the cache on and off on the embedded model, and admission that
never pins or restores pages promised to running requests."""
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import xlr_jax
from xlr_jax.kv.pages import PagePool, SequencePages
from xlr_jax.kv.prefix_cache import PrefixCache, chain_keys
from xlr_jax.kv.tier_store import TierStore

PS = 4


def pool_with_cache(num_pages=12):
    pool = PagePool(num_pages, PS)
    return pool, PrefixCache(pool, "ns")


def written(pool, tokens) -> SequencePages:
    """A sequence that wrote `tokens` (pages reserved; the device write is not needed here)."""
    seq = SequencePages(pool)
    seq.reserve(len(tokens))
    seq.length = len(tokens)
    return seq


def test_chain_keys_depend_on_the_whole_prefix():
    a = chain_keys("ns", [1, 2, 3, 4, 5, 6, 7, 8, 9], PS)
    b = chain_keys("ns", [0, 2, 3, 4, 5, 6, 7, 8], PS)
    assert len(a) == 2 and len(b) == 2
    assert a[0] != b[0] and a[1] != b[1]  # same second page, different parent
    assert chain_keys("other", [1, 2, 3, 4], PS)[0] != a[0]  # namespaces keep models apart


def test_match_shares_full_pages_and_leaves_one_token():
    pool, cache = pool_with_cache()
    tokens = list(range(10))
    seq = written(pool, tokens)
    cache.publish(tokens, seq.pages)
    pages, covered = cache.match(tokens + [99], limit=len(tokens))
    assert pages == seq.pages[:2] and covered == 8          # full pages only
    assert all(pool.refcounts[p] == 2 for p in pages)
    pages2, covered2 = cache.match(tokens[:8], limit=7)     # at least one token left to prefill
    assert covered2 == 4 and pages2 == seq.pages[:1]
    assert cache.match([5] + tokens[1:], limit=9) == ([], 0)  # differs in the first page


def test_released_pages_stay_cached_then_evict_in_lru_order():
    pool, cache = pool_with_cache(num_pages=7)              # 6 usable pages
    a, b = list(range(8)), list(range(100, 108))
    for tokens in (a, b):
        seq = written(pool, tokens)
        cache.publish(tokens, seq.pages)
        seq.release()
    assert pool.num_free == 2 and cache.evictable == 4 and pool.num_available == 6
    taken, _ = cache.match(a, limit=8)                       # a is used again: now newest
    for p in taken:
        pool.decref([p])
    fresh = pool.allocate(4)                                 # 2 free + the 2 oldest: b's
    assert len(fresh) == 4
    assert cache.match(b, limit=8) == ([], 0)
    pages, covered = cache.match(a, limit=8)
    assert covered == 8 and pages == taken


def test_pinned_stable_tier_is_never_evicted_until_unregistered():
    pool, cache = pool_with_cache(num_pages=6)              # 5 usable pages
    stable = list(range(6))                                  # a page and a half
    cache.register_stable(stable)
    tokens = stable + [50, 51, 52, 53, 54, 55]               # three full pages
    seq = written(pool, tokens)
    cache.publish(tokens, seq.pages, partial_at=len(stable))
    seq.release()
    assert cache.pinned_pages == 2 and cache.evictable == 1
    with pytest.raises(xlr_jax.OutOfPagesError):
        pool.allocate(5)                                     # pinned pages are not taken
    assert pool.allocate(3)                                  # the unpinned one is
    pages, covered = cache.match(stable + [7, 7], limit=7)   # stable hits in full, mid-page
    assert covered == 6 and len(pages) == 2
    for p in pages:
        pool.decref([p])
    cache.unregister_stable(stable)
    assert cache.pinned_pages == 0 and cache.evictable == 2
    assert len(pool.allocate(2)) == 2
    with pytest.raises(KeyError):
        cache.unregister_stable(stable)


def test_a_cached_partial_page_is_copied_before_writing():
    pool, cache = pool_with_cache()
    stable = list(range(6))
    owner = written(pool, stable + [9, 9, 9])
    cache.publish(stable + [9, 9, 9], owner.pages, partial_at=6)
    owner.release()
    seq = SequencePages(pool)
    seq.pages, seq.length = cache.match(stable + [1, 2, 3], limit=8)
    assert seq.length == 6 and pool.refcounts[seq.pages[-1]] == 1  # revived, sole user
    shared = seq.pages[-1]
    copies = seq.reserve(9)
    assert copies == [(shared, seq.pages[1])] and seq.pages[1] != shared
    assert cache.holds(shared) and pool.refcounts[shared] == 0


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["run", "pin", "unpin"]), st.integers(0, 3),
                          st.integers(1, 14)), max_size=40))
def test_random_traffic_keeps_the_pool_consistent(ops):
    """Refcounts match the running sequences; free, cached and used pages partition the pool;
    pinned pages are never evicted."""
    pool, cache = pool_with_cache(num_pages=10)
    prompts = [list(range(k * 50, k * 50 + 14)) for k in range(4)]
    running: list[SequencePages] = []
    for op, k, n in ops:
        tokens = prompts[k][:n]
        if op == "pin":
            cache.register_stable(tokens)
        elif op == "unpin" and tuple(tokens) in cache._tiers:
            cache.unregister_stable(tokens)
        else:
            seq = SequencePages(pool)
            seq.pages, seq.length = cache.match(tokens, limit=n - 1)
            try:
                seq.reserve(n)
                seq.length = n
                cache.publish(tokens, seq.pages, partial_at=n)  # as a finished sequence
                running.append(seq)
            except xlr_jax.OutOfPagesError:
                seq.release()
            if len(running) > 2:
                running.pop(0).release()
        used = {p for s in running for p in s.pages}
        for p in range(1, pool.num_pages):
            assert pool.refcounts[p] == sum(s.pages.count(p) for s in running)
        free, cached = set(pool._free), set(cache._keys_of)
        assert not free & used and not free & cached
        assert all(key in cache._page_of and key in cache._partials[parent]
                   for key, parent in cache._partial_parent.items())
        assert len(free) + len(cached | used) == pool.num_pages - 1
        # an idle cached page is either evictable or pinned by a registered tier
        assert all(cache._pinned(p) for p in cached - used if p not in cache._lru)


# ---------------------------------------------------------------- the embedded model

SYSTEM = ("You are a careful assistant for a small research lab. Answer briefly, cite the "
          "number you computed, and never invent data. ") * 6
HISTORY = ("Our lab measured the boiling point of water at three altitudes today: 100.0 C at "
           "sea level, 96.7 C at one thousand metres and 93.4 C at two thousand metres. ")


@pytest.fixture(scope="module")
def models(cache_dir):
    """The cache on and off, on the session's plan and cache folder: the steps other tests
    compiled are loaded, not compiled again (about 17 s each)."""
    kw = dict(dtype="float32", cache_dir=cache_dir)
    return xlr_jax.load_model("smollm2", **kw), xlr_jax.load_model("smollm2", prefix_cache=False, **kw)


def test_multi_turn_chat_identical_with_cache_on_and_off(models):
    cached, plain = models
    page = cached.plan.page_size
    # the first turn's prompt and answer fill a page past the stable tier: later turns
    # hit the history's pages too
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": HISTORY + "What is 7*6?"}]
    for turn in range(4):
        a, b = cached.chat(msgs, max_tokens=10), plain.chat(msgs, max_tokens=10)
        assert a.token_ids == b.token_ids, turn
        m = a.metrics
        assert m["prefilled_tokens"] + m["cached_tokens"] == m["prompt_tokens"]
        assert b.metrics["cached_tokens"] == 0
        if turn:
            assert m["stable_cached_tokens"] == m["stable_tokens"] > 0  # 100% from turn 2
            assert m["cached_tokens"] > m["stable_tokens"]               # history hits too
        msgs += [{"role": "assistant", "content": a.text},
                 {"role": "user", "content": f"And {turn + 2}*3?"}]
    assert m["stable_tokens"] % page != 0  # the stable tier ends mid-page, and still hit in full
    stats = cached.prefix_cache.stats()
    assert stats["requests"] == 4 and stats["stable_hit_rate"] == pytest.approx(3 / 4)
    assert stats["pages_pinned"] >= m["stable_tokens"] // page and stats["stable_tiers"] == 1
    assert plain.prefix_cache is None


def test_concurrent_sequences_share_a_cached_prefix(models):
    cached, plain = models
    prompts = [{"stable": SYSTEM, "volatile": f" Question {q}: {HISTORY} What is {q} plus {q}?"}
               for q in (3, 11)]
    cached.generate(prompts[0], max_tokens=2)  # publishes the stable tier
    both = cached.generate(prompts, max_tokens=12)
    ref = plain.generate(prompts, max_tokens=12)
    assert [r.token_ids for r in both] == [r.token_ids for r in ref]
    stable, page = both[0].metrics["stable_tokens"], cached.plan.page_size
    # the prompt fills the stable tier's last page, so its prefill published that page
    # (a shorter one leaves it to the tier's copy on disk, saved off the loop: a race)
    assert both[0].metrics["prompt_tokens"] >= -(-stable // page) * page
    assert all(r.metrics["stable_cached_tokens"] == stable for r in both)
    with pytest.raises(xlr_jax.InvalidRequestError, match="unknown prompt tier"):
        cached.generate({"stabel": "x"})


def test_requests_starting_together_prefill_their_stable_tier_once(models):
    """Agents starting at once on one new system prompt: the first prefills the stable tier;
    the others wait until it is published and share it, instead of each prefilling it again
    beside it. Outputs as with the cache off."""
    cached, plain = models
    system = "You schedule the lab's instrument time and answer in one line. " * 12
    prompts = [{"stable": system, "volatile": f" {HISTORY * 2} What is {q} plus {q}?"}
               for q in (2, 5, 9)]
    together = cached.generate(prompts, max_tokens=8)
    assert [r.token_ids for r in together] == \
        [r.token_ids for r in plain.generate(prompts, max_tokens=8)]
    stable = together[0].metrics["stable_tokens"]
    assert stable % cached.plan.page_size and together[0].metrics["stable_cached_tokens"] == 0
    assert all(r.metrics["stable_cached_tokens"] == stable for r in together[1:])


def test_a_prompt_tail_goes_in_smaller_chunks_with_the_same_tokens(models):
    """A 171-token prompt alone: 128 + 64 (two steps) at the CPU plan's step cost, one padded
    256 at step cost 0; the same tokens either way."""
    _, plain = models
    ids = [int(t) for t in np.random.default_rng(3).integers(100, 20_000, 171)]
    engine, runs = plain.engine, {}
    assert plain.plan.step_cost_tokens > 0
    try:
        for cost in (plain.plan.step_cost_tokens, 0):
            engine.scheduler.set_budget(step_cost_tokens=cost)
            before = plain.stats()["steps"]
            tokens = plain.generate(ids, max_tokens=4, ignore_eos=True).token_ids
            runs[cost] = tokens, plain.stats()["steps"] - before
    finally:
        engine.scheduler.set_budget(step_cost_tokens=plain.plan.step_cost_tokens)
    (split, split_steps), (padded, padded_steps) = runs.values()
    assert split == padded and split_steps == padded_steps + 1


def test_the_next_turn_starts_with_all_the_last_turn_wrote(models):
    """A finished request's last, partial page is indexed: a prompt that extends what it
    wrote (its prompt and every generated token but the last) finds all of it cached, not
    only its full pages; the same tokens as with the cache off."""
    cached, plain = models
    page = cached.plan.page_size
    rng = np.random.default_rng(5)
    ids = [int(t) for t in rng.integers(100, 20_000, 2 * page + 10)]
    first = cached.generate(ids, max_tokens=7, ignore_eos=True)
    wrote = ids + first.token_ids[:-1]
    assert len(wrote) % page
    follow = wrote + [int(t) for t in rng.integers(100, 20_000, 20)]
    second = cached.generate(follow, max_tokens=4, ignore_eos=True)
    assert second.metrics["cached_tokens"] == len(wrote)
    assert second.token_ids == plain.generate(follow, max_tokens=4, ignore_eos=True).token_ids


def test_tight_pool_evicts_cache_instead_of_failing(tiny_models, cache_dir):
    """Room for about two sequences: cached pages make way, outputs stay the same."""
    model = xlr_jax.load_model(str(tiny_models.target), dtype="float32", cache_dir=cache_dir,
                               page_size=16, max_context=256, num_pages=14, max_batch=2)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 8, 45).tolist() for _ in range(5)]
    first = [model.generate(p, max_tokens=8, ignore_eos=True).token_ids for p in prompts]
    again = [model.generate(p, max_tokens=8, ignore_eos=True).token_ids for p in prompts]
    assert first == again
    stats = model.prefix_cache.stats()
    assert stats["pages_free"] + stats["pages_evictable"] == 13
    assert stats["pages_cached"] < 5 * 3  # not everything could stay


def test_cli_switch_turns_the_cache_off(cache_dir):
    import subprocess
    import sys
    args = [sys.executable, "-m", "xlr_jax.cli", "generate", "--json", "--max-tokens", "4",
            "--cache-dir", str(cache_dir), "Hello there"]
    on = json.loads(subprocess.run(args, capture_output=True, text=True, timeout=600).stdout)
    off = json.loads(subprocess.run(args[:4] + ["--no-prefix-cache"] + args[4:],
                                    capture_output=True, text=True, timeout=600).stdout)
    assert on["token_ids"] == off["token_ids"] and "cached_tokens" in off["metrics"]


# ---------------------------------------------------------------- persistence and warm start

RUN = """
import json, logging, sys, xlr_jax
logging.basicConfig(level=logging.WARNING)
cache_dir, switch, stable = sys.argv[1:4]
m = xlr_jax.load_model(dtype="float32", cache_dir=cache_dir, prefix_cache=switch == "on")
r = m.generate({"stable": stable, "volatile": " Q: the capital of France? A:"}, max_tokens=8)
store = m.engine.kv.tier_store
if store:
    store.flush()
print(json.dumps({"ids": r.token_ids, "cached": r.metrics["cached_tokens"],
                  "page_size": m.plan.page_size,
                  "stable": r.metrics["stable_tokens"],
                  "loaded": store.loaded if store else 0,
                  "rejected": store.rejected if store else 0}))
"""
STABLE_A = "You are a careful assistant. Answer in one word. " * 12
STABLE_B = "You are a terse geography tutor. Reply with a city. " * 12


def run_process(cache_dir, switch, stable):
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", RUN, str(cache_dir), switch, stable],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def own_prefix_folder(tmp_path, cache_dir):
    """A cache folder whose prefix/ is this test's alone, with the rest of the session's
    (converted params, compiled steps: about a minute to compile again) linked in."""
    for part in cache_dir.iterdir():
        if part.name != "prefix":
            (tmp_path / part.name).symlink_to(part, target_is_directory=part.is_dir())
    return tmp_path


def test_stable_tier_survives_a_restart_and_bad_files_are_recomputed(tmp_path, cache_dir):
    tmp_path = own_prefix_folder(tmp_path, cache_dir)
    ref, _ = run_process(tmp_path, "off", STABLE_A)
    cold, _ = run_process(tmp_path, "on", STABLE_A)
    assert cold["ids"] == ref["ids"] and cold["cached"] == 0
    files = list((tmp_path / "prefix").glob("*.safetensors"))
    assert len(files) == 1 and not list((tmp_path / "prefix").glob("*.tmp*"))
    warm, _ = run_process(tmp_path, "on", STABLE_A)  # a new process: no prefill of the tier
    assert warm["ids"] == ref["ids"] and warm["loaded"] == 1
    page = warm["page_size"]
    assert warm["cached"] == warm["stable"] > page and warm["stable"] % page  # mid-page, in full

    good = files[0].read_bytes()
    garbled = bytearray(good)
    garbled[len(good) // 2] ^= 0xFF
    for damage in (good[:len(good) // 3], bytes(garbled)):
        files[0].write_bytes(damage)
        out, log = run_process(tmp_path, "on", STABLE_A)
        assert out["ids"] == ref["ids"] and out["rejected"] == 1 and out["cached"] == 0
        assert "ignoring stable-tier snapshot" in log
        assert files[0].read_bytes() != damage  # recomputed and written again

    ref_b, _ = run_process(tmp_path, "off", STABLE_B)
    run_process(tmp_path, "on", STABLE_B)
    (file_b,) = set((tmp_path / "prefix").glob("*.safetensors")) - set(files)
    file_b.write_bytes(good)  # tier A's (valid) snapshot under tier B's name
    out, log = run_process(tmp_path, "on", STABLE_B)
    assert out["ids"] == ref_b["ids"] and out["rejected"] == 1 and "another model or tier" in log


@pytest.mark.parametrize("num_pages,volatile_cached", [(8, False), (40, True)])
def test_volatile_pages_leave_the_cache_when_memory_is_tight(tiny_models, tmp_path, num_pages,
                                                            volatile_cached):
    # a cache folder of its own: no stable-tier snapshot from another test or parameter
    model = xlr_jax.load_model(str(tiny_models.target), dtype="float32", cache_dir=tmp_path,
                               page_size=16, max_context=128, num_pages=num_pages, max_batch=1)
    words = np.random.default_rng(0).integers(1, 8, 76)
    prompt = {"stable": " ".join(f"t{w}" for w in words[:36]),   # 2.25 pages
              "volatile": "".join(f" t{w}" for w in words[36:])}
    r = model.generate(prompt, max_tokens=8, ignore_eos=True)
    written = r.metrics["prompt_tokens"] + 7
    stable_pages = -(-r.metrics["stable_tokens"] // 16)  # its last page holds volatile too
    cached = model.prefix_cache.stats()["pages_cached"]
    # every page it wrote, the last one partial; or the stable tier's alone
    assert cached == (-(-written // 16) if volatile_cached else stable_pages)


# ---------------------------------------------------------------- pages promised to runners

PAGE = 4
TIER = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]  # a stable tier of 2.5 pages: its last page is partial


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A 2-layer random Llama over 32 tokens, saved as safetensors (prompts are token ids)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny") / "model"
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, intermediate_size=64,
                         vocab_size=32, max_position_embeddings=64, initializer_range=0.3,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).float().eval().save_pretrained(path, safe_serialization=True)
    return path


def load_tiny(path, cache_dir, **kw):
    return xlr_jax.load_model(str(path), dtype="float32", params_cache=False,
                              compile_cache=False, cache_dir=cache_dir, page_size=PAGE,
                              max_batch=4, prefill_chunk=16, max_context=32, **kw)


def idle_and_consistent(model, pinned: int) -> None:
    """No page is held after a run; the idle ones are free, evictable or pinned."""
    pool, cache = model.engine.kv.pool, model.prefix_cache
    assert not pool.refcounts.any()
    assert cache.pinned_pages == pinned
    assert pool.num_available + pinned == pool.num_pages - 1


@pytest.mark.parametrize("tier_in", ["cache", "snapshot"])
def test_a_newcomer_never_takes_pages_running_requests_need(tiny_dir, tmp_path, tier_in,
                                                           monkeypatch):
    """10 usable pages, less than the three requests' worst cases. A newcomer whose
    stable tier is cached (pinning takes its evictable pages) or on disk (restoring
    takes free pages) is admitted only beside a page for each running request's next
    token; when the pool runs short the newest request is preempted and resumes. No
    request fails, every output is its solo run's, and the pool's invariants hold after
    every step."""
    monkeypatch.setenv("XLR_DEBUG_CHECKS", "1")
    newcomer = {"stable": TIER, "volatile": [20, 21]}    # 12 + 15 tokens: 7 pages
    batch = [[7, 8, 9, 10, 11], [12, 13, 14, 15, 16],  # 5 + 15 tokens: 5 pages
             newcomer]                                  # admitted last
    kw = dict(max_tokens=15, ignore_eos=True)
    solo = load_tiny(tiny_dir, tmp_path / "solo", prefix_cache=False)
    expect = [solo.generate(p, **kw).token_ids for p in batch]
    model = load_tiny(tiny_dir, tmp_path / "cache", num_pages=11)
    if tier_in == "cache":  # the tier's full pages cached, not pinned (a context tier here)
        model.generate({"context": TIER, "volatile": [30, 31]}, max_tokens=1)
        assert model.prefix_cache.stats()["pages_evictable"] == 3
    else:  # an earlier engine saved the tier; a fresh one over the same cache_dir has it
        model.generate(newcomer, max_tokens=1)  # saves the tier
        model.engine.kv.tier_store.flush()
        model = load_tiny(tiny_dir, tmp_path / "cache", num_pages=11)
    done = model.generate(batch, **kw)
    assert [r.token_ids for r in done] == expect
    assert [r.finish_reason for r in done] == ["length"] * 3
    if tier_in == "snapshot":  # restored once it fitted: still a warm start (again after a
        assert model.engine.kv.tier_store.loaded >= 1  # preemption unpinned it and it was evicted)
        assert done[2].metrics["stable_cached_tokens"] == len(TIER)
    assert model.prefix_cache.registered() == [tuple(TIER)]
    idle_and_consistent(model, pinned=3)


def test_pinned_tiers_give_way_least_recently_used_first(tiny_dir, tmp_path):
    """Tiers may pin at most half the pool; a third tier unpins the least recently used.
    A request that needs more than the unpinned pages unpins the least recently used
    tier it needs (instead of waiting for ever or failing) and gives its solo tokens."""
    model = load_tiny(tiny_dir, tmp_path, num_pages=11)    # 10 usable pages, 5 pinnable
    tiers = [list(range(1, 9)), list(range(8, 0, -1)), list(range(9, 17))]  # 2 pages each
    for tier in tiers[:2]:
        model.generate({"stable": tier, "volatile": [30]}, max_tokens=1)
    model.generate({"stable": tiers[0], "volatile": [31]}, max_tokens=1)  # used again
    assert model.prefix_cache.registered() == [tuple(tiers[1]), tuple(tiers[0])]
    model.generate({"stable": tiers[2], "volatile": [30]}, max_tokens=1)  # 6 > 5 pages
    assert model.prefix_cache.registered() == [tuple(tiers[0]), tuple(tiers[2])]
    idle_and_consistent(model, pinned=4)
    prompt = list(range(17, 30))  # 13 + 14 tokens: 7 pages, 6 not pinned
    solo = load_tiny(tiny_dir, tmp_path / "solo", prefix_cache=False)
    assert model.generate(prompt, max_tokens=14, ignore_eos=True).token_ids == \
        solo.generate(prompt, max_tokens=14, ignore_eos=True).token_ids
    assert model.prefix_cache.registered() == [tuple(tiers[2])]
    idle_and_consistent(model, pinned=2)


def test_tier_snapshots_keep_to_their_disk_quota(tmp_path):
    """Past max_bytes, the least recently used snapshots go (a load counts as a use); the
    one just written stays even alone over the quota."""
    import os

    pages = {"k": np.arange(4096, dtype=np.float32).reshape(1, 4, 1024)}  # 16 KiB
    size = lambda: sum(p.stat().st_size for p in tmp_path.glob("*.safetensors"))  # noqa: E731
    store = TierStore(tmp_path, "ns", max_bytes=10 ** 9)
    for t in range(3):
        store.save_async([t], pages)
    store.flush()
    one = size() // 3
    for age, t in enumerate((2, 0, 1)):  # 2 is the oldest, then 0, then 1
        os.utime(store.path([t]), (1000 + age, 1000 + age))
    expect = {"k": (np.float32, (1, 4, 1024))}
    assert store.load([2], expect) is not None  # used now: the newest of the three
    store.max_bytes = 3 * one  # room for three: the fourth write evicts one
    store.save_async([3], pages)
    store.flush()
    assert not store.path([0]).exists() and store.evicted == 1
    assert all(store.path([t]).exists() for t in (1, 2, 3))
    store.max_bytes = one // 2  # not even the newest fits: it stays, alone
    store.save_async([4], pages)
    store.flush()
    assert [p.name for p in tmp_path.glob("*.safetensors")] == [store.path([4]).name]
