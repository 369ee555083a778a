"""GGUF block decoding (engine/quant/gguf_blocks.py) against the gguf package's own.

Q8_0, Q4_0 and Q4_1 blocks come from the gguf package's quantizers; it has none for the
K-quants, so their blocks are random bytes with finite half-precision scales, which
covers every bit of the packed scales and quants."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from engine.quant.gguf_blocks import BLOCK_FORMATS, dequantize

ROWS, COLS = 6, 512


def _random_blocks(name: str, rng: np.random.Generator) -> np.ndarray:
    fmt = BLOCK_FORMATS[name]
    raw = rng.integers(0, 256, size=(ROWS, COLS // fmt.weights, fmt.nbytes), dtype=np.uint8)
    halves = {"Q4_K": (0, 2), "Q6_K": (208,)}[name]
    for at in halves:  # finite scales of a realistic size
        raw[:, :, at:at + 2] = rng.uniform(-0.05, 0.05, raw.shape[:2]).astype(
            np.float16)[..., None].view(np.uint8)
    return raw.reshape(ROWS, -1)


@pytest.mark.parametrize("name", sorted(BLOCK_FORMATS))
def test_blocks_decode_to_the_gguf_package_s_values(name):
    rng = np.random.default_rng(7)
    kind = GGMLQuantizationType[name]
    if name in ("Q8_0", "Q4_0", "Q4_1"):
        raw = quants.quantize(rng.standard_normal((ROWS, COLS)).astype(np.float32), kind)
    else:
        raw = _random_blocks(name, rng)
    expected = quants.dequantize(raw, kind)
    got = dequantize(torch.from_numpy(raw), name, COLS)
    assert got.dtype == torch.float32 and got.shape == (ROWS, COLS)
    torch.testing.assert_close(got, torch.from_numpy(expected), rtol=1e-6, atol=1e-7)
    fmt = BLOCK_FORMATS[name]
    assert fmt.nbytes * 8 == fmt.bits * fmt.weights


def test_a_row_that_is_not_whole_blocks_is_refused():
    raw = torch.zeros(2, 20, dtype=torch.uint8)
    with pytest.raises(ValueError, match="not whole blocks"):
        dequantize(raw, "Q4_1", 40)
    with pytest.raises(ValueError, match="take 20 bytes a row"):
        dequantize(torch.zeros(2, 19, dtype=torch.uint8), "Q4_1", 32)


# ---- the formats read, and the refusal of the rest (engine/quant/__init__.py) ---------------
def test_a_quantized_checkpoint_in_an_unread_format_is_refused_naming_it(tiny_llama, tmp_path):
    """A quantized directory failed deep in the loader ("unexpected checkpoint tensor");
    a format not read is now refused before any weight is read, naming the format and
    what is read."""
    import json
    import shutil

    from engine import LLM
    from engine.errors import UnsupportedQuantizationError
    for method in ("bitsandbytes", "hqq", "mxfp4"):
        model = tmp_path / method
        shutil.copytree(tiny_llama, model)
        config = json.loads((model / "config.json").read_text())
        config["quantization_config"] = {"quant_method": method, "bits": 4}
        (model / "config.json").write_text(json.dumps(config))
        with pytest.raises(UnsupportedQuantizationError) as info:
            LLM(str(model), dtype="float32")
        assert f"quantized with {method!r}" in str(info.value)
        assert "gguf (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K)" in str(info.value)


def test_a_gguf_file_with_unread_tensor_types_is_refused_before_conversion(tmp_path,
                                                                           monkeypatch):
    import gguf

    from engine.errors import UnsupportedQuantizationError
    from engine.model.loader import resolve_model
    monkeypatch.setenv("FLOTILLA_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 36), dtype=np.uint8),
                      raw_shape=(4, 36), raw_dtype=GGMLQuantizationType.IQ4_NL)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedQuantizationError, match="of type IQ4_NL, which Flotilla"):
        resolve_model(str(path))
    assert not list((tmp_path / "cache" / "models").glob("model-*"))  # nothing converted


def test_the_default_model_s_gguf_holds_only_types_that_are_read():
    from gguf import GGUFReader

    from engine.model.loader import default_model_gguf
    from engine.quant import check_gguf_types
    types = {t.tensor_type.name for t in GGUFReader(str(default_model_gguf())).tensors}
    assert types == {"Q4_1", "Q8_0", "F32"}
    check_gguf_types(types, "default")
