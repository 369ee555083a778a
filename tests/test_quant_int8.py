"""int8 W8A8 checkpoints (compressed-tensors, issue 42): the kernels against a torch
reference of the same integer products, each kernel kind against the others, and the
engine on tiny W8A8 checkpoints (written by tests/int8_helpers.py) against transformers
running the decoded weights in float32: greedy tokens equal but for near ties, logprobs
within the activations' int8 rounding, through chunked prefill, a prefix hit, the decoder
stack and the module path, static activation scales, TP=2 and LoRA."""
from __future__ import annotations

import functools
import json
import logging

import numpy as np
import pytest
import torch

from engine import LLM
from engine.errors import UnsupportedQuantizationError
from tests.conftest import build_tiny_model, cpu_flags
from tests.gguf_helpers import check_against, check_tp2_equals_one_rank
from tests.int8_helpers import write_decoded, write_w8a8


def _reference_product(x, w, scales, bias, input_scale=0.0):
    """x quantized per row (dynamic amax / 127, or a static scale), integer products in
    float64 (exact), scaled."""
    xf = x.float()
    if input_scale > 0:
        sx = torch.full((x.shape[0], 1), input_scale)
        q = torch.round(xf / sx).clamp(-128, 127)
    else:
        sx = xf.abs().amax(-1, keepdim=True) / 127
        sx = torch.where(sx > 0, sx, torch.ones_like(sx))
        q = torch.round(xf / sx).clamp(-127, 127)
    y = (q.double() @ w.double().t()).float() * (sx * scales)
    return y if bias is None else y + bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_kernels_match_the_integer_products(kernels, dtype):
    """Every kind this CPU runs gives the same outputs (the same int32 sums), and they
    are the reference's within float32's rounding of the scaling; odd shapes pad."""
    if dtype == torch.bfloat16 and "bfloat16" not in kernels.linear_dtypes():
        pytest.skip("this CPU has no bf16 kernels")
    default = kernels.int8_kernel()
    try:
        for n, k in [(37, 70), (160, 256), (48, 64)]:
            torch.manual_seed(n)
            w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
            scales = torch.rand(n) * 0.01
            bias = torch.randn(n)
            packed, comp = kernels.int8_pack(w)
            for m in (1, 3, 5, 17, 40):
                x = (torch.randn(m, k) * 3).to(dtype)
                want = _reference_product(x, w, scales, bias)
                outs = {}
                for kind in kernels.int8_kernels():
                    assert kernels.set_int8_kernel(kind)
                    outs[kind] = kernels.int8_linear(x, packed, comp, scales, bias, n)
                    assert outs[kind].dtype == dtype
                    err = (outs[kind].float() - want).abs().max() / want.abs().max()
                    assert err < (1e-5 if dtype == torch.float32 else 8e-3), (kind, n, k, m)
                first = next(iter(outs.values()))
                assert all(torch.equal(o, first) for o in outs.values()), (n, k, m)
                static = kernels.int8_linear(x, packed, comp, scales, None, n, 0.05)
                want = _reference_product(x, w, scales, None, 0.05)
                assert (static.float() - want).abs().max() / want.abs().max() < 8e-3
    finally:
        kernels.set_int8_kernel(default)


def test_the_native_build_takes_the_cpu_s_int8_instructions():
    # a CPU with VNNI (or AMX int8 tiles) runs them by default, never the plain loop
    from engine.model.kernels import cpu_kernels
    flags = cpu_flags()
    kinds = cpu_kernels().int8_kernels()
    if "amx_int8" in flags:
        assert kinds[0] == "amx+vnni" and "amx" in kinds
    if "avx512_vnni" in flags:
        assert "vnni" in kinds and kinds[0] != "plain"


