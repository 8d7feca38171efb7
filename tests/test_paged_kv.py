"""The host page pool (refcounts, copy-on-write) and the compile-once-per-bucket rule."""
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xlr_jax import OutOfPagesError
from xlr_jax.kv.paged_kv import (PagedKV, copy_pages, page_values, quantize_kv, storage_dtype,
                                 write_layer, write_pages)
from xlr_jax.kv.pages import SCRATCH_PAGE, PagePool, SequencePages


def check_pool(pool: PagePool, seqs: list[SequencePages]) -> None:
    refs = Counter(p for s in seqs for p in s.pages)
    assert SCRATCH_PAGE not in refs
    for page in range(1, pool.num_pages):
        assert pool.refcounts[page] == refs.get(page, 0)
    free = list(pool._free)
    assert len(free) == len(set(free)) and not set(free) & set(refs)
    assert len(free) + len(refs) == pool.num_pages - 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["new", "grow", "fork", "release"]),
                          st.integers(0, 1000), st.integers(1, 40)), max_size=60))
def test_random_operations_keep_refcounts_consistent(ops):
    pool = PagePool(num_pages=24, page_size=8)
    seqs: list[SequencePages] = []
    for op, pick, n in ops:
        try:
            if op == "new" or not seqs:
                seq = SequencePages(pool)
                seq.reserve(n)
                seq.length = n
                seqs.append(seq)
            elif op == "grow":
                seq = seqs[pick % len(seqs)]
                before = list(seq.pages)
                copies = seq.reserve(seq.length + n)
                for src, dst in copies:  # copy-on-write replaced exactly the shared tail page
                    assert src == before[-1] and dst == seq.pages[len(before) - 1]
                seq.length += n
            elif op == "fork":
                seqs.append(seqs[pick % len(seqs)].fork())
            else:
                seqs.pop(pick % len(seqs)).release()
        except OutOfPagesError:
            pass  # all-or-nothing: the pool must still be consistent
        check_pool(pool, seqs)
    for seq in seqs:
        seq.release()
    assert pool.num_free == pool.num_pages - 1


def test_fork_then_append_copies_only_the_partial_page():
    pool = PagePool(num_pages=8, page_size=4)
    parent = SequencePages(pool)
    parent.reserve(6)
    parent.length = 6                      # pages [a, b], b half full
    a, b = parent.pages
    child = parent.fork()
    copies = child.reserve(7)               # child appends into shared b: private copy
    assert copies == [(b, child.pages[1])] and child.pages[1] != b
    assert child.pages[0] == a and pool.refcounts[a] == 2  # the full page stays shared
    assert parent.reserve(7) == []          # b is no longer shared: written in place
    assert parent.pages == [a, b] and pool.refcounts[b] == 1


