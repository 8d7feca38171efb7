"""A GGUF file's metadata and tensors, read in one pass.

The `gguf` package's reader builds a numpy view for every element of every array field:
3.6 s for the embedded model's 49,152-token vocabulary and its merges, most of a first
start's parse. This reads the same header with `struct` and array fields of numbers as
one `np.frombuffer` each (0.1 s), and hands out the tensors as views of one memory map,
shaped as the `gguf` reader shapes them (quantized ones as rows of blocks' bytes, for
`gguf.quants.dequantize`). Little-endian files, GGUF versions 2 and 3.
"""
from __future__ import annotations

import functools
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF value types: 0-7, 10-12 fixed-size scalars (struct format), 8 string, 9 array
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
           12: "d"}
STRING, ARRAY = 8, 9
# tensor types held as their own element type; every other (quantized) type as bytes
PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
         GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
         GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
         GGMLQuantizationType.I64: np.int64}


@functools.cache
def readable_types() -> tuple[str, ...]:
    """The tensor types a load reads: those the `gguf` package's dequantizer takes (one
    block of zeros tried each)."""
    names = []
    for kind in GGMLQuantizationType:
        try:
            gguf.quants.dequantize(np.zeros((1, GGML_QUANT_SIZES[kind][1]), np.uint8), kind)
        except NotImplementedError:
            continue
        names.append(kind.name)
    return tuple(names)


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the fastest-moving dimension first
    data: np.ndarray        # reversed(shape); quantized: [..., bytes of a row]


class GGUFFile:
    """`fields`: each metadata key's value (numbers, bools, strings, lists of them);
    `tensors`: in the file's order. Raises ValueError for a file that is not GGUF or is
    cut short."""

    def __init__(self, path: str | Path):
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._at = 0
        if self._read(4) != MAGIC:
            raise ValueError("not a GGUF file (no GGUF magic)")
        version, tensor_count, field_count = self._unpack("<IQQ")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3; a "
                             "big-endian file reads as a huge version)")
        self.fields: dict[str, object] = {}
        for _ in range(field_count):
            key = self._string()
            self.fields[key] = self._value(*self._unpack("<I"))
        infos = [(self._string(), *self._tensor_info()) for _ in range(tensor_count)]
        alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-self._at // alignment) * alignment
        buffer = np.frombuffer(self._map, np.uint8)
        self.tensors = [self._tensor(buffer, start, *info) for info in infos]

    def _read(self, n: int) -> bytes:
        if self._at + n > len(self._map):
            raise ValueError("the GGUF file is cut short")
        out = self._map[self._at:self._at + n]
        self._at += n
        return out

    def _unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self._read(struct.calcsize(fmt)))

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        return self._read(n).decode("utf-8")

    def _value(self, kind: int):
        if kind in SCALARS:
            return self._unpack("<" + SCALARS[kind])[0]
        if kind == STRING:
            return self._string()
        if kind != ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, count = self._unpack("<IQ")
        if item in SCALARS and item != 7:  # numbers: one view of the whole run
            dtype = np.dtype("<" + SCALARS[item])
            return np.frombuffer(self._read(count * dtype.itemsize), dtype).tolist()
        return [self._value(item) for _ in range(count)]

    def _tensor_info(self) -> tuple[tuple[int, ...], int, int]:
        (dims,) = self._unpack("<I")
        shape = self._unpack(f"<{dims}Q")
        kind, offset = self._unpack("<IQ")
        return shape, kind, offset

    @staticmethod
    def _tensor(buffer: np.ndarray, start: int, name: str, shape: tuple[int, ...],
                kind_id: int, offset: int) -> GGUFTensor:
        try:
            kind = GGMLQuantizationType(kind_id)
        except ValueError:
            raise ValueError(f"tensor {name!r} is of tensor type {kind_id}, which the gguf "
                             "package does not know (a newer llama.cpp type? try a newer "
                             "gguf package, or requantize the file)") from None
        block, block_bytes = GGML_QUANT_SIZES[kind]
        dims = tuple(reversed(shape))
        if dims and dims[-1] % block:
            raise ValueError(f"tensor {name!r} has rows of {dims[-1]} values, not a whole "
                             f"number of {kind.name}'s {block}-value blocks")
        n_bytes = int(np.prod(shape)) * block_bytes // block
        begin = start + offset
        if begin + n_bytes > buffer.size:
            raise ValueError(f"the GGUF file is cut short (tensor {name!r})")
        raw = buffer[begin:begin + n_bytes]
        if kind in PLAIN:
            data = raw.view(PLAIN[kind]).reshape(dims)
        else:
            data = raw.reshape(*dims[:-1], dims[-1] // block * block_bytes)
        return GGUFTensor(name, kind, tuple(shape), data)