def test_int8_kernel_names_and_refusals(kernels):
    kinds = kernels.int8_kernels()
    assert kinds[-1] == "plain" and kernels.int8_kernel() == kinds[0]
    assert not kernels.set_int8_kernel("tf32")
    with pytest.raises(RuntimeError, match="int8 \\[out, in\\] weight"):
        kernels.int8_pack(torch.zeros(4, 4))
    packed, comp = kernels.int8_pack(torch.zeros(16, 64, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="does not hold"):
        kernels.int8_linear(torch.zeros(2, 128), packed, comp, torch.ones(16), None, 16)


# ---- tiny W8A8 checkpoints --------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory, tiny_tokenizer_dir):
    return build_tiny_model(tmp_path_factory.mktemp("w8a8") / "hf", "llama", tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def tiny_w8a8(tiny_hf):
    return write_w8a8(tiny_hf, tiny_hf.parent / "w8a8")


@functools.cache
def _reference(w8a8_dir, quantize_inputs=True):
    """transformers on the checkpoint's decoded weights (int8 x scale), float32; with
    quantize_inputs, each quantized linear's input rounded to int8 first as W8A8 does
    (per token, or at the checkpoint's static scale)."""
    from transformers import AutoModelForCausalLM

    from tests.int8_helpers import LINEARS
    decoded = write_decoded(w8a8_dir, w8a8_dir.parent / f"{w8a8_dir.name}-decoded")
    model = AutoModelForCausalLM.from_pretrained(str(decoded), dtype=torch.float32).eval()
    if quantize_inputs:
        static = json.loads((w8a8_dir / "config.json").read_text())["quantization_config"][
            "config_groups"]["group_0"]["input_activations"]["dynamic"] is False
        from safetensors.torch import load_file
        state = load_file(str(w8a8_dir / "model.safetensors"))
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in LINEARS:
                scale = float(state[f"{name}.input_scale"]) if static else 0.0
                module.register_forward_pre_hook(
                    lambda _, args, s=scale: (_fake_quantize(args[0], s),))
    return model


def _fake_quantize(x: torch.Tensor, static_scale: float) -> torch.Tensor:
    if static_scale > 0:
        return torch.round(x / static_scale).clamp(-128, 127) * static_scale
    sx = x.abs().amax(-1, keepdim=True) / 127
    sx = torch.where(sx > 0, sx, torch.ones_like(sx))
    return torch.round(x / sx).clamp(-127, 127) * sx


def _prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 40000, n).tolist() for n in lengths]


@pytest.mark.parametrize("stack", ["1", "0"])
def test_engine_on_w8a8_matches_the_decoded_weights(tiny_w8a8, monkeypatch, stack):
    """Chunked prefill (24-token steps), decodes and a prefix hit, on the decoder stack
    and on the module path; the linears stay int8 and memory_usage counts their bytes."""
    monkeypatch.setenv("FLOTILLA_DECODER_STACK", stack)
    llm = LLM(str(tiny_w8a8), dtype="float32", max_num_batched_tokens=24, block_size=8)
    engine = llm.llm_engine.engine_core
    assert engine.quantization == "compressed-tensors"
    model = engine.runner.model
    assert (model.stack is not None) == (stack == "1")
    for linear in (model.layers[0].self_attn.qkv_proj, model.layers[1].mlp.down_proj):
        assert linear.packing() == "int8" and linear.weight is None
    assert model.lm_head.packing() != "int8"  # ignored: stays float (tied to the embedding)
    s = engine.shape
    linear_weights = s.num_layers * s.hidden_size * (
        (s.num_heads + 2 * s.num_kv_heads) * s.head_dim + s.num_heads * s.head_dim
        + 3 * s.intermediate_size)
    floats = sum(p.numel() * 4 for p in model.parameters()) + model.lm_head.packed_bytes()
    # int8 weights (K padded to whole 64s: the tiny model's K are 64 and 128) + scales
    assert engine.runner.memory_usage()["weights_bytes"] == floats + linear_weights + 4 * (
        s.num_layers * ((s.num_heads + 2 * s.num_kv_heads) * s.head_dim + 2 * s.hidden_size
                        + 2 * s.intermediate_size))
    ref = _reference(tiny_w8a8)
    prompts = _prompts(5, (40, 5, 33))
    # the same int8 activations and exact integer products: what differs is float32's
    # summation order, and an activation that lands on a rounding boundary (measured <0.01)
    check_against(llm, ref, prompts, tolerance=0.02, tie=0.02, exact_share=1.0)
    out = check_against(llm, ref, [prompts[0][:32] + [7, 8, 9]], tolerance=0.02, tie=0.02,
                        exact_share=1.0)
    assert out[0].num_cached_tokens > 0