def test_cow_device_copy_preserves_contents():
    kv = PagedKV.create(num_layers=2, num_kv_heads=2, head_dim=4, num_pages=6, page_size=4)
    rng = np.random.default_rng(0)
    kv = PagedKV(k=jnp.asarray(rng.normal(size=kv.k.shape), jnp.float32),
                 v=jnp.asarray(rng.normal(size=kv.v.shape), jnp.float32))
    before_k, before_v = np.asarray(kv.k), np.asarray(kv.v)
    kv = copy_pages(kv, jnp.array([2, 3]), jnp.array([5, 1]))
    k, v = np.asarray(kv.k), np.asarray(kv.v)
    np.testing.assert_array_equal(k[:, 5], before_k[:, 2])  # [layers, pages, ...]
    np.testing.assert_array_equal(v[:, 1], before_v[:, 3])
    np.testing.assert_array_equal(k[:, 4], before_k[:, 4])


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_quantized_pages_are_written_copied_and_restored_exactly(dtype):
    """write_layer stores each token's quantized values and scale at its page and offset
    and nothing else; copy_pages and write_pages move pages byte for byte (an fp8 pool is
    stored as its bytes on the CPU: see storage_dtype)."""
    rng = np.random.default_rng(1)
    kv = PagedKV.create(num_layers=2, num_kv_heads=3, head_dim=8, num_pages=6, page_size=4,
                        dtype=dtype)
    assert kv.k.dtype == storage_dtype(dtype)
    noise, _ = quantize_kv(jnp.asarray(rng.normal(size=kv.k.shape)), kv.k.dtype)
    kv = PagedKV(k=noise, v=kv.v, k_scale=kv.k_scale, v_scale=kv.v_scale)
    values_of = lambda pages: np.asarray(page_values(pages)).astype(np.float32)  # noqa: E731
    before = values_of(kv.k)
    values = jnp.asarray(rng.normal(size=(3, 3, 8)), jnp.float32)
    pages, offsets = jnp.array([2, 2, 5]), jnp.array([0, 3, 1])
    k, k_scale = jax.jit(write_layer, static_argnums=2)(kv.k, kv.k_scale, 1, pages, offsets,
                                                         values)
    stored, scale = quantize_kv(values, dtype)
    want = before.copy()
    want[1, [2, 2, 5], :, [0, 3, 1]] = np.asarray(stored).astype(np.float32)
    np.testing.assert_array_equal(values_of(k), want)
    np.testing.assert_array_equal(np.asarray(k_scale)[1, [2, 2, 5], :, [0, 3, 1]], scale)
    moved = copy_pages(PagedKV(k, kv.v, k_scale, kv.v_scale), jnp.array([2]), jnp.array([4]))
    np.testing.assert_array_equal(values_of(moved.k[:, 4]), want[:, 2])
    restored = write_pages(moved, jnp.array([3]), {"k": moved.k[:, 5:6], "v": moved.v[:, 5:6],
                                                    "k_scale": moved.k_scale[:, 5:6],
                                                    "v_scale": moved.v_scale[:, 5:6]})
    np.testing.assert_array_equal(values_of(restored.k[:, 3]), want[:, 5])


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's handling of fp8 arrays")
def test_an_fp8_pool_is_written_without_widening_the_whole_pool():
    """XLA:CPU scatters into an fp8 array by converting all of it to f16 and back (a
    1-token write into a 110 MB pool: 0.4 s); a pool's write must not."""
    pool = jax.ShapeDtypeStruct((2, 5, 3, 4, 8), storage_dtype(jnp.float8_e4m3fn))
    scales = jax.ShapeDtypeStruct((2, 5, 3, 4), jnp.float32)
    write = jax.jit(lambda p, s, v: write_layer(p, s, 1, jnp.array([2]), jnp.array([1]), v))
    hlo = write.lower(pool, scales, jax.ShapeDtypeStruct((1, 3, 8), jnp.float32)).compile()
    pool_typed = set(re.findall(r"\b(\w+)\[2,5,3,4,8\]", hlo.as_text()))
    assert pool_typed == {"u8"}, pool_typed


def test_out_of_pages_is_all_or_nothing():
    pool = PagePool(num_pages=4, page_size=4)
    seq = SequencePages(pool)
    with pytest.raises(OutOfPagesError, match="only 3 of 3"):
        seq.reserve(17)
    assert pool.num_free == 3 and seq.pages == []


def test_engine_shares_a_small_pool_on_need(tiny_models, cache_dir):
    """Room for barely one worst case: requests are admitted on need and preempt each
    other, each gives its solo tokens, and a max_tokens beyond the pool is not refused:
    the request runs until the pool is full."""
    import xlr_jax

    # 3 usable pages of 16; each request (3-5 prompt tokens + 14) may need 2 pages
    small = xlr_jax.load_model(str(tiny_models.target), dtype="float32", cache_dir=cache_dir,
                               num_pages=4, page_size=16, max_context=64)
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1], [6, 6, 2, 5]]
    alone = [small.generate(p, max_tokens=14, ignore_eos=True).token_ids for p in prompts]
    together = small.generate(prompts, max_tokens=14, ignore_eos=True)
    assert [r.token_ids for r in together] == alone
    assert small.engine.kv.pool.num_available == 3  # free, or cached and evictable
    long = small.generate(prompts, max_tokens=50, ignore_eos=True)  # 48 slots in the pool
    assert [r.finish_reason for r in long] == ["length"] * 3
    # the last token fed sits at position 47: one more is sampled, none fits after it
    assert all(len(r.token_ids) + r.metrics["prompt_tokens"] == 49 for r in long)
    assert [r.token_ids[:14] for r in long] == alone
    assert small.engine.kv.pool.num_available == 3
    assert small.generate(prompts[0], max_tokens=14, ignore_eos=True).token_ids == alone[0]


def test_each_step_compiles_once_per_bucket(tiny_models, cache_dir):
    """Random batches of random-length prompts compile no step shape beyond the plan's
    buckets (the bucketing is the model's shape-independent half: the tiny model)."""
    import xlr_jax

    model = xlr_jax.load_model(str(tiny_models.target), dtype="float32", cache_dir=cache_dir)
    engine = model.engine

    def workload():
        rng = np.random.default_rng(0)
        for _ in range(50):
            batch = int(rng.integers(1, 4))
            prompts = [rng.integers(1, 8, int(rng.integers(1, 300))).tolist()
                       for _ in range(batch)]
            model.generate(prompts, max_tokens=int(rng.integers(1, 4)))

    shapes = len(engine.runner.steps.keys())
    for _ in range(2):  # the second time prompts hit the prefix cache: shorter prefills
        workload()
        assert shapes // 2 < engine.runner.steps.compilations()["step"] <= shapes  # most, no more
