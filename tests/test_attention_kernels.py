"""The Pallas paged-attention kernel (interpret mode on the CPU) against the XLA reference and
a dense float64 numpy attention.

Every case draws fresh random queries and pages (never zeros), scrambles the block tables and
lets sequences share pages; Pallas' interpreter fills outputs with NaN before the call, so an
output row the kernel forgot to write fails the finiteness check.

Tolerances, max |out - ref| / max |ref|:
  f32: 2e-5 against numpy float64 and between the two implementations (summation order only);
  bf16: 2e-2 against numpy on the same bf16 inputs (bf16 output rounding, probabilities cast to
  bf16 before the product with V);
  int8/fp8 pages: 2e-5 against numpy on the dequantized pages (dequantization is exact in f32).
"""
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import pallas as pl

from xlr_jax.bench.engines import random_params
from xlr_jax.kv.paged_kv import quantize_kv
from xlr_jax.model.config import ModelConfig
from xlr_jax.model.decoder import Params
from xlr_jax.model.sampling_params import SamplingParams
from xlr_jax.ops import cpu_attention, cpu_kernels, paged_attention
from xlr_jax.ops.pallas_attention import ragged_paged_attention_pallas
from xlr_jax.planning.hardware import probe
from xlr_jax.planning.mapper import Workload, plan
from xlr_jax.runtime.engine import Engine

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def poisoned_outputs():
    with pl.enable_poison_buffers(True):
        yield


def dense_attention(q, k, v, lengths, positions, window=None, softcap=None):
    """float64 numpy: q [B, L, H, D]; k, v [B, KVH, S, D] each sequence's cache in order;
    scores soft-capped (cap * tanh(s / cap)) with `softcap`."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, q_len, heads, dim = q.shape
    group = heads // k.shape[1]
    out = np.zeros(q.shape)
    cache_pos = np.arange(k.shape[2])
    for b in range(batch):
        for t in range(q_len):
            p = positions[b, t]
            seen = (cache_pos <= p) & (cache_pos < lengths[b])
            if window is not None:
                seen &= cache_pos > p - window
            if not seen.any():
                continue
            for h in range(heads):
                scores = k[b, h // group][seen] @ q[b, t, h] / np.sqrt(dim)
                if softcap is not None:
                    scores = softcap * np.tanh(scores / softcap)
                w = np.exp(scores - scores.max())
                out[b, t, h] = w @ v[b, h // group][seen] / w.sum()
    return out


def sequence_cache(pages, tables):
    """pages [N, KVH, ps, D] -> each sequence's cache [B, KVH, P * ps, D], in block-table order."""
    pages = np.asarray(pages.astype(jnp.float32), np.float64)
    gathered = pages[np.asarray(tables)]                     # [B, P, KVH, ps, D]
    b, p, kvh, ps, d = gathered.shape
    return gathered.transpose(0, 2, 1, 3, 4).reshape(b, kvh, p * ps, d)


def rel_err(out, ref) -> float:
    return float(np.abs(np.asarray(out, np.float64) - ref).max() / np.abs(ref).max())


