"""The decoder as pure functions over a params pytree and the paged KV.

Weights keep the [out, in] layout (x @ W.T): XLA:CPU streams a row-major
matrix-vector product fastest that way. Q/K/V and gate/up are fused so a
decode step issues four matmuls per layer. The loader stacks weights on axis 0;
the runtime keeps one buffer per layer (`params_from_arrays`, `Params.per_layer`)
and unrolls the layer loop, because XLA:CPU copies each slice of a stacked weight
before its matmul.
"""
from __future__ import annotations

from functools import lru_cache, partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import shard_map
from jax.sharding import PartitionSpec as P

from xlr_jax.kv.paged_kv import PagedKV, write_layer
from xlr_jax.kv.pages import SCRATCH_PAGE
from xlr_jax.model.config import ModelConfig, RopeScaling
from xlr_jax.model.quantized import QuantizedTensor
from xlr_jax.model.tensor_parallel import TensorParallel, shard_layer, splits_head
from xlr_jax.ops import cpu_kernels, cpu_linear, paged_attention, resolve_impl, soft_cap
from xlr_jax.pytree import pytree_dataclass
from xlr_jax.model.step_batch import StepBatch


@pytree_dataclass
class LayerParams:
    """One layer's weights, or every layer's stacked on a leading [L] axis. The four
    matrices (wqkv, wo, w_gate_up, w_down) may be `QuantizedTensor`s."""

    attn_norm: jax.Array   # [d]
    wqkv: jax.Array        # [q + 2kv, d]
    bqkv: jax.Array | None  # [q + 2kv] (Qwen2) or None
    wo: jax.Array          # [d, q]
    mlp_norm: jax.Array    # [d]
    w_gate_up: jax.Array | None = None  # [2 * ffn, d]: the MLP (a MoE layer's shared expert)
    w_down: jax.Array | None = None     # [d, ffn]
    q_norm: jax.Array | None = None  # [head_dim] (Qwen3) or None
    k_norm: jax.Array | None = None
    # a MoE layer's: the router, every expert's weights stacked [in, out] (the layout of a
    # grouped product), and the shared expert's gate (Qwen2-MoE)
    router: jax.Array | None = None             # [E, d]
    w_experts_gate_up: jax.Array | None = None  # [E, d, 2 * moe_ffn]
    w_experts_down: jax.Array | None = None     # [E, moe_ffn, d]
    w_shared_gate: jax.Array | None = None      # [1, d]
    # Gemma's norms of the attention's and the MLP's outputs, before the residual adds
    post_attn_norm: jax.Array | None = None     # [d]
    post_mlp_norm: jax.Array | None = None      # [d]


@pytree_dataclass
class Params:
    embed: jax.Array | QuantizedTensor  # [vocab, d]
    layers: LayerParams | tuple[LayerParams, ...]  # stacked on axis 0, or one per layer
    final_norm: jax.Array       # [d]
    lm_head: jax.Array | QuantizedTensor | None  # [vocab, d], None when tied to embed

    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree_util.tree_leaves(self))

    def per_layer(self) -> "Params":
        """Split stacked layers into a tuple of per-layer leaves (outside jit).

        XLA:CPU copies a slice of a stacked weight before each matmul, which
        triples decode traffic (measured 7.8 vs 48 tok/s on SmolLM2); separate
        per-layer buffers are read in place.
        """
        if isinstance(self.layers, tuple):
            return self
        n = self.layers.attn_norm.shape[0]
        layers = tuple(jax.tree.map(lambda a, i=i: a[i], self.layers) for i in range(n))
        return self.replace(layers=layers)


