"""Weights kept quantized: 4-bit and 8-bit values in groups of 32 along the input, each
group with its own scale (and for 4 bits a minimum), as llama.cpp's Q4_0/Q4_1/Q8_0
blocks hold them.

A `QuantizedTensor` is a weight [out, in] as a pytree the steps take in place of an
array: the decoder's products (`decoder.linear`) and the embedding (`rows`) read it;
nothing else needs to know. Layouts, one row of `in` values in groups of 32:

  bits=4  values uint8 [out, in / 2]: group g's byte j holds value j in its low nibble and
          value j + 16 in its high one (llama.cpp's order, so a GGUF block is copied as
          it is); w = scale * q + minimum, q in 0..15
  bits=8  values int8 [out, in]; w = scale * q, q in -127..127

  scales, minimums  float16 [out, in / 32]

Q4_0 (w = d (q - 8)) is the 4-bit layout with minimum -8 d; quantizing float weights
(`quantize`) gives Q4_1's asymmetric groups or Q8_0's symmetric ones.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from xlr_jax.pytree import pytree_dataclass

GROUP = 32
# how a load holds the weight matrices: in the compute dtype, in a GGUF's own formats
# (those of GGUF_KEPT), or quantized at load to one of FORMATS
WEIGHTS = ("float", "native", "int8", "int4")
FORMATS = ("int4", "int8")
BYTES_PER_VALUE = {"int8": (GROUP + 2) / GROUP, "int4": (GROUP / 2 + 4) / GROUP}
GGUF_KEPT = ("Q4_0", "Q4_1", "Q8_0")  # llama.cpp's types kept as they are


@pytree_dataclass
class QuantizedTensor:
    values: jax.Array          # see the module docstring
    scales: jax.Array          # float16 [out, in / GROUP]
    minimums: jax.Array | None = None  # float16 [out, in / GROUP] (4 bits); None: 8 bits

    @property
    def bits(self) -> int:
        return 8 if self.minimums is None else 4

    @property
    def shape(self) -> tuple[int, int]:
        return self.values.shape[0], self.scales.shape[-1] * GROUP

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree_util.tree_leaves(self))

    def dequantize(self, dtype=jnp.float32):
        """The weight [out, in] in `dtype`."""
        return dequantize_rows(self, None, dtype)

    def rows(self, ids, dtype=jnp.float32):
        """Rows `ids` (any shape) dequantized: [*ids.shape, in] (the embedding's gather)."""
        return dequantize_rows(self, ids, dtype)


def dequantize_rows(w: QuantizedTensor, ids, dtype):
    """Rows `ids` of `w` (all of them for None) in `dtype`, computed in f32."""
    pick = (lambda a: a) if ids is None else (lambda a: a[ids])  # noqa: E731
    values, scales = pick(w.values), pick(w.scales).astype(jnp.float32)
    groups = scales.shape[-1]
    if w.minimums is None:
        q = values.reshape(*values.shape[:-1], groups, GROUP).astype(jnp.float32)
        out = q * scales[..., None]
    else:
        packed = values.reshape(*values.shape[:-1], groups, GROUP // 2)
        q = jnp.concatenate([packed & 15, packed >> 4], axis=-1).astype(jnp.float32)
        out = q * scales[..., None] + pick(w.minimums).astype(jnp.float32)[..., None]
    return out.reshape(*out.shape[:-2], groups * GROUP).astype(dtype)


# ---------------------------------------------------------------- on the host (numpy)

def quantize(w: np.ndarray, fmt: str) -> dict:
    """Host arrays of `w` [out, in] (in a multiple of GROUP) in `fmt` ("int4": each group
    between its minimum and maximum in 15 steps, Q4_1's rule; "int8": by its largest
    magnitude in 127 steps, Q8_0's), as `QuantizedTensor`'s fields."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; choose one of {FORMATS}")
    out, n = w.shape
    if n % GROUP:
        raise ValueError(f"a weight of {n} inputs does not split into groups of {GROUP}")
    g = np.asarray(w, np.float32).reshape(out, n // GROUP, GROUP)
    if fmt == "int8":
        scale = (np.abs(g).max(axis=-1) / 127).astype(np.float16)
        q = np.clip(np.round(g * _reciprocal(scale)), -127, 127).astype(np.int8)
        return {"values": q.reshape(out, n), "scales": scale}
    low = g.min(axis=-1)
    scale = ((g.max(axis=-1) - low) / 15).astype(np.float16)
    minimum = low.astype(np.float16)
    q = np.clip(np.round((g - minimum.astype(np.float32)[..., None]) * _reciprocal(scale)),
                0, 15)
    q = q.astype(np.uint8)
    packed = q[..., :GROUP // 2] | (q[..., GROUP // 2:] << 4)
    return {"values": packed.reshape(out, n // 2), "scales": scale, "minimums": minimum}


def _reciprocal(scale: np.ndarray) -> np.ndarray:
    """1 / scale in f32 for each group, [..., 1] (0 for a group of zeros)."""
    s = scale.astype(np.float32)
    return np.divide(1, s, out=np.zeros(s.shape, np.float32), where=s != 0)[..., None]


def from_gguf_blocks(kind: str, blocks: np.ndarray, shape: tuple[int, int]) -> dict:
    """`QuantizedTensor`'s host arrays from a GGUF tensor's raw blocks (uint8 [out,
    bytes a row]) of llama.cpp type `kind` ("Q4_0", "Q4_1" or "Q8_0")."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # only a GGUF load needs it

    out, n = shape
    size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]][1]  # a block of 32's bytes
    if n % GROUP or blocks.shape != (out, n // GROUP * size):
        raise ValueError(f"a {kind} tensor of shape {shape} does not split into its "
                         f"{GROUP}-value blocks")
    b = np.ascontiguousarray(blocks).reshape(out, n // GROUP, size)
    scale = b[..., 0:2].copy().view(np.float16)[..., 0]
    if kind == "Q8_0":
        return {"values": b[..., 2:].copy().view(np.int8).reshape(out, n), "scales": scale}
    if kind == "Q4_1":
        minimum, packed = b[..., 2:4].copy().view(np.float16)[..., 0], b[..., 4:]
    else:  # Q4_0: w = d (q - 8)
        minimum, packed = (scale.astype(np.float32) * -8).astype(np.float16), b[..., 2:]
    return {"values": packed.reshape(out, n // 2).copy(), "scales": scale, "minimums": minimum}


def is_quantized(a) -> bool:
    """Whether a loader leaf is `QuantizedTensor`'s host arrays (a dict) or a tensor."""
    return isinstance(a, (dict, QuantizedTensor))


def host_dequantize(fields: dict) -> np.ndarray:
    """The f32 weight of a loader leaf's quantized arrays."""
    return np.asarray(QuantizedTensor(**fields).dequantize())


def map_rows(fn, a):
    """`fn` over a weight's rows: an array, or each array of a quantized one (all are
    [out, ...])."""
    return {k: fn(v) for k, v in a.items()} if is_quantized(a) else fn(a)


def join_rows(parts: list):
    """Weights stacked along their rows (fused Q/K/V, gate/up); parts quantized alike stay
    quantized, a mix is joined as f32."""
    if all(is_quantized(p) for p in parts) and len({tuple(p) for p in parts}) == 1:
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    return np.concatenate([host_dequantize(p) if is_quantized(p) else p for p in parts])


def as_weight(a, fmt: str, dtype):
    """A matrix leaf as the load asks: kept as it came quantized, quantized to `fmt`
    ("int4", "int8"), or an array in `dtype`."""
    if is_quantized(a):
        return a
    return quantize(a, fmt) if fmt in FORMATS else np.asarray(a, dtype)