def make_case(seed, *, batch, q_len, heads, kv_heads, head_dim, page_size, lengths,
              table_width, dtype=jnp.float32, shared=True):
    """Random pages, scrambled block tables (sequence 1 shares sequence 0's first pages)."""
    rng = np.random.default_rng(seed)
    num_pages = batch * table_width + 3
    shape = (num_pages, kv_heads, page_size, head_dim)
    k = jnp.asarray(rng.standard_normal(shape), dtype)
    v = jnp.asarray(rng.standard_normal(shape), dtype)
    tables = rng.permutation(num_pages)[:batch * table_width].reshape(batch, table_width)
    if shared and batch > 1:
        tables[1, :table_width // 2] = tables[0, :table_width // 2]
    lengths = np.asarray(lengths, np.int32)
    positions = lengths[:, None] - q_len + np.arange(q_len, dtype=np.int32)
    q = jnp.asarray(rng.standard_normal((batch, q_len, heads, head_dim)), dtype)
    return q, k, v, jnp.asarray(tables, jnp.int32), jnp.asarray(lengths), jnp.asarray(positions)


def check_both(q, k, v, tables, lengths, positions, *, window=None, softcap=None,
               dtype=jnp.float32):
    ref = dense_attention(q.astype(jnp.float32), sequence_cache(k, tables),
                          sequence_cache(v, tables), np.asarray(lengths), np.asarray(positions),
                          window, softcap)
    outs = {}
    for impl in ("pallas", "xla", "xla-blocked", "cpu"):
        out = paged_attention(q, (k, v), tables, lengths, positions, sliding_window=window,
                              softcap=softcap, **_impl_args(impl, tables))
        assert out.shape == q.shape and out.dtype == q.dtype
        assert np.isfinite(np.asarray(out.astype(jnp.float32))).all(), impl
        assert rel_err(out.astype(jnp.float32), ref) < TOL[dtype], impl
        outs[impl] = np.asarray(out.astype(jnp.float32))
    assert rel_err(outs["pallas"], outs["xla"]) < TOL[dtype]


def _impl_args(impl: str, tables) -> dict:
    """paged_attention's arguments for `impl`; "xla-blocked" walks the block table
    2 pages at a time (1 when its width is odd): the engine's ragged step path; "cpu" is
    the CPU kernel for f32 pages (every query length), that walk for the rest."""
    if impl == "cpu":
        return dict(impl="cpu", pages_per_block=2 if tables.shape[1] % 2 == 0 else 1)
    if impl == "xla-blocked":
        return dict(impl="xla", pages_per_block=2 if tables.shape[1] % 2 == 0 else 1)
    return dict(impl=impl)


def length_set(kind, page_size, table_width, q_len, batch, rng):
    full = page_size * table_width
    pick = {
        "one": lambda: q_len,
        "boundary": lambda: page_size * rng.integers(1, table_width) + rng.choice([-1, 0, 1]),
        "long": lambda: rng.integers(full - page_size, full + 1),
    }[kind]
    return [max(int(pick()), q_len) for _ in range(batch)]


# (page_size, head_dim, heads, kv_heads, q_len, lengths, dtype, sliding window)
CASES = [
    (8, 64, 4, 4, 1, "one", jnp.float32, None),        # GQA 1, a one-token cache
    (16, 64, 9, 3, 1, "boundary", jnp.float32, None),   # GQA 3 (SmolLM2), page boundary +-1
    (32, 128, 8, 2, 1, "long", jnp.float32, None),      # GQA 4, split-K over many pages
    (8, 128, 16, 2, 1, "long", jnp.bfloat16, None),     # GQA 8
    (16, 64, 8, 1, 1, "boundary", jnp.bfloat16, 20),    # window crossing pages
    (16, 128, 12, 4, 5, "boundary", jnp.float32, None),  # verify-sized multi-query
    (8, 64, 8, 2, 9, "long", jnp.float32, None),
    (32, 64, 6, 2, 3, "one", jnp.float32, None),         # cache holds just the new tokens
    (16, 64, 6, 6, 2, "long", jnp.bfloat16, None),
    (32, 128, 24, 3, 7, "long", jnp.bfloat16, 40),
    (8, 64, 32, 4, 4, "boundary", jnp.float32, 11),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "ps{}-d{}-h{}/{}-q{}-{}-{}-w{}".format(
    *c[:6], jnp.dtype(c[6]).name, c[7]))
def test_kernel_matches_references(case):
    page_size, head_dim, heads, kv_heads, q_len, kind, dtype, window = case
    rng = np.random.default_rng(zlib.crc32(repr(case[:6]).encode()))  # same in every process
    table_width = 6 if kind == "long" else 4
    lengths = length_set(kind, page_size, table_width, q_len, 3, rng)
    arrays = make_case(int(rng.integers(1 << 30)), batch=3, q_len=q_len, heads=heads,
                       kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
                       lengths=lengths, table_width=table_width, dtype=dtype)
    check_both(*arrays, window=window, dtype=dtype)


@settings(max_examples=8, deadline=None)
@given(st.sampled_from([8, 16, 32]), st.sampled_from([64, 128]), st.sampled_from([1, 3, 4, 8]),
       st.integers(1, 9), st.integers(1, 4), st.data())
def test_kernel_random_shapes(page_size, head_dim, ratio, q_len, batch, data):
    kv_heads = data.draw(st.integers(1, 3))
    table_width = data.draw(st.integers(1, 5))
    full = page_size * table_width
    lengths = [data.draw(st.integers(min(q_len, full), full)) for _ in range(batch)]
    q_len = min(q_len, min(lengths))
    arrays = make_case(data.draw(st.integers(0, 1 << 30)), batch=batch, q_len=q_len,
                       heads=ratio * kv_heads, kv_heads=kv_heads, head_dim=head_dim,
                       page_size=page_size, lengths=lengths, table_width=table_width)
    check_both(*arrays)


@pytest.mark.parametrize("q_len, window", [(1, None), (6, None), (1, 21), (6, 21)])
def test_soft_capped_scores_in_every_impl(q_len, window):
    """Gemma-2's cap * tanh(score / cap) on the scores, before the mask and the softmax,
    in every implementation (the CPU kernel leaves capped scores to the XLA walk): each
    matches the float64 reference, which the uncapped attention does not."""
    q, k, v, tables, lengths, positions = make_case(
        q_len + 50, batch=3, q_len=q_len, heads=8, kv_heads=2, head_dim=64, page_size=8,
        lengths=[61, 40, 17], table_width=8)
    q = q * 4  # scores of a few units: a cap of 2 changes them
    check_both(q, k, v, tables, lengths, positions, window=window, softcap=2.0)
    capped = dense_attention(q, sequence_cache(k, tables), sequence_cache(v, tables),
                             np.asarray(lengths), np.asarray(positions), window, 2.0)
    plain = paged_attention(q, (k, v), tables, lengths, positions, sliding_window=window)
    assert rel_err(plain, capped) > 0.05


@pytest.mark.parametrize("window", [None, 37])
def test_blocked_walk_reads_every_page_count_exactly(window):
    """The XLA walk of 2 decode rows over pieces of 12 pages, then 3, then single pages
    (a 24-page block shared by the rows), or, for a chunk, 4 unmasked pages at a time
    where every query sees them whole and 2 masked ones after (a scaled unmasked piece
    fails it), for every length from one slot to a 24-page table and rows of different
    lengths, and 2 decode rows over an 8-page table in pieces of 4, then single pages:
    each matches the dense reference."""
    from xlr_jax.ops.paged_attention import paged_attention_blocked, walk_sizes

    page_size = 4
    assert walk_sizes(24, 24, rows=2) == (12, 3, 1) and walk_sizes(8, 8, rows=2) == (4, 1)
    for q_len, width, block in ((1, 24, 24), (3, 24, 8), (1, 8, 8)):
        for first in range(q_len, page_size * width + 1, 3):
            lengths = [first, max(q_len, page_size * width - first + 1)]
            q, k, v, tables, lens, positions = make_case(
                first, batch=2, q_len=q_len, heads=6, kv_heads=2, head_dim=64,
                page_size=page_size, lengths=lengths, table_width=width)
            out = paged_attention_blocked(q, (k, v), tables, lens, positions,
                                          pages_per_block=block, sliding_window=window)
            ref = dense_attention(q, sequence_cache(k, tables), sequence_cache(v, tables),
                                  np.asarray(lens), np.asarray(positions), window)
            assert rel_err(out, ref) < TOL[jnp.float32], (q_len, lengths)


def cpu_kernel_cases(seed: int, target: str, *, q_len: int, head_dim: int,
                     lengths: list[int], shared: bool, page_size: int = 8,
                     table_width: int = 6):
    """Every group of 1 to 8 query heads a KV head, with and without a sliding window,
    through the CPU kernel built for `target` on the layer picked from a two-layer pool,
    against the float64 dense reference; the first row's last query is padding and gets
    zeros. The runtime's own build is reached through the entry point (impl="cpu")."""
    for group in range(1, cpu_attention.MAX_GROUP + 1):
        rng = np.random.default_rng(seed + group)
        for window in (None, 19):
            q, k, v, tables, lens, positions = make_case(
                int(rng.integers(1 << 30)), batch=len(lengths), q_len=q_len,
                heads=2 * group, kv_heads=2, head_dim=head_dim, page_size=page_size,
                lengths=lengths, table_width=table_width, shared=shared)
            positions = positions.at[0, -1].set(-1)  # a padding query: sees nothing
            assert cpu_attention.supports(q.shape, (k, v))
            pages = (jnp.stack([v, k]), jnp.stack([k, v]))
            if target == cpu_kernels.default_target():
                out = paged_attention(q, pages, tables, lens, positions, layer=1,
                                      sliding_window=window, impl="cpu")
            else:
                out = cpu_attention.attention(q, pages, tables, lens, positions, layer=1,
                                              sliding_window=window, target=target)
            ref = dense_attention(q, sequence_cache(k, tables), sequence_cache(v, tables),
                                  np.asarray(lens), np.asarray(positions), window)
            assert rel_err(out, ref) < TOL[jnp.float32], (group, window)
            assert not np.asarray(out[0, -1]).any()


@pytest.mark.parametrize("head_dim", cpu_attention.HEAD_DIMS)
def test_cpu_kernel_every_group_and_head_dim(head_dim, kernel_target):
    """Decode through the CPU kernel: rows of different lengths (one that sees nothing:
    zeros), shared and scrambled pages, partial pages."""
    cpu_kernel_cases(head_dim * 1000, kernel_target, q_len=1, head_dim=head_dim, lengths=[1, 9, 30, 47],
                     shared=True)


@pytest.mark.parametrize("q_len", [2, 5, 16, 37])
def test_cpu_kernel_folds_blocks_of_queries(q_len, kernel_target):
    """Several queries a row (a prefill chunk, verify rows) through the CPU kernel: with
    few query vectors (2 queries of up to 5 heads), blocks of queries fold the slots they
    all see together and the causal diagonal and a window's edge query by query; with
    more, tiles of a vector's lanes of query vectors mask each lane's slots, a tile's
    vectors spanning queries (groups that do not divide the lanes) and a short last tile;
    two rows on pages of their own."""
    cpu_kernel_cases(q_len * 100, kernel_target, q_len=q_len, head_dim=64, lengths=[q_len + 3, q_len + 30],
                     shared=False)


def test_cpu_kernel_takes_a_long_chunk_in_tiles(kernel_target):
    """A 150-token chunk (a prefill chunk's shape): many tiles a row and KV head, each
    walking a dozen 16-slot pages with the diagonal and a window's edge inside them."""
    cpu_kernel_cases(7, kernel_target, q_len=150, head_dim=64, lengths=[170, 190], shared=False,
                     page_size=16, table_width=12)


def test_cpu_kernel_declines_what_it_does_not_take():
    """Quantized pages, bf16 pages and a head dim outside its list take the XLA walk; a
    whole 256-token chunk takes the kernel."""
    q, k, v, *_ = make_case(4, batch=1, q_len=1, heads=4, kv_heads=2, head_dim=64,
                            page_size=8, lengths=[5], table_width=1)
    assert cpu_attention.supports(q.shape, (k, v))
    assert not cpu_attention.supports(q.shape, (k, v), kv_scales=(k[..., 0], v[..., 0]))
    assert not cpu_attention.supports(q.shape, (k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)))
    assert not cpu_attention.supports((1, 1, 4, 48), (k[..., :48], v[..., :48]))
    assert not cpu_attention.supports((1, 1, 18, 64), (k, v))  # 9 query heads a KV head
    assert cpu_attention.supports((1, 256, 4, 64), (k, v))


