"""Weights kept quantized: 4-bit, 8-bit and fp8 values in groups along the input, each
group with its own scale (and for 4 bits a minimum), as llama.cpp's blocks hold them.

A `QuantizedTensor` is a weight [out, in] as a pytree the steps take in place of an
array: the decoder's products (`decoder.linear`) and the embedding (`rows`) read it;
nothing else needs to know. A row's `in` values fall in groups of `group` (in / the
scales' columns); layouts:

  4 bits  values uint8 [out, in / 2]: a group's byte j holds value j in its low nibble and
          value j + group / 2 in its high one (llama.cpp's Q4_0/Q4_1 order, so their
          blocks are copied as they are); w = scale * q + minimum, q in 0..15; a group
          is a multiple of 32 values
  8 bits  values int8 [out, in]; w = scale * q; a group is a multiple of 16 values
  fp8     values float8_e4m3fn [out, in]; w = scale * q; one group a row

  scales, minimums  float16, or float32 where float16 would round them, [out, groups]

From a GGUF (`from_gguf_blocks`, GGUF_KEPT): Q8_0 is 8 bits in groups of 32; Q4_1 and
Q4_0 (w = d (q - 8): minimum -8 d) are 4 bits in groups of 32; Q4_K's 32-value
sub-blocks become 4-bit groups with float32 scale d * sc and minimum -dmin * m (their
float16 products would round), nibbles reordered; Q6_K's 16-value sub-blocks become
8-bit groups holding q - 32 with float32 scale d * sc. Quantized at load (`quantize`):
"int8" as Q8_0, "int4" as Q4_1 (or symmetric as Q4_0; groups of 128 too), "fp8" with
one float32 scale a row.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from xlr_jax.model.weight_formats import FORMATS
from xlr_jax.pytree import pytree_dataclass

GROUP = {"int4": 32, "int8": 32}  # a format's group at load; fp8: one group a row
# bytes a weight takes in each format at load (fp8's one scale a row left out)
BYTES_PER_VALUE = {"int8": (32 + 2) / 32, "int4": (16 + 4) / 32, "fp8": 1.0}
GGUF_KEPT = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")  # llama.cpp's types kept quantized
FP8_MAX = 448.0  # e4m3's largest finite value


@pytree_dataclass
class QuantizedTensor:
    values: jax.Array          # see the module docstring
    scales: jax.Array          # float16 or float32 [out, groups]
    minimums: jax.Array | None = None  # as the scales (4 bits); None: 8 bits and fp8

    @property
    def format(self) -> str:
        """"int4", "int8" or "fp8" (the values' type)."""
        return {jnp.uint8: "int4", jnp.int8: "int8"}.get(self.values.dtype.type, "fp8")

    @property
    def shape(self) -> tuple[int, int]:
        per_byte = 2 if self.format == "int4" else 1
        return self.values.shape[-2], self.values.shape[-1] * per_byte

    @property
    def group(self) -> int:
        return self.shape[1] // self.scales.shape[-1]

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
    groups, group = scales.shape[-1], w.group
    if w.format == "int4":
        packed = values.reshape(*values.shape[:-1], groups, group // 2)
        q = jnp.concatenate([packed & 15, packed >> 4], axis=-1).astype(jnp.float32)
        out = q * scales[..., None] + pick(w.minimums).astype(jnp.float32)[..., None]
    else:
        q = values.reshape(*values.shape[:-1], groups, group).astype(jnp.float32)
        out = q * scales[..., None]
    return out.reshape(*out.shape[:-2], groups * group).astype(dtype)


# ---------------------------------------------------------------- on the host (numpy)

def quantize(w: np.ndarray, fmt: str, group: int | None = None,
             symmetric: bool = False) -> dict:
    """Host arrays of `w` [out, in] in `fmt`, as `QuantizedTensor`'s fields: "int4" each
    group between its minimum and maximum in 15 steps (Q4_1's rule), or with `symmetric`
    by its largest magnitude in 7 steps either side of 8 (Q4_0's); "int8" by its largest
    magnitude in 127 steps (Q8_0's); "fp8" each row scaled so its largest magnitude is
    e4m3's. `group`: values a scale covers (default GROUP[fmt]; fp8: the row)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; choose one of {FORMATS}")
    out, n = w.shape
    group = group or GROUP.get(fmt, n)
    multiple = 32 if fmt == "int4" else 16  # what the CPU kernel's vectors take
    if n % group or group % multiple:
        raise ValueError(f"a weight of {n} inputs does not split into groups of {group} "
                         f"({fmt} groups are multiples of {multiple} values)")
    g = np.asarray(w, np.float32).reshape(out, n // group, group)
    if fmt == "fp8":
        scale = np.abs(g).max(axis=-1) / FP8_MAX
        q = (g * _reciprocal(scale)).astype(jnp.float8_e4m3fn)
        return {"values": q.reshape(out, n), "scales": scale.astype(np.float32)}
    if fmt == "int8":
        scale = (np.abs(g).max(axis=-1) / 127).astype(np.float16)
        q = np.clip(np.round(g * _reciprocal(scale)), -127, 127).astype(np.int8)
        return {"values": q.reshape(out, n), "scales": scale}
    if symmetric:
        scale = (np.abs(g).max(axis=-1) / 7).astype(np.float16)
        minimum = (scale.astype(np.float32) * -8).astype(np.float16)
    else:
        low = g.min(axis=-1)
        scale = ((g.max(axis=-1) - low) / 15).astype(np.float16)
        minimum = low.astype(np.float16)
    q = np.clip(np.round((g - minimum.astype(np.float32)[..., None]) * _reciprocal(scale)),
                0, 15).astype(np.uint8)
    return {"values": _pack_nibbles(q).reshape(out, n // 2), "scales": scale,
            "minimums": minimum}


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """4-bit values [..., group] as the layout's bytes [..., group / 2]."""
    half = q.shape[-1] // 2
    return q[..., :half] | (q[..., half:] << 4)


def _reciprocal(scale: np.ndarray) -> np.ndarray:
    """1 / scale in f32 for each group, [..., 1] (0 for a group of zeros)."""
    s = scale.astype(np.float32)
    return np.divide(1, s, out=np.zeros(s.shape, np.float32), where=s != 0)[..., None]


def from_gguf_blocks(kind: str, blocks: np.ndarray, shape: tuple[int, int]) -> dict:
    """`QuantizedTensor`'s host arrays from a GGUF tensor's raw blocks (uint8 [out,
    bytes a row]) of llama.cpp type `kind` (one of GGUF_KEPT)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # only a GGUF load needs it

    out, n = shape
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    if n % block or blocks.shape != (out, n // block * size):
        raise ValueError(f"a {kind} tensor of shape {shape} does not split into its "
                         f"{block}-value blocks")
    b = np.ascontiguousarray(blocks).reshape(out, n // block, size)
    if kind in ("Q4_K", "Q6_K"):
        return (_q4_k if kind == "Q4_K" else _q6_k)(b, out, n)
    scale = _half(b[..., 0:2])
    if kind == "Q8_0":
        return {"values": b[..., 2:].copy().view(np.int8).reshape(out, n), "scales": scale}
    if kind == "Q4_1":
        minimum, packed = _half(b[..., 2:4]), b[..., 4:]
    else:  # Q4_0: w = d (q - 8)
        minimum, packed = (scale.astype(np.float32) * -8).astype(np.float16), b[..., 2:]
    return {"values": packed.reshape(out, n // 2).copy(), "scales": scale, "minimums": minimum}


def _half(b: np.ndarray) -> np.ndarray:
    """float16 values from their two bytes [..., 2]: [...]."""
    return b.copy().view(np.float16)[..., 0]


def _q4_k(b: np.ndarray, out: int, n: int) -> dict:
    """Q4_K super-blocks [out, n / 256, 144] (d, dmin, twelve bytes of 6-bit scales and
    minimums for 8 sub-blocks of 32, 128 bytes of nibbles) as 4-bit groups of 32."""
    d, dmin = (_half(b[..., at:at + 2]).astype(np.float32)[..., None] for at in (0, 2))
    s = b[..., 4:16]
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | (s[..., 0:4] >> 6 << 4)], -1)
    m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | (s[..., 4:8] >> 6 << 4)], -1)
    # 32 bytes hold two sub-blocks: the first in their low nibbles, the next in the high
    qs = b[..., 16:].reshape(out, n // 256, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
    values = _pack_nibbles((qs & 15).reshape(out, n // 32, 32))
    return {"values": values.reshape(out, n // 2), "scales": (d * sc).reshape(out, n // 32),
            "minimums": -(dmin * m).reshape(out, n // 32)}


def _q6_k(b: np.ndarray, out: int, n: int) -> dict:
    """Q6_K super-blocks [out, n / 256, 210] (128 bytes of low nibbles, 64 of high bit
    pairs, 16 int8 scales, d) as 8-bit groups of 16 holding q - 32."""
    ql = b[..., :128].reshape(out, n // 256, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
    ql = (ql & 15).reshape(out, n // 256, 2, 4, 32)  # a half's four runs of 32 values
    qh = b[..., 128:192].reshape(out, n // 256, 2, 1, 32) >> np.array([0, 2, 4, 6],
                                                                    np.uint8)[:, None]
    q = (ql | ((qh & 3) << 4)).astype(np.int8) - np.int8(32)
    scale = _half(b[..., 208:210]).astype(np.float32)[..., None] * b[..., 192:208].view(np.int8)
    return {"values": q.reshape(out, n), "scales": scale.reshape(out, n // 16)}


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