def params_from_arrays(arrays: dict, dtype=jnp.float32, config: ModelConfig | None = None,
                       tp: TensorParallel | None = None) -> Params:
    """Device params, one buffer per layer, from the loader's nested dict of stacked
    host arrays; with `tp` (and the model's `config`), laid out and split over its mesh
    (model.tensor_parallel).

    Each layer's slice is put on the device by itself, so the device never holds the
    stacked weights beside the per-layer ones. On the CPU, a read-only, aligned host
    view (a memory-mapped params cache) is not even copied: the params use its pages.
    """
    dtype = np.dtype(dtype)

    def host(a):
        if isinstance(a, dict):  # a weight kept quantized: its arrays as they are
            return QuantizedTensor(**{k: np.asarray(v) for k, v in a.items()})
        return np.asarray(a, dtype)

    def put(tree, specs):  # a layer at a time: each host slice is let go once put
        if tp is None:
            return jax.tree.map(jax.device_put, tree)
        return tp.place(tree, specs(tree))

    stacked = arrays["layers"]
    layers = []
    for i in range(len(stacked["attn_norm"])):
        layer = {k: v if v is None else jax.tree.map(lambda a: a[i], v)
                 for k, v in stacked.items()}
        if tp is not None:
            layer = shard_layer(layer, config, tp.size, tp.expert_parallel)
        layer = LayerParams(**{"bqkv": None, **{k: host(v) for k, v in layer.items()}})
        layers.append(put(layer, tp and tp.layer_specs))
    head = arrays.get("lm_head")
    if head is None and tp is not None and splits_head(config.vocab_size, tp.size):
        head = arrays["embed"]  # a tied head held apart, split by vocabulary (see tp)
    rest = put(Params(embed=host(arrays["embed"]), layers=(),
                      final_norm=host(arrays["final_norm"]),
                      lm_head=None if head is None else host(head)), tp and tp.param_specs)
    return rest.replace(layers=tuple(layers))


@lru_cache(maxsize=None)
def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """Inverse frequencies per rotary pair, with linear or llama3 scaling applied."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling.kind == "linear":
        inv = inv / scaling.factor
    elif scaling.kind == "llama3":
        low_wavelen = scaling.original_max_position / scaling.low_freq_factor
        high_wavelen = scaling.original_max_position / scaling.high_freq_factor
        wavelen = 2 * np.pi / inv
        smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        mid = (1 - smooth) * inv / scaling.factor + smooth * inv
        inv = np.where(wavelen > low_wavelen, inv / scaling.factor,
                       np.where(wavelen < high_wavelen, inv, mid))
    return inv.astype(np.float32)


def rope_tables(positions, inv_freq):
    """cos and sin [..., 1, hd/2] for `positions` [...]; shared by every layer."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq
    return jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]