def test_padding_query_that_sees_nothing_is_zero():
    q, k, v, tables, lengths, positions = make_case(
        3, batch=2, q_len=4, heads=4, kv_heads=2, head_dim=64, page_size=16,
        lengths=[20, 37], table_width=3)
    positions = positions.at[1, 1].set(-1)  # sees no cache position
    for impl in ("pallas", "xla", "xla-blocked"):
        out = paged_attention(q, (k, v), tables, lengths, positions, **_impl_args(impl, tables))
        assert np.all(np.asarray(out[1, 1]) == 0), impl
        assert np.abs(np.asarray(out[1, 0])).max() > 0.1, impl


def test_query_past_the_cache_end_sees_only_the_cache():
    """Prefill pads rows past a sequence's length; they must not read slots beyond it."""
    q, k, v, tables, lengths, positions = make_case(
        4, batch=2, q_len=3, heads=6, kv_heads=2, head_dim=64, page_size=8,
        lengths=[21, 30], table_width=5)
    positions = positions.at[0, 2].set(35).at[1, 0].set(39)
    check_both(q, k, v, tables, lengths, positions)


def test_ragged_queries_by_cumulative_lengths():
    """Sequences with 3, 0, 5 and 1 new tokens packed into one [tokens, H, D] array."""
    rng = np.random.default_rng(7)
    q_lens = np.array([3, 0, 5, 1])
    lengths = np.array([40, 17, 64, 9], np.int32)
    _, k, v, tables, _, _ = make_case(8, batch=4, q_len=1, heads=9, kv_heads=3, head_dim=64,
                                      page_size=16, lengths=lengths, table_width=4)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((int(cu[-1]), 9, 64)), jnp.float32)
    # the same queries padded to [batch, 5], each sequence's last tokens
    pad_q = np.zeros((4, 5, 9, 64))
    pad_pos = np.full((4, 5), -1)
    for b in range(4):
        pad_q[b, :q_lens[b]] = q[cu[b]:cu[b + 1]]
        pad_pos[b, :q_lens[b]] = lengths[b] - q_lens[b] + np.arange(q_lens[b])
    ref = dense_attention(pad_q, sequence_cache(k, tables), sequence_cache(v, tables),
                          lengths, pad_pos)
    ref = np.concatenate([ref[b, :q_lens[b]] for b in range(4)])
    for impl in ("pallas", "xla"):
        out = paged_attention(q, (k, v), tables, jnp.asarray(lengths), cu_q_lens=jnp.asarray(cu),
                              max_q_len=5, impl=impl)
        assert out.shape == q.shape
        assert rel_err(out, ref) < TOL[jnp.float32], impl


