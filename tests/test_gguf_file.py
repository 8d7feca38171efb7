"""The GGUF reader (loading.gguf_file) against the `gguf` package's own reader: the same
fields and the same tensors, on the embedded model's file (Q4_1, Q8_0 and F32 tensors, a
49,152-token vocabulary) and on a file written with every kind of field and tensor."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from xlr_jax.errors import ModelLoadError
from xlr_jax.loading.gguf_file import GGUFFile
from xlr_jax.loading.registry import resolve_model
from xlr_jax.loading.weights import open_source


def same_as_gguf_reader(path) -> None:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    # the gguf reader lists the header's own counts as fields too
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields == expected
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(int(n) for n in b.shape)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        np.testing.assert_array_equal(a.data, b.data)


def test_embedded_model_reads_as_gguf_reads_it():
    same_as_gguf_reader(resolve_model("smollm2"))


def test_every_field_and_tensor_kind(tmp_path):
    path = tmp_path / "kinds.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 7)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 700)
    writer.add_int16("t.i16", -700)
    writer.add_uint32("t.u32", 70000)
    writer.add_int32("t.i32", -70000)
    writer.add_uint64("t.u64", 2 ** 40)
    writer.add_int64("t.i64", -(2 ** 40))
    writer.add_float32("t.f32", 0.25)
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo")
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.floats", [0.5, 1.5])
    writer.add_array("t.strs", ["a", "", "ü"])
    writer.add_array("t.bools", [True, False])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 4)).astype(np.float16))
    writer.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    for kind in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0):
        w = rng.standard_normal((4, 64)).astype(np.float32)
        writer.add_tensor(kind.name, gguf.quants.quantize(w, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    same_as_gguf_reader(path)
    ours = GGUFFile(path)
    assert ours.fields["t.strs"] == ["a", "", "ü"] and ours.fields["t.f64"] == 1e-300
    q8 = next(t for t in ours.tensors if t.name == "Q8_0")
    assert gguf.quants.dequantize(q8.data, q8.tensor_type).shape == (4, 64)


@pytest.mark.parametrize("damage", ["truncated", "not gguf", "empty"])
def test_damaged_file_is_a_clear_error(tmp_path, damage):
    path = tmp_path / "bad.gguf"
    whole = resolve_model("smollm2").read_bytes()[:2_000_000]
    path.write_bytes({"truncated": whole, "not gguf": b"PK\x03\x04" + whole[4:],
                      "empty": b""}[damage])
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        open_source(path, None)