def apply_rope(x, cos, sin):
    """Rotate halves (HF convention): x [..., heads, hd]."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def rms_norm(x, weight, eps):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight).astype(x.dtype)


class RowProducts(NamedTuple):
    """How a step's weight products of a few rows run (the plan's Buckets decide):
    XLA:CPU's dot of a few rows costs 2-3x a matrix-vector product's."""
    reduce_rows: int = 0  # 2..this many rows: a multiply and a sum over the input
    kernel_rows: int = 0  # 2..this many rows: the CPU kernel (ops.cpu_linear), if it takes w


def linear(x, w, products: RowProducts = RowProducts(), out_dtype=None):
    """x [..., d] @ w.T for w [out, d], in `out_dtype` (default x's): a dot, or for a
    few rows the CPU kernel or a multiply-sum (see RowProducts). A quantized w
    (`QuantizedTensor`): by the quantized kernel where the plan runs the CPU kernels
    (`products.kernel_rows`; any row count: a decode row or a prefill chunk), else
    dequantized in x's dtype for a dot."""
    rows = int(np.prod(x.shape[:-1]))
    if isinstance(w, QuantizedTensor):
        if products.kernel_rows:
            return cpu_linear.quantized_linear(x, w.values, w.scales, w.minimums, out_dtype)
        return jnp.einsum("...d,od->...o", x, w.dequantize(x.dtype),
                          preferred_element_type=out_dtype)
    if (2 <= rows <= products.kernel_rows and cpu_linear.supports(x, w)
            and cpu_kernels.build_error() is None):
        return cpu_linear.linear(x, w, out_dtype)
    if not 2 <= rows <= products.reduce_rows:
        return jnp.einsum("...d,od->...o", x, w, preferred_element_type=out_dtype)
    f32 = jnp.float32  # summed in f32 whatever the weights' dtype, as a dot accumulates
    out = jnp.sum(w[:, :, None].astype(f32) * x.reshape(rows, -1).T[None].astype(f32),
                  axis=1)  # [out, rows]: each weight row is read once for every row of x
    return out.T.reshape(*x.shape[:-1], w.shape[0]).astype(out_dtype or x.dtype)


def _layers(layers):
    if isinstance(layers, tuple):
        return layers
    # stacked inside jit: correct, but each slice is a copy (see Params.per_layer)
    return [jax.tree.map(lambda a, i=i: a[i], layers) for i in range(layers.attn_norm.shape[0])]


def decoder(params: Params, kv: PagedKV, tokens, positions, page_ids, offsets, attend, *,
            config: ModelConfig, products: RowProducts = RowProducts(),
            tp: TensorParallel | None = None):
    """The decoder over flat tokens [N] at `positions` [N]: each token's K/V goes to
    slot `offsets` of page `page_ids` (the scratch page for padding), and
    `attend(q [N, H, D], (k, v), scales, layer)` reads the pages (whatever layout the
    caller's batch has; `attention_options` says how for a layer). Returns the final
    hidden states [N, d] (after the final norm) and the new KV. `products`: see
    `linear`. `tp`: params and KV split over a mesh (model.tensor_parallel): the layers
    run per shard, `attend` seeing a shard's heads."""
    run = partial(_decoder, tokens=tokens, positions=positions, page_ids=page_ids,
                  offsets=offsets, attend=attend, products=products)
    if tp is None:
        return run(params, kv, config=config, reduce=lambda x: x)
    def shard(params, kv):
        first = (jax.lax.axis_index(tp.axis) * (config.num_experts // tp.size)
                 if tp.expert_parallel else None)
        return run(params, kv, config=tp.shard_config(config), first_expert=first,
                   reduce=partial(jax.lax.psum, axis_name=tp.axis))

    kv_specs = tp.kv_specs(kv)
    return shard_map(shard, mesh=tp.mesh, in_specs=(tp.param_specs(params), kv_specs),
                     out_specs=(P(), kv_specs), check_vma=False)(params, kv)


def _decoder(params: Params, kv: PagedKV, *, tokens, positions, page_ids, offsets, attend,
             config: ModelConfig, products: RowProducts, reduce, first_expert=None):
    """`decoder`'s layers on one shard's weights (all of them without a mesh); `reduce`
    sums a row-split product's partial outputs over the shards; `first_expert`: the
    first of the experts a shard holds (expert parallel), None: all of them."""
    c = config
    lin = lambda x, w: linear(x, w, products)  # noqa: E731
    tables = {}  # cos and sin per RoPE base: Gemma-3's windowed layers have their own
    x = embed(params, tokens)
    if c.scale_embeddings:  # Gemma: by sqrt(hidden), rounded to the activations' dtype
        x = x * jnp.asarray(c.hidden_size ** 0.5, x.dtype)
    # the attention scales scores by head_dim ** -0.5; a model with another scale
    # (Gemma's query_pre_attn_scalar ** -0.5) has its queries scaled by the ratio first
    q_scale = None if c.query_pre_attn_scalar is None else (
        c.head_dim / c.query_pre_attn_scalar) ** 0.5
    k_all, v_all, k_scale, v_scale = kv.k, kv.v, kv.k_scale, kv.v_scale
    for i, lp in enumerate(_layers(params.layers)):
        base = c.rope_base(i)
        if base not in tables:
            tables[base] = rope_tables(positions, rope_inv_freq(c.head_dim, *base))
        cos, sin = tables[base]
        h = rms_norm(x, lp.attn_norm, c.rms_norm_eps)
        qkv = lin(h, lp.wqkv)
        if lp.bqkv is not None:
            qkv = qkv + lp.bqkv
        q, k, v = jnp.split(qkv, [c.q_size, c.q_size + c.kv_size], axis=-1)
        q, k = q.reshape(-1, c.num_heads, c.head_dim), k.reshape(-1, c.num_kv_heads, c.head_dim)
        if lp.q_norm is not None:  # per head, before RoPE (Qwen3, Gemma-3)
            q, k = rms_norm(q, lp.q_norm, c.rms_norm_eps), rms_norm(k, lp.k_norm, c.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if q_scale is not None:
            q = q * jnp.asarray(q_scale, q.dtype)
        v = v.reshape(-1, c.num_kv_heads, c.head_dim)
        k_all, k_scale = write_layer(k_all, k_scale, i, page_ids, offsets, k)
        v_all, v_scale = write_layer(v_all, v_scale, i, page_ids, offsets, v)
        attn = attend(q, (k_all, v_all), None if k_scale is None else (k_scale, v_scale), i)
        x = x + _post_norm(reduce(lin(attn.reshape(-1, c.q_size), lp.wo)), lp.post_attn_norm, c)
        h = rms_norm(x, lp.mlp_norm, c.rms_norm_eps)
        out = (mixture(h, lp, c, lin, first_expert) if lp.router is not None
               else mlp(h, lp, lin, c.hidden_act))
        x = x + _post_norm(reduce(out), lp.post_mlp_norm, c)
    x = rms_norm(x, params.final_norm, c.rms_norm_eps)
    return x, PagedKV(k_all, v_all, k_scale, v_scale)


def embed(params: Params, tokens):
    """The embedding's rows for `tokens`, in the activations' dtype (the final norm's):
    a quantized table dequantizes only the rows it gathers."""
    if isinstance(params.embed, QuantizedTensor):
        return params.embed.rows(tokens, params.final_norm.dtype)
    return params.embed[tokens]


def _post_norm(x, weight, c: ModelConfig):
    return x if weight is None else rms_norm(x, weight, c.rms_norm_eps)


def attention_options(config: ModelConfig, layer: int) -> dict:
    """What `paged_attention` needs to know of `layer` beyond its pages: its sliding
    window and the scores' soft cap."""
    return dict(layer=layer, sliding_window=config.window(layer), softcap=config.attn_softcap)


ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": partial(jax.nn.gelu, approximate=True)}


def mlp(h, lp: LayerParams, lin, act: str = "silu"):
    """The gated MLP: down(act(gate(h)) * up(h)) (`act`: an `ACTIVATIONS` name)."""
    gate, up = jnp.split(lin(h, lp.w_gate_up), 2, axis=-1)
    return lin(ACTIVATIONS[act](gate) * up, lp.w_down)


def mixture(h, lp: LayerParams, c: ModelConfig, lin, first_expert=None):
    """A mixture-of-experts layer over tokens h [N, d]: each token's top-k experts by the
    router's softmax (renormalized over the chosen with `norm_topk_prob`), their outputs
    weighed and summed, plus the shared expert's (gated by a sigmoid where it has a gate).
    Only the chosen experts run: `expert_outputs`. `first_expert`: expert parallel, this
    device holds experts from that index on (see `expert_outputs`)."""
    probs = jax.nn.softmax(linear(h, lp.router, out_dtype=jnp.float32), axis=-1)
    weights, chosen = jax.lax.top_k(probs, c.experts_per_token)  # ties: the lower index
    if c.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    outputs = expert_outputs(h, chosen, lp, first_expert)
    out = jnp.sum(outputs * weights.astype(h.dtype)[..., None], axis=1)
    if lp.w_gate_up is not None:
        shared = mlp(h, lp, lin, c.hidden_act)
        if lp.w_shared_gate is not None:
            shared = jax.nn.sigmoid(lin(h, lp.w_shared_gate)) * shared
        out = out + shared
    return out


def expert_outputs(h, chosen, lp: LayerParams, first=None):
    """Each token's chosen experts' outputs [N, k, d] for `chosen` [N, k]: with fewer
    assignments than experts (decode), `gathered_experts`, else `grouped_experts`.
    `first`: the layer's weights hold experts first.. only (expert parallel); the
    assignments to others give zeros (another device adds theirs)."""
    n, k = chosen.shape
    if n * k < lp.w_experts_gate_up.shape[0]:
        return gathered_experts(h, chosen, lp, first)
    return grouped_experts(h, chosen, lp, first)


def _local_experts(chosen, lp: LayerParams, first):
    """`chosen` as indices into the weights held here, and which assignments are held."""
    if first is None:
        return chosen, None
    local = chosen - first
    held = (local >= 0) & (local < lp.w_experts_gate_up.shape[0])
    return local, held


def gathered_experts(h, chosen, lp: LayerParams, first=None):
    """Each token gathers its chosen experts' weights: only those are read (the gather
    copies them before the products; experiments/README.md#moe_products)."""
    local, held = _local_experts(chosen, lp, first)
    if held is not None:
        local = jnp.where(held, local, 0)
    gate_up = jnp.einsum("nd,nkdo->nko", h, lp.w_experts_gate_up[local])
    gate, up = jnp.split(gate_up, 2, axis=-1)
    out = jnp.einsum("nki,nkid->nkd", jax.nn.silu(gate) * up, lp.w_experts_down[local])
    return out if held is None else jnp.where(held[..., None], out, 0)


def grouped_experts(h, chosen, lp: LayerParams, first=None):
    """The assignments sorted by expert and run as one grouped product (`ragged_dot`):
    every expert's weights read once, each token through its own experts only (the
    assignments to experts not held here sort last, outside every group)."""
    n, k = chosen.shape
    experts = lp.w_experts_gate_up.shape[0]
    local, held = _local_experts(chosen, lp, first)
    flat = (local if held is None else jnp.where(held, local, experts)).reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)
    gate_up = jax.lax.ragged_dot(h[order // k], lp.w_experts_gate_up, sizes)
    gate, up = jnp.split(gate_up, 2, axis=-1)
    out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, lp.w_experts_down, sizes)
    out = jnp.zeros_like(out).at[order].set(out).reshape(n, k, -1)
    # (zeros for the rows outside every group: XLA:CPU writes them so, another backend
    # need not)
    return out if held is None else jnp.where(held[..., None], out, 0)


def page_slots(block_tables, positions, valid, page_size):
    """Each token's (page id, offset) for positions [B, T] of the sequences
    `block_tables` [B, W] hold; invalid tokens go to the scratch page."""
    page_ids = jnp.take_along_axis(block_tables, positions // page_size, axis=1)
    return jnp.where(valid, page_ids, SCRATCH_PAGE), positions % page_size


def forward(params: Params, kv: PagedKV, tokens, positions, valid, block_tables,
            *, config: ModelConfig, attn_impl: str = "auto",
            products: RowProducts = RowProducts(), tp: TensorParallel | None = None):
    """Append `tokens` [B, T] at `positions` to each sequence's pages and run the decoder.

    `valid` [B, T] marks real tokens (padding writes to the scratch page); `products`
    and `tp`: see `decoder`. Returns the final hidden states [B, T, d] (after the final
    norm) and the new KV.
    """
    c = config
    batch, q_len = tokens.shape
    lengths = jnp.max(jnp.where(valid, positions + 1, 0), axis=1)
    lengths = jnp.maximum(lengths, 1)  # padded rows see one (scratch) slot, not NaN
    page_ids, offsets = page_slots(block_tables, positions, valid, kv.page_size)

    def attend(q, kv_pages, kv_scales, layer):
        out = paged_attention(q.reshape(batch, q_len, *q.shape[1:]), kv_pages, block_tables,
                              lengths, positions, kv_scales=kv_scales, impl=attn_impl,
                              **attention_options(c, layer))
        return out.reshape(q.shape)

    hidden, kv = decoder(params, kv, tokens.reshape(-1), positions.reshape(-1),
                         page_ids.reshape(-1), offsets.reshape(-1), attend, config=c,
                         products=products, tp=tp)
    return hidden.reshape(batch, q_len, -1), kv


def forward_step(params: Params, kv: PagedKV, batch: StepBatch, *, config: ModelConfig,
                 attn_impl: str, pages_per_block: int,
                 products: RowProducts = RowProducts(), tp: TensorParallel | None = None):
    """Run one ragged step (see step_batch): its decode rows' tokens and its chunk,
    flat through every matmul; attention per part, reading only the pages each part
    sees (`products` and `tp`: see `decoder`). Returns the hidden state each row samples
    from [rows, d] and the new KV."""
    c = config
    dec, chunk = batch.decode_rows, batch.chunk
    offs = jnp.arange(chunk, dtype=jnp.int32)
    chunk_valid = offs < batch.chunk_len
    chunk_pos = batch.chunk_start + offs
    positions = jnp.concatenate([batch.decode_positions, chunk_pos])
    valid = jnp.concatenate([jnp.ones(dec, bool), chunk_valid])
    tables = batch.block_tables
    # each token's row: decode token j is row j, every chunk token the last row
    rows = jnp.concatenate([jnp.arange(dec, dtype=jnp.int32), jnp.full(chunk, dec, jnp.int32)])
    page_ids, offsets = page_slots(tables[rows], positions[:, None], valid[:, None],
                                   kv.page_size)
    dec_lengths = batch.decode_positions + 1
    # padding chunk tokens see nothing (and do not widen the pages walked)
    chunk_q = jnp.where(chunk_valid, chunk_pos, -1)
    impl = resolve_impl(attn_impl)

    def attend(q, kv_pages, kv_scales, layer):
        common = dict(kv_scales=kv_scales, **attention_options(c, layer))
        if impl == "pallas":  # one ragged call: a row per decode token, then the chunk
            lengths = jnp.concatenate([dec_lengths, (batch.chunk_start + batch.chunk_len)[None]])
            cu = jnp.concatenate([jnp.arange(dec + 1, dtype=jnp.int32),
                                  jnp.array([dec + chunk], jnp.int32)])[:tables.shape[0] + 1]
            return paged_attention(q, kv_pages, tables, lengths[:tables.shape[0]],
                                   jnp.concatenate([batch.decode_positions, chunk_q]),
                                   cu_q_lens=cu, max_q_len=max(chunk, 1), impl=impl, **common)
        blocked = dict(impl=impl, pages_per_block=pages_per_block, **common)
        parts = []
        if dec:
            parts.append(paged_attention(q[:dec, None], kv_pages, tables[:dec], dec_lengths,
                                         batch.decode_positions[:, None], **blocked)[:, 0])
        if chunk:
            parts.append(paged_attention(q[None, dec:], kv_pages, tables[dec:],
                                         (batch.chunk_start + batch.chunk_len)[None],
                                         chunk_q[None], **blocked)[0])
        return jnp.concatenate(parts) if len(parts) > 1 else parts[0]

    tokens = jnp.concatenate([batch.decode_tokens, batch.chunk_tokens])
    hidden, kv = decoder(params, kv, tokens, positions, page_ids[:, 0], offsets[:, 0], attend,
                         config=c, products=products, tp=tp)
    last = jnp.concatenate([jnp.arange(dec, dtype=jnp.int32),
                            (dec + jnp.maximum(batch.chunk_len - 1, 0))[None]])
    return hidden[last[:tables.shape[0]]], kv


def lm_head(params: Params, hidden, config: ModelConfig,
            products: RowProducts = RowProducts(), tp: TensorParallel | None = None):
    """Logits in f32 for hidden states [..., d] (`products`: see `linear`), soft-capped
    where the model caps them (Gemma-2: cap * tanh(logits / cap)). `tp`: the mesh a head
    split by vocabulary is on (model.tensor_parallel): each shard's rows, then gathered
    whole on every shard."""
    w = params.embed if params.lm_head is None else params.lm_head
    if tp is None or params.lm_head is None or not splits_head(w.shape[0], tp.size):
        logits = linear(hidden, w, products, jnp.float32)
    else:
        gather = partial(jax.lax.all_gather, axis_name=tp.axis, axis=hidden.ndim - 1,
                         tiled=True)
        logits = shard_map(lambda h, w: gather(linear(h, w, products, jnp.float32)),
                           mesh=tp.mesh, in_specs=(P(), tp.head_specs(w)), out_specs=P(),
                           check_vma=False)(hidden, w)
    return logits if config.final_softcap is None else soft_cap(logits, config.final_softcap)