def test_speculative_verify_particles_share_prefix_pages():
    """N=8 particles, gamma+1 = 5 tokens each, over a shared 3-page prefix plus a private page."""
    rng = np.random.default_rng(11)
    n, page_size, prefix = 8, 16, 3
    k = jnp.asarray(rng.standard_normal((prefix + n + 1, 3, page_size, 64)), jnp.float32)
    v = jnp.asarray(rng.standard_normal(k.shape), jnp.float32)
    shared = rng.permutation(np.arange(1, prefix + n + 1))
    tables = np.stack([np.concatenate([shared[:prefix], [shared[prefix + i]]])
                       for i in range(n)]).astype(np.int32)
    lengths = np.full(n, prefix * page_size + 5, np.int32)
    positions = lengths[:, None] - 5 + np.arange(5)
    q = jnp.asarray(rng.standard_normal((n, 5, 9, 64)), jnp.float32)
    check_both(q, k, v, jnp.asarray(tables), jnp.asarray(lengths), jnp.asarray(positions))


@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_quantized_pages(kv_dtype):
    q, k, v, tables, lengths, positions = make_case(
        5, batch=3, q_len=3, heads=8, kv_heads=2, head_dim=64, page_size=16,
        lengths=[50, 64, 23], table_width=4)
    (kq, ks), (vq, vs) = quantize_kv(k, kv_dtype), quantize_kv(v, kv_dtype)
    assert kq.dtype == kv_dtype and ks.shape == k.shape[:-1]
    dequant = lambda x, s: np.asarray(x.astype(jnp.float32)) * np.asarray(s)[..., None]  # noqa
    k_deq, v_deq = dequant(kq, ks), dequant(vq, vs)
    exact = dense_attention(q, sequence_cache(k_deq, tables), sequence_cache(v_deq, tables),
                            np.asarray(lengths), np.asarray(positions))
    original = dense_attention(q, sequence_cache(k, tables), sequence_cache(v, tables),
                               np.asarray(lengths), np.asarray(positions))
    for impl in ("pallas", "xla", "xla-blocked"):
        out = paged_attention(q, (kq, vq), tables, lengths, positions, kv_scales=(ks, vs),
                              **_impl_args(impl, tables))
        assert rel_err(out, exact) < TOL[jnp.float32], impl
        # quantization error is real but small (int8 ~1%, fp8 e4m3 ~5%)
        assert 1e-4 < rel_err(out, original) < 0.1, impl


