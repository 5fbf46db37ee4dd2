"""kiln's one-pass GGUF header reader against the gguf package's reader."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from kiln.loader.gguf_header import read_gguf


def reference(path: Path) -> tuple[dict, list]:
    reader = gguf.GGUFReader(str(path))
    fields = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    return fields, reader.tensors


def assert_same(path: Path) -> None:
    fields, tensors = read_gguf(path)
    ref_fields, ref_tensors = reference(path)
    assert fields == ref_fields
    assert [t.name for t in tensors] == [t.name for t in ref_tensors]
    for ours, theirs in zip(tensors, ref_tensors):
        assert ours.tensor_type == int(theirs.tensor_type) and list(ours.shape) == [int(d) for d in theirs.shape]
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape
        assert np.array_equal(ours.data, theirs.data), ours.name


def test_embedded_smollm2_reads_as_the_gguf_package_reads_it():
    from kiln.loader import embedded_gguf_path

    assert_same(embedded_gguf_path())


def test_every_value_type_and_tensor_layout(tmp_path):
    path = tmp_path / "all.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 7)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 65000)
    writer.add_int16("t.i16", -3000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.25)
    writer.add_uint64("t.u64", 2**60)
    writer.add_int64("t.i64", -(2**60))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo")
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.floats", [0.5, 1.5])
    writer.add_array("t.strs", ["a", "", "ü"])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((4, 2)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same(path)
    fields, tensors = read_gguf(path)
    assert fields["t.str"] == "héllo" and fields["t.strs"] == ["a", "", "ü"] and fields["t.bool"] is True
    assert [t.data.shape for t in tensors] == [(3, 5), (4, 2), (2, 68)]


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(path)


def test_kiln_s_ggml_type_table_is_the_gguf_package_s():
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    from kiln.loader.ggml_types import GGML_TYPES

    theirs = {int(t): (t.name, *GGML_QUANT_SIZES[t]) for t in GGMLQuantizationType if t in GGML_QUANT_SIZES}
    both = theirs.keys() & GGML_TYPES.keys()  # an older package lacks the newest types, a newer one has more
    assert {k: theirs[k] for k in both} == {k: GGML_TYPES[k] for k in both}
    assert {"F32", "F16", "BF16", "Q4_1", "Q8_0", "Q4_K", "Q6_K"} <= {name for name, _, _ in GGML_TYPES.values()}


def test_a_tensor_type_nobody_knows_is_refused_by_name(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    writer.add_tensor("w", np.ones((2, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = bytearray((tmp_path / "t.gguf").read_bytes())
    at = data.index(b"w", 24) + 1 + 4 + 2 * 8  # the tensor's name, then n_dims u32 and two u64 dims
    data[at:at + 4] = (250).to_bytes(4, "little")  # its type id
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="tensor 'w' has GGML type 250, which neither kiln nor the gguf package knows"):
        read_gguf(tmp_path / "bad.gguf")


def test_reading_the_embedded_model_imports_no_gguf_package():
    import subprocess
    import sys

    code = ("import sys; from kiln.loader import embedded_gguf_path; from kiln.loader.gguf_file import GGUFCheckpoint; "
            "c = GGUFCheckpoint(embedded_gguf_path()); c.config(); c.tokenizer(); n = sum(1 for _ in c.weights()); "
            "print(n, 'gguf' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert int(out[0]) > 0 and out[1] == "False"
