"""engine.quant.gguf_index reads the same tensor table, bytes and scalars as the gguf
package's own GGUFReader (which the engine no longer runs at start: it parses every
tokenizer string)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

from engine.errors import UnsupportedModelError
from engine.model.loader import default_model_gguf
from engine.quant.gguf_index import GGUFIndex
from engine.quant.gguf_weights import iter_gguf_weights


def _same_as_reader(path) -> GGUFIndex:
    index, reader = GGUFIndex(path), GGUFReader(str(path))
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    for mine, theirs in zip(index.tensors, reader.tensors):
        assert mine.type_name == theirs.tensor_type.name
        assert mine.shape == tuple(int(d) for d in theirs.shape)
        assert mine.offset == theirs.data_offset and mine.nbytes == theirs.n_bytes
        ours = index.array(mine)
        if mine.type_name != "BF16":  # GGUFReader leaves BF16 as bytes
            assert ours.shape == theirs.data.shape and ours.dtype == theirs.data.dtype
        assert np.array_equal(ours.view(np.uint8).ravel(), theirs.data.view(np.uint8).ravel())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or field.types[0] == GGUFValueType.ARRAY:
            assert key not in index.metadata
        else:
            assert index.metadata[key] == pytest.approx(field.contents()), key
    return index


def test_default_model_matches_gguf_reader():
    index = _same_as_reader(default_model_gguf())
    assert index.metadata["llama.attention.head_count_kv"] == 3
    assert {t.type_name for t in index.tensors} >= {"Q4_1", "F32"}


def test_every_kind_of_field_and_tensor(tmp_path):
    path = tmp_path / "mixed.gguf"
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint32("general.alignment", 64)  # not the default 32
    writer.add_head_count(4)
    writer.add_float64("test.f64", 0.125)
    writer.add_bool("test.flag", True)
    writer.add_int8("test.i8", -3)
    writer.add_array("test.ints", [1, 2, 3])
    writer.add_array("test.strings", ["a", "", "ünïcode"])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_string("test.after", "still read")  # after the skipped arrays
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 7)).astype(np.float16))
    bf16 = torch.randn(4, 8).to(torch.bfloat16)
    writer.add_tensor("bf16", bf16.view(torch.int16).numpy(),
                      raw_dtype=GGMLQuantizationType.BF16)
    writer.add_tensor("q8", quants.quantize(rng.standard_normal((4, 64)).astype(np.float32),
                                            GGMLQuantizationType.Q8_0),
                      raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    index = _same_as_reader(path)
    assert index.metadata["test.after"] == "still read"
    assert "test.strings" not in index.metadata
    assert torch.equal(torch.from_numpy(index.array(index.tensors[2]).copy())
                       .view(torch.bfloat16), bf16)
    assert index.array(index.tensors[3]).shape == (4, 2 * 34)  # 2 blocks of 34 bytes a row


def test_bf16_tensor_reaches_the_loader_as_bf16(tmp_path):
    path = tmp_path / "norm.gguf"
    writer = GGUFWriter(str(path), "llama")
    norm = torch.randn(16).to(torch.bfloat16)
    writer.add_tensor("output_norm.weight", norm.view(torch.int16).numpy(),
                      raw_dtype=GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    [(name, value)] = list(iter_gguf_weights(path))
    assert name == "model.norm.weight" and value.dtype == torch.bfloat16
    assert torch.equal(value, norm)


def test_not_a_gguf_file_is_refused(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(UnsupportedModelError, match="not a GGUF file"):
        GGUFIndex(path)