def test_stacked_layers_read_in_place():
    """kv_pages may be every layer's pool with `layer` naming one (no slice copy in the kernel)."""
    q, k, v, tables, lengths, positions = make_case(
        9, batch=2, q_len=2, heads=4, kv_heads=2, head_dim=64, page_size=8,
        lengths=[30, 17], table_width=4)
    k_all, v_all = jnp.stack([v, k, k]), jnp.stack([k, v, k])
    for impl in ("pallas", "xla", "xla-blocked", "cpu"):
        args = _impl_args(impl, tables)
        one = paged_attention(q, (k, v), tables, lengths, positions, **args)
        out = paged_attention(q, (k_all, v_all), tables, lengths, positions, layer=1, **args)
        np.testing.assert_allclose(np.asarray(out), np.asarray(one), rtol=1e-6, atol=1e-6)


def test_entry_point_rejects_bad_arguments():
    q, k, v, tables, lengths, positions = make_case(
        1, batch=1, q_len=1, heads=4, kv_heads=2, head_dim=64, page_size=8,
        lengths=[5], table_width=1)
    with pytest.raises(ValueError, match="unknown attention impl"):
        paged_attention(q, (k, v), tables, lengths, positions, impl="triton")
    with pytest.raises(ValueError, match="q_positions"):
        paged_attention(q, (k, v), tables, lengths)


