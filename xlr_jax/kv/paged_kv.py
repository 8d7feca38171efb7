"""The paged KV cache on the device: a pytree of pages, and the programs that move them.

Device layout: `PagedKV.k` and `PagedKV.v` are
    [layers, num_pages, kv_heads, page_size, head_dim]
so one layer's slice is the (k_pages, v_pages) pair that
`xlr_jax.ops.paged_attention` reads. Page-major: each page (all its KV heads)
is one contiguous block, so gathering a sequence's pages is a row copy (on
XLA:CPU ~3.5x cheaper than gathering per head from a head-major pool).

Quantized KV: with an int8 or fp8 page dtype, `k_scale`/`v_scale`
[layers, num_pages, kv_heads, page_size] hold one f32 scale per token and head
(stored value * scale = K/V); `write_layer` quantizes, the attention dequantizes. On
the CPU an fp8 pool is stored as its bytes (`storage_dtype`).

Page 0 is a scratch page (`pages.SCRATCH_PAGE`): it is never handed out, padded batch
rows and padded chunk positions write into it, and block tables are padded with it.
Which page holds what is the host's business (`xlr_jax.kv.pages`, `xlr_jax.kv.manager`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from xlr_jax.pytree import pytree_dataclass


# largest magnitude a quantized page dtype stores
QUANT_MAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}
FP8 = jnp.dtype(jnp.float8_e4m3fn)
FP8_BYTES = jnp.dtype(jnp.uint8)  # how an fp8 pool is stored on the CPU: see storage_dtype


def storage_dtype(dtype) -> jnp.dtype:
    """The dtype a pool of `dtype` pages is stored in. On the CPU fp8 pages are kept as
    their bytes (uint8): XLA:CPU converts the whole of an fp8 array to scatter into it (30
    one-token writes into a 110 MB pool took 11 s, against 65 us into int8;
    experiments/README.md#ablations); readers bitcast the pages they gather
    (`page_values`), `quantize_kv` writes bytes. The GPU, not measured yet, keeps fp8 as
    it is."""
    dtype = jnp.dtype(dtype)
    return FP8_BYTES if dtype == FP8 and jax.default_backend() == "cpu" else dtype


def page_dtype(dtype) -> jnp.dtype:
    """The dtype of the values in pages stored as `dtype` (the inverse of storage_dtype)."""
    return FP8 if jnp.dtype(dtype) == FP8_BYTES else jnp.dtype(dtype)


def page_values(pages):
    """Gathered pages as their values' dtype (fp8 stored as bytes: bitcast back)."""
    if pages.dtype == FP8_BYTES:
        return jax.lax.bitcast_convert_type(pages, FP8)
    return pages


def is_quantized(dtype) -> bool:
    return page_dtype(dtype) in QUANT_MAX


def quantize_kv(values, dtype):
    """values [..., head_dim] -> (stored [..., head_dim] in `dtype`, a pool's dtype: fp8
    values as their bytes where the pool holds bytes; f32 scales [...])."""
    value_dtype = page_dtype(dtype)
    values = values.astype(jnp.float32)
    amax = jnp.max(jnp.abs(values), axis=-1)
    scale = jnp.where(amax > 0, amax / QUANT_MAX[value_dtype], 1.0)
    scaled = values / scale[..., None]
    if jnp.issubdtype(value_dtype, jnp.integer):
        scaled = jnp.round(scaled)
    return jax.lax.bitcast_convert_type(scaled.astype(value_dtype), dtype), scale


@pytree_dataclass
class PagedKV:
    k: jax.Array  # [layers, num_pages, kv_heads, page_size, head_dim]
    v: jax.Array
    k_scale: jax.Array | None = None  # [layers, num_pages, kv_heads, page_size], quantized only
    v_scale: jax.Array | None = None

    @classmethod
    def create(cls, *, num_layers, num_kv_heads, head_dim, num_pages, page_size,
               dtype=jnp.float32, sharding=None) -> "PagedKV":
        """Zeroed pages (scales of one); `sharding`: every leaf's, e.g. split by KV head
        over a mesh (model.tensor_parallel)."""
        shape = (num_layers, num_pages, num_kv_heads, page_size, head_dim)
        # two separate buffers: the steps donate each leaf
        scales = ([jnp.ones(shape[:-1], jnp.float32, device=sharding) for _ in "kv"]
                  if is_quantized(dtype) else [None, None])
        stored = storage_dtype(dtype)  # zero bytes are fp8 zeros too
        return cls(jnp.zeros(shape, stored, device=sharding),
                   jnp.zeros(shape, stored, device=sharding), *scales)

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree_util.tree_leaves(self))


def write_layer(pages, scales, layer, page_ids, offsets, values):
    """Store `values` [n, kv_heads, head_dim] at (page_ids[n], offsets[n]) of one layer.

    Returns the new (pages, scales); `scales` is None for unquantized pages.
    """
    if scales is None:
        return pages.at[layer, page_ids, :, offsets].set(values.astype(pages.dtype)), None
    stored, scale = quantize_kv(values, pages.dtype)
    return (pages.at[layer, page_ids, :, offsets].set(stored),
            scales.at[layer, page_ids, :, offsets].set(scale))


def _copy_pages(kv: PagedKV, src, dst) -> PagedKV:
    return jax.tree.map(lambda a: a.at[:, dst].set(a[:, src]), kv)


copy_pages = jax.jit(_copy_pages, donate_argnums=0)


def read_pages(kv: PagedKV, ids) -> dict:
    """Every leaf's pages `ids` ({"k": [layers, n, ...], ...}); dispatched, not waited for."""
    ids = jnp.asarray(ids, jnp.int32)
    return {name: leaf[:, ids] for name, leaf in leaves(kv).items()}


def _write_pages(kv: PagedKV, ids, pages: dict) -> PagedKV:
    return kv.replace(**{name: getattr(kv, name).at[:, ids].set(pages[name])
                         for name in leaves(kv)})


write_pages = jax.jit(_write_pages, donate_argnums=0)


def restore_lowering(kv: PagedKV, num_pages: int):
    """A function lowering what restoring a `num_pages`-page tier into a pool shaped like
    `kv` runs: `write_pages`, and `copy_pages` of one page (a tier's partial last page
    is copied on write). Compiled beside the loop when a tier is saved, they go to JAX's
    persistent cache, so the process that restores the tier compiles neither (0.2 s of
    its first turn otherwise). Shapes are read now: `kv` may be donated before it runs."""
    # no shardings: the calls pass plain arrays, and JAX's cache key counts them
    pool = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), kv)
    pages = {name: jax.ShapeDtypeStruct((x.shape[0], num_pages, *x.shape[2:]), x.dtype)
             for name, x in leaves(kv).items()}
    ids = lambda n: jax.ShapeDtypeStruct((n,), jnp.int32)  # noqa: E731
    return lambda: [write_pages.lower(pool, ids(num_pages), pages),
                    copy_pages.lower(pool, ids(1), ids(1))]


def leaves(kv: PagedKV) -> dict:
    """The pytree's arrays by name, quantization scales included when present."""
    names = ("k", "v", "k_scale", "v_scale")
    return {n: getattr(kv, n) for n in names if getattr(kv, n) is not None}