def test_per_tensor_weights_and_static_activation_scales(tiny_hf):
    static = {name: 0.02 for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                      "up_proj", "down_proj")}
    path = write_w8a8(tiny_hf, tiny_hf.parent / "w8a8-static", per_channel=False,
                      static_inputs=static, scale_dtype=torch.bfloat16)
    llm = LLM(str(path), dtype="float32", block_size=8)
    qkv = llm.llm_engine.engine_core.runner.model.layers[0].self_attn.qkv_proj
    assert qkv.quant.input_scale == pytest.approx(0.02, rel=1e-2)
    assert qkv.quant.scales.unique().numel() == 3  # q, k and v: a scale per tensor each
    check_against(llm, _reference(path), _prompts(6, (20, 9)), tolerance=0.02, tie=0.02,
                  exact_share=1.0)


def test_w8a8_under_tensor_parallelism_equals_one_rank(tiny_w8a8):
    """Each rank reads its rows (q/k/v, gate/up) with their scales, or its columns (o,
    down) with all of theirs; TP=2 gives the single engine's tokens."""
    check_tp2_equals_one_rank(tiny_w8a8)


def test_lora_on_a_w8a8_base_matches_peft_on_the_decoded_weights(tiny_w8a8, tmp_path):
    from engine.lora.request import LoRARequest
    from tests.test_lora import ALL, adapter_id, make_adapter
    decoded = write_decoded(tiny_w8a8, tmp_path / "base")
    model = make_adapter(decoded, tmp_path / "ad", 8, ALL, seed=3).eval()
    llm = LLM(str(tiny_w8a8), dtype="float32", enable_lora=True, max_lora_rank=8)
    lora = LoRARequest("ad", adapter_id("ad"), str(tmp_path / "ad"))
    check_against(llm, model, [list(range(300, 320)), list(range(900, 905))],
                  exact_share=0.5, lora_request=lora)


def test_without_the_kernels_int8_weights_are_decoded_and_the_log_says_so(
        tiny_w8a8, monkeypatch, caplog):
    import engine.executor.model_runner
    monkeypatch.setattr(engine.executor.model_runner, "cpu_kernels", lambda: None)
    monkeypatch.setattr(engine.executor.model_runner, "native_enabled", lambda: False)
    with caplog.at_level(logging.WARNING, logger="engine.executor.model_runner"):
        llm = LLM(str(tiny_w8a8), dtype="float32", block_size=8)
    assert "compressed-tensors weights" in caplog.text and "decoded to torch.float32" in caplog.text
    model = llm.llm_engine.engine_core.runner.model
    assert model.layers[0].self_attn.qkv_proj.packing() is None
    # no activation rounding: the decoded weights' own logits
    check_against(llm, _reference(tiny_w8a8, quantize_inputs=False), [list(range(100, 120))],
                  tolerance=1e-3)


def _with_scheme(src, dst, change):
    import shutil
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    change(config["quantization_config"])
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("change, named", [
    (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="group", group_size=128),
     "weights by 'group'"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=4), "4-bit int weights"),
    (lambda q: q.update(format="pack-quantized"), "format 'pack-quantized'"),
    (lambda q: q["config_groups"]["group_0"].update(input_activations=None), "weight-only"),
    (lambda q: q["config_groups"]["group_0"]["input_activations"].update(symmetric=False),
     "asymmetric"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(type="float"), "float weights"),
])
def test_other_compressed_tensors_schemes_are_refused_by_name(tiny_w8a8, tmp_path, change,
                                                              named):
    path = _with_scheme(tiny_w8a8, tmp_path / "other", change)
    with pytest.raises(UnsupportedQuantizationError, match=named):
        LLM(str(path), dtype="float32")


def test_quantization_option_names_the_w8a8_format(tiny_w8a8):
    LLM(str(tiny_w8a8), dtype="float32", quantization="compressed-tensors", block_size=8)
    with pytest.raises(UnsupportedQuantizationError, match="quantized as 'compressed-tensors'"):
        LLM(str(tiny_w8a8), dtype="float32", quantization="gguf")
