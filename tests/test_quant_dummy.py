"""load_format dummy over a config that declares fp8 or AWQ quantization
(engine/quant/dummy.py): the weights are that format's random bytes, loaded and held as a
checkpoint's would be, not float weights under a quantized name (what bench/gpu.py times
as FP8 and AWQ decode steps)."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig

from engine.config import EngineConfig
from engine.cpu_features import cpu_has_native_bf16
from engine.core.engine_core import EngineCore
from engine.core_messages import EngineCoreRequest
from engine.errors import UnsupportedQuantizationError
from engine.quant import dummy_weights, quantization_config
from engine.sampling_params import SamplingParams


# bf16 where the CPU runs it (the engine refuses bf16 elsewhere); float32 holds twice
# bf16's bytes a weight, so the savings below only grow there
DTYPE = "bfloat16" if cpu_has_native_bf16() else "float32"


def _config_dir(root, fmt: str | None, group_size: int = 128):
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=False,
                      architectures=["LlamaForCausalLM"])
    d = root / f"{fmt or 'float'}-{group_size}"
    d.mkdir()
    cfg.to_json_file(d / "config.json")
    if fmt is not None:
        data = json.loads((d / "config.json").read_text())
        data["quantization_config"] = quantization_config(fmt, group_size)
        (d / "config.json").write_text(json.dumps(data))
    return d


def _run(model_dir) -> tuple[int, list[int], set[str]]:
    core = EngineCore(EngineConfig(model=str(model_dir), load_format="dummy",
                                   dtype=DTYPE, max_num_seqs=4))
    try:
        core.add_request(EngineCoreRequest("r", [1, 2, 3, 4], SamplingParams(
            temperature=0.0, max_tokens=6, ignore_eos=True)))
        tokens = []
        for _ in range(100):
            for out in core.step():
                tokens += out.new_token_ids
            if not core.has_unfinished_requests():
                break
        packings = {m.packing() for m in core.runner.model.modules()
                    if hasattr(m, "packing") and getattr(m, "quant", None) is not None}
        return core.runner.memory_usage()["weights_bytes"], tokens, packings
    finally:
        core.shutdown()


@pytest.mark.parametrize("fmt", ["fp8", "awq"])
def test_a_dummy_load_of_a_quantized_config_holds_that_format(tmp_path, fmt):
    float_bytes, float_tokens, float_packings = _run(_config_dir(tmp_path, None))
    got_bytes, tokens, packings = _run(_config_dir(tmp_path, fmt))
    assert len(tokens) == len(float_tokens) == 6 and not float_packings
    assert packings, "no linear holds quantized weights"
    # the decoder's linears: bf16's 2 bytes a weight against fp8's 1 or AWQ's ~0.56
    linear_weights = 2 * (128 * 256 + 128 * 128 + 3 * 128 * 256)
    assert float_bytes - got_bytes >= linear_weights * (0.9 if fmt == "fp8" else 1.3)


@pytest.mark.parametrize("group_size", [32, -1])
def test_a_dummy_awq_load_takes_the_configs_group_size(tmp_path, group_size):
    """The scales and zeros made for the config's groups (32, or -1: one group a row),
    which the loader reads them as."""
    got_bytes, tokens, packings = _run(_config_dir(tmp_path, "awq", group_size))
    assert len(tokens) == 6 and packings


def test_dummy_tensors_are_the_formats_own():
    from engine.model.shape import ModelShape
    cfg = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=True)
    shape = ModelShape.from_hf_config(cfg)
    fp8 = dict(dummy_weights(shape, "fp8"))
    w = fp8["model.layers.0.mlp.down_proj.weight"]
    assert w.dtype == torch.float8_e4m3fn and w.shape == (128, 256)
    assert not torch.isnan(w.float()).any()
    awq = dict(dummy_weights(shape, "awq"))
    assert awq["model.layers.0.self_attn.k_proj.qweight"].shape == (128, 64 // 8)
    assert awq["model.layers.0.mlp.down_proj.scales"].shape == (256 // 128, 128)
    assert awq["model.layers.0.mlp.down_proj.qzeros"].shape == (256 // 128, 128 // 8)
    assert fp8["model.layers.0.self_attn.o_proj.weight_scale"].numel() == 1
    grouped = dict(dummy_weights(shape, "awq", group_size=32))
    assert grouped["model.layers.0.mlp.down_proj.scales"].shape == (256 // 32, 128)
    assert "lm_head.weight" not in awq  # tied: the embedding is the head
    with pytest.raises(UnsupportedQuantizationError, match="awq, fp8"):
        next(dummy_weights(shape, "gptq"))