# ---------------------------------------------------------------- the model through either impl

TINY = ModelConfig(architecture="llama", vocab_size=512, hidden_size=128, num_layers=2,
                   num_heads=6, num_kv_heads=2, head_dim=32, intermediate_size=256,
                   rms_norm_eps=1e-5, rope_theta=10000.0, max_context=256,
                   tie_embeddings=False)


def tiny_engine(params: Params, config=TINY, attn_impl="xla", kv_dtype=None) -> Engine:
    """An engine of 24 16-token pages, 2 rows, 32-token chunks; XLA's weight products."""
    p = plan(probe(), config, Workload(max_batch=2, prefill_chunk=32,
                                       max_context=config.max_context),
             page_size=16, num_pages=24, attn_impl=attn_impl, linear_impl="xla",
             kv_dtype=None if kv_dtype is None else jnp.dtype(kv_dtype).name)
    return Engine(config, params, None, p)


@pytest.fixture(scope="module")
def tiny_params():
    # weights at 10x the default scale, so attention is sharp and a wrong read moves the logits
    params = random_params(TINY, jnp.float32, seed=3)
    return jax.tree.map(lambda a: a * 10 if a.ndim == 2 else a, params)


def windowed(config: ModelConfig, window) -> ModelConfig:
    """`config` with no window, or a window of 24 on layer 0 only (as Gemma's windowed
    layers between global ones) with a RoPE base of its own."""
    if window is None:
        return config
    return ModelConfig(**{**config.__dict__, "architecture": "mistral", "sliding_window": 24,
                          "window_layers": (0,), "rope_local_theta": 100.0})


@pytest.mark.parametrize("window", [None, "24 on layer 0"])
def test_model_logits_same_through_either_impl(tiny_params, window):
    """Chunked prefill over a cached prefix (70 tokens in chunks of 32), then greedy decode."""
    config = windowed(TINY, window)
    ids = [int(t) for t in np.random.default_rng(1).integers(0, 512, 70)]
    logits, tokens = {}, {}
    for impl in ("pallas", "xla"):
        engine = tiny_engine(tiny_params, config, attn_impl=impl)
        logits[impl] = engine.logits(ids)
        done = [r for _, _, r in engine.run([ids], [SamplingParams(max_tokens=6, ignore_eos=True)])
                if r is not None]
        tokens[impl] = done[0].token_ids
    assert rel_err(logits["pallas"], logits["xla"]) < 1e-4
    assert tokens["pallas"] == tokens["xla"]


