"""Tensor parallel over a JAX mesh: which weights split where, and the decoder per shard.

A `TensorParallel` names a mesh (axes "data" and "model") and splits the model over its
"model" axis, Megatron-style: each shard holds whole query heads (and their K/V heads),
a slice of the MLP's (and every expert's) FFN columns, and the full norms, embedding and
LM head. The decoder then runs per shard under `shard_map` as the same code on a smaller
model (`shard_config`), the attention and CPU kernels included, with one `psum` after
the attention's output product and one after the MLP: two all-reduces a layer.

Weights carry `NamedSharding`s: Q/K/V and gate/up split by output, O and down by input.
The fused Q/K/V and gate/up matrices are reordered shard-major at load (`shard_layer`),
so a shard's contiguous block holds its own [q | k | v] (or [gate | up]) in the one-device
layout. With fewer KV heads than shards, each KV head is repeated so every shard holds
the one its query heads read (`kv_heads`): the KV pool then holds `kv_heads` heads,
sharded by head, which costs `size / num_kv_heads` times the KV memory and the plan
budgets it. The page pool, block tables and prefix cache stay on the host and single:
a page id names the same page on every shard.

Expert parallel (`expert_parallel`, where a MoE's experts divide over the shards): each
shard holds E / n whole experts instead of a slice of every one. Every shard already has
every token (the activations are whole between layers), so it runs the assignments to
its own experts, gives zeros for the others', and the MLP's all-reduce brings each
token's expert outputs together: no all-to-all, the same one all-reduce a layer.

The LM head is split by vocabulary where the shards divide it (`splits_head`): each
shard computes its rows' logits, then one all-gather makes the whole logits on every
shard (decode reads 1/n of the head, the largest matrix of a small model, at the cost of
gathering rows x vocab floats; experiments/README.md#tensor_parallel_choices). A tied
embedding is then held twice: whole for the lookup, and split as the head. The
embedding stays whole (a lookup reads only its tokens' rows).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from xlr_jax.errors import InvalidRequestError
from xlr_jax.model.config import ModelConfig
from xlr_jax.model.quantized import QuantizedTensor

AXES = ("data", "model")

# each LayerParams field's split: "out" (rows, axis 0 of [out, in]), "in" (axis 1),
# "experts_out" (the last axis of [E, in, out]), "experts_in" (axis 1 of [E, in, out]),
# "bias" (axis 0 of a vector); fields not named are replicated
LAYER_SPLITS = {"wqkv": "out", "bqkv": "bias", "wo": "in", "w_gate_up": "out", "w_down": "in",
                "w_experts_gate_up": "experts_out", "w_experts_down": "experts_in"}
# expert parallel: the experts' leading axis instead ("experts": axis 0 of [E, in, out])
EXPERT_SPLITS = {"w_experts_gate_up": "experts", "w_experts_down": "experts"}


def problem(config: ModelConfig, size: int, expert_parallel: bool = False) -> str | None:
    """Why `config` cannot be split over `size` shards, its experts whole on each
    (`expert_parallel`) or each split by FFN width (None: it can)."""
    c = config
    if size < 1:
        return f"tensor parallel must be at least 1 (got {size})"
    if size == 1:
        return None
    if c.kv_latent_dim:
        return "latent (MLA) attention has no tensor-parallel split yet"
    if c.num_heads % size:
        return (f"its {c.num_heads} query heads do not split evenly over {size} devices; "
                f"use a tensor parallel that divides {c.num_heads}")
    if c.num_kv_heads % size and size % c.num_kv_heads:
        return (f"its {c.num_kv_heads} KV heads neither split over {size} devices nor "
                f"repeat evenly across them; use a divisor or a multiple of "
                f"{c.num_kv_heads}")
    if expert_parallel and c.num_experts % size:
        return f"its {c.num_experts} experts do not split evenly over {size} devices"
    widths = {"FFN": c.intermediate_size if c.num_layers > c.moe_layers else 0,
              "expert FFN": 0 if expert_parallel else c.moe_intermediate_size,
              "shared expert FFN": c.shared_width}
    for name, width in widths.items():
        if width % size:
            return f"its {name} width {width} does not split evenly over {size} devices"
    return None


def expert_parallel_for(config: ModelConfig, size: int) -> bool:
    """Whether a MoE's experts go whole to the devices (E / n each) rather than each
    split by its FFN width: wherever they divide evenly."""
    return size > 1 and config.num_experts > 0 and config.num_experts % size == 0


def kv_heads(config: ModelConfig, size: int) -> int:
    """KV heads the pool holds over `size` shards: the model's, or one a shard where
    there are fewer (each repeated for the shards whose query heads read it)."""
    return max(config.num_kv_heads, size)


def splits_head(vocab_size: int, size: int) -> bool:
    """Whether an LM head of `vocab_size` rows is split by vocabulary over `size` shards:
    over more than one, where they divide it (else it is whole on each)."""
    return size > 1 and vocab_size % size == 0


def device_config(config: ModelConfig, size: int) -> ModelConfig:
    """`config` with the KV heads one of `size` shards holds: what a device's KV page
    costs (the plan's pages and the roofline count it)."""
    return dataclasses.replace(config, num_kv_heads=kv_heads(config, size) // size)


def make_mesh(tensor_parallel: int, first: int = 0) -> Mesh:
    """A (data, model) mesh of 1 x `tensor_parallel` over the devices from `first` on (a
    slice of its own: the prefill devices come after the decode ones)."""
    devices = jax.devices()
    need = first + tensor_parallel
    if need > len(devices):
        raise InvalidRequestError(
            f"{need} devices needed; {len(devices)} found (on the CPU, XLA_FLAGS="
            f"--xla_force_host_platform_device_count={need} makes that many)")
    grid = np.array(devices[first:need]).reshape(1, tensor_parallel)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


@dataclass(frozen=True)
class TensorParallel:
    """A model split over `mesh`'s "model" axis (see the module docstring); with
    `expert_parallel`, a MoE's experts go whole to the devices instead."""
    mesh: Mesh
    expert_parallel: bool = False
    axis: str = "model"

    @property
    def size(self) -> int:
        return self.mesh.shape[self.axis]

    def check(self, config: ModelConfig) -> None:
        if (why := problem(config, self.size, self.expert_parallel)) is not None:
            raise InvalidRequestError(f"tensor parallel {self.size}: {why}")

    def shard_config(self, config: ModelConfig) -> ModelConfig:
        """The model one shard runs: its heads and FFN widths."""
        n = self.size
        return dataclasses.replace(
            config, num_heads=config.num_heads // n,
            num_kv_heads=kv_heads(config, n) // n,
            intermediate_size=config.intermediate_size // n,
            moe_intermediate_size=config.moe_intermediate_size // (
                1 if self.expert_parallel else n),
            shared_intermediate_size=config.shared_width // n)

    def sharding(self, spec: P = P()) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def spec(self, split: str | None, leaf: str, shape: tuple[int, ...]) -> P:
        """The PartitionSpec of one leaf of a weight split `split` (see LAYER_SPLITS):
        `leaf` is "array", or a QuantizedTensor's "values", "scales" or "minimums"."""
        m = self.axis
        if split in ("out", "bias"):
            return P(m)
        if split == "in":
            # a quantized weight's one scale a row (fp8) is the same on every shard
            one_scale = leaf in ("scales", "minimums") and shape[-1] == 1
            return P() if one_scale else P(None, m)
        if split == "experts_out":
            return P(None, None, m)
        if split == "experts_in":
            return P(None, m)
        if split == "experts":
            return P(m)
        return P()

    def layer_specs(self, lp):
        """One layer's PartitionSpecs (a LayerParams of them)."""
        splits = {**LAYER_SPLITS, **(EXPERT_SPLITS if self.expert_parallel else {})}
        return type(lp)(**{f.name: self._leaf_specs(getattr(lp, f.name), splits.get(f.name))
                           for f in dataclasses.fields(lp)})

    def param_specs(self, params):
        """`params`' PartitionSpecs, a pytree of the same structure."""
        layers = (tuple(map(self.layer_specs, params.layers))
                  if isinstance(params.layers, tuple) else self.layer_specs(params.layers))
        return params.replace(embed=self._leaf_specs(params.embed, None), layers=layers,
                              final_norm=P(), lm_head=self.head_specs(params.lm_head))

    def head_specs(self, head):
        """The LM head's PartitionSpecs (a QuantizedTensor's leaves each): its rows split
        where `splits_head` (a tied head is held apart from the embedding then: None
        here means the embedding's rows serve, whole)."""
        split = head is not None and splits_head(head.shape[0], self.size)
        return self._leaf_specs(head, "out" if split else None)

    def _leaf_specs(self, value, split):
        if isinstance(value, QuantizedTensor):
            names = QuantizedTensor(values="values", scales="scales",
                                    minimums=None if value.minimums is None else "minimums")
            return jax.tree.map(lambda x, name: self.spec(split, name, x.shape), value, names)
        return None if value is None else self.spec(split, "array", value.shape)

    def kv_specs(self, kv):
        """The paged KV's PartitionSpecs: split by KV head (axis 2 of every leaf)."""
        return jax.tree.map(lambda _: P(None, None, self.axis), kv)

    def kv_sharding(self) -> NamedSharding:
        """Every paged KV leaf's sharding (see kv_specs)."""
        return self.sharding(P(None, None, self.axis))

    def place(self, tree, specs):
        """`tree`'s arrays put on the mesh as `specs` say; a split axis must divide."""
        def put(x, spec):
            for axis, name in enumerate(spec):
                if name is not None and x.shape[axis] % self.size:
                    raise InvalidRequestError(
                        f"tensor parallel {self.size}: a weight's axis of {x.shape[axis]} "
                        f"(shape {tuple(x.shape)}) does not split evenly; a quantized "
                        "weight's groups must split with its columns (try --weights float)")
            return place_array(x, self.sharding(spec))
        return jax.tree.map(put, tree, specs)


def place_array(x, sharding: NamedSharding) -> jax.Array:
    """`x`, a host array with the same value in every process, on `sharding`. Across
    processes each places its own devices' blocks: jax.device_put would first check, by
    a collective, that every process passed the same value (it gathers the whole array)."""
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def _split_rows(parts: list[int], n: int) -> np.ndarray:
    """Row order putting each of `n` shards' slice of every part together: parts (of
    these sizes) laid one after another, each cut in n equal slices; shard s's rows are
    slice s of part 0, then slice s of part 1, ..."""
    starts = np.cumsum([0] + parts[:-1])
    return np.concatenate([np.arange(start + s * size // n, start + (s + 1) * size // n)
                           for s in range(n) for start, size in zip(starts, parts)])


def _kv_repeat_rows(config: ModelConfig, n: int) -> np.ndarray:
    """wqkv's rows with each KV head repeated to `kv_heads(config, n)` heads (query rows
    kept), copy j of K (and V) being head j * kv / heads: the head the query heads of the
    shard holding it read."""
    c, hd = config, config.head_dim
    heads = kv_heads(config, n)
    src = np.arange(heads) * c.num_kv_heads // heads
    head_rows = (src[:, None] * hd + np.arange(hd)).reshape(-1)
    return np.concatenate([np.arange(c.q_size), c.q_size + head_rows,
                           c.q_size + c.kv_size + head_rows])


def shard_layer(arrays: dict, config: ModelConfig, n: int,
                expert_parallel: bool = False) -> dict:
    """One layer's host arrays (a loader's dict; a quantized weight as a dict of its
    arrays) laid out for `n` shards: KV heads repeated where there are fewer than n, and
    the fused matrices' rows (or the experts' last axis, unless whole experts go to each
    shard: `expert_parallel`) ordered shard-major."""
    if n == 1:
        return arrays
    c = config
    kv_size = kv_heads(c, n) * c.head_dim
    qkv = _kv_repeat_rows(c, n)[_split_rows([c.q_size, kv_size, kv_size], n)]

    def take(value, rows, axis):
        if isinstance(value, dict):
            return {k: np.take(v, rows, axis=axis) for k, v in value.items()}
        return np.take(value, rows, axis=axis)

    def halves(width):  # [gate | up] of width each
        return _split_rows([width, width], n)

    out = dict(arrays)
    for name, value in arrays.items():
        if value is None:
            continue
        if name in ("wqkv", "bqkv"):
            out[name] = take(value, qkv, 0)
        elif name == "w_gate_up":
            rows = (value["scales"] if isinstance(value, dict) else value).shape[0]
            out[name] = take(value, halves(rows // 2), 0)
        elif name == "w_experts_gate_up" and not expert_parallel:  # (experts stay float)
            out[name] = take(value, halves(value.shape[-1] // 2), value.ndim - 1)
    return out