@pytest.mark.parametrize("window", [None, "24 on layer 0"])
def test_model_decodes_the_same_through_the_cpu_kernel(window, cpu_kernels_on):
    """Two prompts decoding side by side (2-row decode steps, 60 tokens each past a
    40-token prompt: pages fill and the window slides) through the CPU kernel and through
    the XLA walk: the same greedy tokens, log-probabilities within 1e-4."""
    config = windowed(ModelConfig(**{**TINY.__dict__, "head_dim": 64}), window)
    params = jax.tree.map(lambda a: a * 10 if a.ndim == 2 else a,
                          random_params(config, jnp.float32, seed=5))
    rng = np.random.default_rng(6)
    prompts = [[int(t) for t in rng.integers(0, 512, n)] for n in (40, 23)]
    sampling = [SamplingParams(max_tokens=60, ignore_eos=True, logprobs=0)] * 2
    done = {}
    for impl in ("xla", "cpu"):
        engine = tiny_engine(params, config, attn_impl=impl)
        done[impl] = dict((i, r) for i, _, r in engine.run(prompts, sampling) if r is not None)
        assert sorted(done[impl]) == [0, 1]
    for i in (0, 1):
        a, b = done["xla"][i], done["cpu"][i]
        assert len(a.token_ids) == 60 and a.token_ids == b.token_ids
        np.testing.assert_allclose([x["logprob"] for x in a.logprobs],
                                   [x["logprob"] for x in b.logprobs], atol=1e-4)


# logits error of quantized KV on this sharp random model: int8 measured 0.06, fp8 e4m3 0.20
@pytest.mark.parametrize("kv_dtype,bound", [(jnp.int8, 0.1), (jnp.float8_e4m3fn, 0.3)])
def test_model_with_quantized_kv(tiny_params, kv_dtype, bound):
    ids = [int(t) for t in np.random.default_rng(2).integers(0, 512, 50)]
    full = tiny_engine(tiny_params).logits(ids)
    quant = {impl: tiny_engine(tiny_params, attn_impl=impl, kv_dtype=kv_dtype).logits(ids)
             for impl in ("pallas", "xla")}
    # layer 1's K/V are quantized from layer 0's output: a 1e-7 difference there can flip one
    # rounding step (1/127 of a row's peak), so the impls agree to that step, not to 1e-4
    assert rel_err(quant["pallas"], quant["xla"]) < 5e-3
    assert 1e-3 < rel_err(quant["xla"], full) < bound


# ---------------------------------------------------------------- the one-call GPU check

@pytest.mark.gpu
def test_compiled_kernel_on_gpu():
    """The Triton-lowered kernel (not interpret mode) against the reference, on the GPU."""
    for q_len in (1, 5):
        q, k, v, tables, lengths, positions = make_case(
            21, batch=4, q_len=q_len, heads=32, kv_heads=8, head_dim=128, page_size=16,
            lengths=[1000, 517, 64, 33], table_width=64, dtype=jnp.bfloat16)
        check_both(q, k, v, tables, lengths, positions, dtype=jnp.bfloat16)


@pytest.mark.parametrize("q_len,kv_dtype,layer,window,softcap", [
    (1, jnp.bfloat16, None, None, None), (5, jnp.bfloat16, 2, None, None),
    (64, jnp.bfloat16, None, 100, 50.0), (1, jnp.int8, None, None, None),
    (3, jnp.float8_e4m3fn, 1, None, 50.0)])
def test_kernel_lowers_through_triton_without_a_gpu(q_len, kv_dtype, layer, window, softcap):
    """Lowering for CUDA needs no device: every Pallas primitive the kernel uses has a Triton
    rule (what interpret mode cannot show). Compiling the PTX still needs the GPU check.
    The GPU it lowers for is named by an abstract mesh's device (jax 0.11 asks which one;
    0.10 takes it too)."""
    batch, pages = 4, 8
    pool = (40, 8, 16, 128) if layer is None else (3, 40, 8, 16, 128)
    k = jnp.zeros(pool, kv_dtype)
    scales = None if kv_dtype == jnp.bfloat16 else jnp.ones(pool[:-1], jnp.float32)
    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                                       platform="gpu")
    target = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                                       abstract_device=h200)
    with jax.sharding.use_abstract_mesh(target):
        lowered = jax.jit(functools.partial(
            ragged_paged_attention_pallas, max_q_len=q_len, layer=layer,
            sliding_window=window, softcap=softcap, interpret=False)).trace(
            jnp.zeros((batch * q_len, 32, 128), jnp.bfloat16), k, k,
            jnp.zeros((batch, pages), jnp.int32), jnp.full(batch, 100, jnp.int32),
            jnp.arange(batch + 1, dtype=jnp.int32) * q_len,
            jnp.zeros(batch * q_len, jnp.int32), scales, scales).lower(
            lowering_platforms=("cuda",))
    assert "xla.gpu.triton" in lowered.as_text()
