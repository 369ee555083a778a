"""FP8 weights (vLLM's fp8 checkpoints and compressed-tensors' FP8 schemes, issue 42): the
CPU kernel (engine/model/kernels/fp8_linear.cpp) against the decoded weights' products,
torch._scaled_mm's holder (the CUDA path, run here on CPU tensors) against the same with
x rounded to e4m3, and the engine on tiny fp8 checkpoints (tests/fp8_helpers.py) against
transformers on the decoded weights: the stack and the module path, chunked prefill and a
prefix hit, per-channel and per-tensor scales, static and weight-only schemes, TP=2, LoRA,
the Triton backend, the no-kernel decode and named refusals."""
from __future__ import annotations

import functools
import json
import logging

import pytest
import torch

from engine import LLM
from engine.errors import UnsupportedQuantizationError
from engine.quant.fp8 import E4M3_MAX, Fp8ScaledMM
from engine.quant.scaled_pieces import ScaledWeight
from tests.conftest import build_tiny_model
from tests.fp8_helpers import quantize_fp8, write_fp8
from tests.gguf_helpers import check_against, check_tp2_equals_one_rank
from tests.int8_helpers import write_decoded


def test_every_e4m3_byte_widens_exactly(kernels):
    """All 254 finite bytes (subnormals, both signs) as one weight row: the product with a
    one-hot x is the byte's value, on every kind."""
    values = torch.arange(256, dtype=torch.uint8)
    values = values[(values & 0x7F) != 0x7F]  # the two NaNs
    w = values.reshape(-1, 1).repeat(1, 16).view(torch.float8_e4m3fn)  # [254, 16]
    x = torch.zeros(1, 16)
    x[0, 3] = 1.0
    want = w.float()[:, 3]
    default = kernels.fp8_kernel()
    try:
        for kind in kernels.fp8_kernels():
            assert kernels.set_fp8_kernel(kind)
            got = kernels.fp8_linear(x, kernels.fp8_pack(w), torch.ones(w.shape[0]), None,
                                     w.shape[0])
            assert torch.equal(got[0], want), kind
    finally:
        kernels.set_fp8_kernel(default)


@pytest.fixture(params=["fma", "dense"])
def dense_rows(kernels, request):
    """The products past 16 rows by the kernel's FMA tiles (no decoded weight) or by the
    decoded weight (w x scale in x's dtype) through at::matmul, the default past 96."""
    before = kernels.set_fp8_dense_rows(1 << 30 if request.param == "fma" else 16)
    assert before == 96  # the default
    yield request.param
    kernels.set_fp8_dense_rows(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_kernels_match_the_decoded_products(kernels, dtype, dense_rows):
    """bf16 x is widened to float32 like the weight: no bf16 arithmetic is needed (or,
    past the dense rows, the weight is decoded to bf16, w x scale rounded once, and
    oneDNN multiplies)."""
    default = kernels.fp8_kernel()
    try:
        for n, k in [(37, 70), (160, 256), (48, 64), (1100, 32)]:  # 1100: two decoded panels
            torch.manual_seed(n)
            w, scale = quantize_fp8(torch.randn(n, k), per_channel=True)
            bias = torch.randn(n)
            packed = kernels.fp8_pack(w)
            for m in (1, 3, 9, 17, 40):
                x = torch.randn(m, k).to(dtype)
                want = (x.double() @ (w.double() * scale.double()[:, None]).t() + bias).float()
                for kind in kernels.fp8_kernels():
                    assert kernels.set_fp8_kernel(kind)
                    got = kernels.fp8_linear(x, packed, scale, bias, n)
                    assert got.dtype == dtype and got.shape == (m, n)
                    err = (got.float() - want).abs().max() / want.abs().max()
                    assert err < (1e-5 if dtype == torch.float32 else 8e-3), (kind, n, k, m)
                    f = kernels.fp8_linear(x, packed, scale, bias, n, True)
                    assert f.dtype == torch.float32 and torch.equal(f.to(dtype), got)
    finally:
        kernels.set_fp8_kernel(default)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_wise_fp8_kernels_match_the_decoded_products(kernels, dtype, dense_rows):
    """A scale per (block of rows, run of columns): K not a multiple of the run (a short
    last run), N not a multiple of 16, row counts through every tile size."""
    from engine.quant.fp8 import vector_block_scales
    from tests.fp8_helpers import quantize_fp8_blocks
    default = kernels.fp8_kernel()
    try:
        for n, k, block in [(40, 200, (16, 64)), (96, 130, (32, 32)), (16, 64, (128, 128)),
                            (1060, 48, (32, 16))]:  # 1060: past one decoded panel
            torch.manual_seed(n + k)
            w, grid = quantize_fp8_blocks(torch.randn(n, k) * torch.rand(1, k) * 4, block)
            rows = grid.repeat_interleave(block[0], 0)[:n]
            decoded = w.double() * rows.double().repeat_interleave(block[1], 1)[:, :k]
            packed = kernels.fp8_pack(w)
            blocks = vector_block_scales(rows, block[1])
            for m in (1, 3, 9, 17, 40):
                x = torch.randn(m, k).to(dtype)
                want = (x.double() @ decoded.t()).float()
                for kind in kernels.fp8_kernels():
                    assert kernels.set_fp8_kernel(kind)
                    got = kernels.fp8_linear(x, packed, torch.ones(n), None, n, False, blocks,
                                             block[1])
                    err = (got.float() - want).abs().max() / want.abs().max()
                    assert err < (1e-5 if dtype == torch.float32 else 8e-3), (kind, n, k, m)
        with pytest.raises(RuntimeError, match="block scales"):
            kernels.fp8_linear(x, packed, torch.ones(n), None, n, False, blocks, 0)
    finally:
        kernels.set_fp8_kernel(default)


def test_block_scales_that_split_a_vector_are_refused():
    from engine.quant.fp8 import vector_block_scales
    rows = torch.arange(4.0).repeat_interleave(8)[:, None]  # blocks of 8 rows
    with pytest.raises(UnsupportedQuantizationError, match="multiple of 16 rows"):
        vector_block_scales(rows, 128)
    assert torch.equal(vector_block_scales(rows[:16].fill_(2.0), 128), torch.full((1, 1), 2.0))


def test_fp8_kernel_names_and_refusals(kernels):
    kinds = kernels.fp8_kernels()
    assert kinds[-1] == "plain" and kernels.fp8_kernel() == kinds[0]
    assert not kernels.set_fp8_kernel("amx")
    with pytest.raises(RuntimeError, match="e4m3 \\[out, in\\] weight"):
        kernels.fp8_pack(torch.zeros(4, 4))
    packed = kernels.fp8_pack(torch.zeros(16, 64, dtype=torch.float8_e4m3fn))
    with pytest.raises(RuntimeError, match="does not hold"):
        kernels.fp8_linear(torch.zeros(2, 128), packed, torch.ones(16), None, 16)
    for rows in (2, 40):  # the FMA tiles and the decoded panels
        with pytest.raises(RuntimeError, match="a bias of 3 for 16"):
            kernels.fp8_linear(torch.zeros(rows, 64), packed, torch.ones(16), torch.zeros(3), 16)


def _round_e4m3(x: torch.Tensor, static_scale: float = 0.0) -> torch.Tensor:
    """x as _scaled_mm's caller rounds it: per token amax / 448 (or a static scale)."""
    s = (torch.full((x.shape[0], 1), static_scale) if static_scale > 0
         else x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / E4M3_MAX)
    return (x / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * s


@pytest.mark.parametrize("static_scale", [0.0, 0.05])
def test_scaled_mm_holder_rounds_x_to_e4m3_and_scales_per_column(static_scale):
    torch.manual_seed(0)
    w, scale = quantize_fp8(torch.randn(48, 64), per_channel=True)
    held = Fp8ScaledMM.of(ScaledWeight(w, scale, static_scale), torch.device("cpu"))
    x, bias = torch.randn(2, 5, 64), torch.randn(48)
    got = held.matmul(x, bias, float_out=True)
    assert got.shape == (2, 5, 48) and got.dtype == torch.float32
    want = _round_e4m3(x.reshape(-1, 64), static_scale) @ (w.float() * scale[:, None]).t() + bias
    assert ((got.reshape(-1, 48) - want).abs().max() / want.abs().max()) < 8e-3  # bf16 out
    assert Fp8ScaledMM.of(ScaledWeight(w[:40], scale[:40], 0.0), torch.device("cpu")) is None


# ---- tiny fp8 checkpoints -----------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory, tiny_tokenizer_dir):
    return build_tiny_model(tmp_path_factory.mktemp("fp8") / "hf", "llama", tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def tiny_fp8(tiny_hf):
    return write_fp8(tiny_hf, tiny_hf.parent / "fp8")


@functools.cache
def _reference(fp8_dir, round_inputs=False):
    """transformers on the checkpoint's decoded weights (e4m3 x scale), float32; with
    round_inputs, each quantized linear's input rounded to e4m3 per token first and its
    output to bf16, as _scaled_mm's caller does."""
    from transformers import AutoModelForCausalLM

    from tests.int8_helpers import LINEARS
    decoded = write_decoded(fp8_dir, fp8_dir.parent / f"{fp8_dir.name}-decoded")
    model = AutoModelForCausalLM.from_pretrained(str(decoded), dtype=torch.float32).eval()
    if round_inputs:
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in LINEARS:
                module.register_forward_pre_hook(
                    lambda _, args: (_round_e4m3(args[0].reshape(-1, args[0].shape[-1]))
                                     .reshape(args[0].shape),))
                module.register_forward_hook(lambda _, a, out: out.bfloat16().float())
    return model


@pytest.mark.parametrize("stack", ["1", "0"])
def test_engine_on_fp8_matches_the_decoded_weights(tiny_fp8, monkeypatch, stack):
    """Chunked prefill (24-token steps), decodes and a prefix hit, on the decoder stack
    and on the module path; the linears stay e4m3 and memory_usage counts their bytes."""
    monkeypatch.setenv("FLOTILLA_DECODER_STACK", stack)
    llm = LLM(str(tiny_fp8), dtype="float32", max_num_batched_tokens=24, block_size=8)
    engine = llm.llm_engine.engine_core
    assert engine.quantization == "fp8"
    model = engine.runner.model
    assert (model.stack is not None) == (stack == "1")
    for linear in (model.layers[0].self_attn.qkv_proj, model.layers[1].mlp.down_proj):
        assert linear.packing() == "fp8" and linear.weight is None
    s = engine.shape
    rows = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim + 2 * s.hidden_size \
        + 2 * s.intermediate_size  # qkv, o, gate_up, down
    linear_bytes = s.num_layers * s.hidden_size * (
        (s.num_heads + 2 * s.num_kv_heads) * s.head_dim + s.num_heads * s.head_dim
        + 3 * s.intermediate_size)
    floats = sum(p.numel() * 4 for p in model.parameters()) + model.lm_head.packed_bytes()
    assert engine.runner.memory_usage()["weights_bytes"] == \
        floats + linear_bytes + 4 * s.num_layers * rows
    ref = _reference(tiny_fp8)
    prompts = [list(range(100, 140)), list(range(900, 905)), list(range(3000, 3033))]
    # the decoded weights exactly, x unrounded: float32's summation order differs only
    check_against(llm, ref, prompts, tolerance=1e-3, tie=1e-3, exact_share=1.0)
    out = check_against(llm, ref, [prompts[0][:32] + [7, 8, 9]], tolerance=1e-3, tie=1e-3,
                        exact_share=1.0)
    assert out[0].num_cached_tokens > 0


@pytest.mark.parametrize("fmt, per_channel, activations", [
    ("compressed-tensors", True, "dynamic"),   # llm-compressor's FP8_DYNAMIC
    ("compressed-tensors", False, "static"),   # its FP8
    ("compressed-tensors", True, "none"),      # weight-only
    ("fp8", False, "static"),
])
def test_other_fp8_layouts_match_the_decoded_weights(tiny_hf, tmp_path, fmt, per_channel,
                                                     activations):
    path = write_fp8(tiny_hf, tmp_path / "ckpt", fmt, per_channel, activations)
    llm = LLM(str(path), dtype="float32", block_size=8)
    qkv = llm.llm_engine.engine_core.runner.model.layers[0].self_attn.qkv_proj
    assert qkv.packing() == "fp8"
    assert qkv.quant.scales.unique().numel() == (qkv.quant.rows if per_channel else 3)
    check_against(llm, _reference(path), [list(range(200, 220)), list(range(40, 49))],
                  tolerance=1e-3, tie=1e-3, exact_share=1.0)


@pytest.mark.parametrize("fmt, block, stack", [
    ("fp8", (32, 16), "1"),                  # vLLM's weight_block_size, weight_scale_inv
    ("fp8", (16, 32), "0"),
    ("compressed-tensors", (32, 32), "1"),   # llm-compressor's FP8_BLOCK
    ("fp8", (128, 128), "1"),                # DeepSeek's and Qwen's: one partial block
])
def test_block_wise_fp8_matches_the_decoded_weights(tiny_hf, tmp_path, monkeypatch, fmt, block,
                                                    stack):
    """Block scales held as stored (a scale per 16-row vector and run of columns), on the
    decoder stack and the module path, through chunked prefill."""
    monkeypatch.setenv("FLOTILLA_DECODER_STACK", stack)
    path = write_fp8(tiny_hf, tmp_path / "ckpt", fmt, block=block)
    llm = LLM(str(path), dtype="float32", block_size=8, max_num_batched_tokens=16)
    runner = llm.llm_engine.engine_core.runner
    qkv = runner.model.layers[0].self_attn.qkv_proj
    assert qkv.packing() == "fp8" and qkv.quant.block_k == block[1]
    assert (runner.model.stack is not None) == (stack == "1")
    check_against(llm, _reference(path), [list(range(200, 220)), list(range(40, 49))],
                  tolerance=1e-3, tie=1e-3, exact_share=1.0)


def test_block_wise_fp8_refusals(tiny_hf, tmp_path):
    """Blocks that split the kernel's 16-row vectors, tensor parallelism, static
    activations over blocks: each refused by name."""
    with pytest.raises(UnsupportedQuantizationError, match="multiple of 16 rows"):
        LLM(str(write_fp8(tiny_hf, tmp_path / "b8", block=(8, 32))), dtype="float32")
    path = write_fp8(tiny_hf, tmp_path / "b32", block=(32, 32))
    with pytest.raises(UnsupportedQuantizationError, match="tensor parallelism"):
        LLM(str(path), dtype="float32", tensor_parallel_size=2)
    static = _with_config(path, tmp_path / "static",
                          lambda q: q.update(activation_scheme="static"))
    with pytest.raises(UnsupportedQuantizationError, match="block-wise weights and "
                                                           "activation_scheme 'static'"):
        LLM(str(static), dtype="float32")


def test_on_the_triton_backend_block_wise_fp8_is_decoded_and_logged(tiny_hf, tmp_path, caplog):
    from engine.model.triton_kernels import availability
    if availability(torch.device("cpu")) is not None:
        pytest.skip(f"Triton kernels: {availability(torch.device('cpu'))}")
    path = write_fp8(tiny_hf, tmp_path / "ckpt", block=(32, 32))
    with caplog.at_level(logging.WARNING, logger="engine.quant.holding"):
        llm = LLM(str(path), dtype="float32", attention_backend="triton", device="cpu",
                  block_size=8)
    assert "block-wise fp8 weights decoded" in caplog.text
    assert llm.llm_engine.engine_core.runner.model.layers[0].self_attn.qkv_proj.packing() is None
    check_against(llm, _reference(path), [list(range(200, 220))], tolerance=1e-3, tie=1e-3,
                  exact_share=1.0)


def test_fp8_under_tensor_parallelism_equals_one_rank(tiny_hf, tmp_path):
    """Each rank reads its rows (q/k/v, gate/up) with their scales, or its columns."""
    check_tp2_equals_one_rank(write_fp8(tiny_hf, tmp_path / "ct", "compressed-tensors", True))


def test_lora_on_an_fp8_base_matches_peft_on_the_decoded_weights(tiny_fp8, tmp_path):
    from engine.lora.request import LoRARequest
    from tests.test_lora import ALL, adapter_id, make_adapter
    decoded = write_decoded(tiny_fp8, tmp_path / "base")
    model = make_adapter(decoded, tmp_path / "ad", 8, ALL, seed=3).eval()
    llm = LLM(str(tiny_fp8), dtype="float32", enable_lora=True, max_lora_rank=8)
    lora = LoRARequest("ad", adapter_id("ad"), str(tmp_path / "ad"))
    check_against(llm, model, [list(range(300, 320)), list(range(900, 905))],
                  tolerance=1e-3, tie=1e-3, exact_share=1.0, lora_request=lora)


def test_on_the_triton_backend_fp8_runs_scaled_mm(tiny_fp8):
    """The Triton backend's fp8 path (torch._scaled_mm: compiled on a GPU, torch's CPU
    reference here): x rounded to e4m3 per token, outputs in bf16."""
    from engine.model.triton_kernels import availability
    if availability(torch.device("cpu")) is not None:
        pytest.skip(f"Triton kernels: {availability(torch.device('cpu'))}")
    llm = LLM(str(tiny_fp8), dtype="float32", attention_backend="triton", device="cpu",
              block_size=8)
    qkv = llm.llm_engine.engine_core.runner.model.layers[0].self_attn.qkv_proj
    assert qkv.packing() == "fp8-scaled-mm" and qkv.weight is None
    # the reference rounds as the holder does (without it, e4m3's 3-bit mantissa moved
    # these tiny random models' logprobs by up to 0.5)
    check_against(llm, _reference(tiny_fp8, round_inputs=True),
                  [list(range(100, 120)), list(range(700, 706))], tolerance=0.01, tie=0.01,
                  exact_share=1.0)


def test_without_the_kernels_fp8_weights_are_decoded_and_the_log_says_so(
        tiny_fp8, monkeypatch, caplog):
    import engine.executor.model_runner
    monkeypatch.setattr(engine.executor.model_runner, "cpu_kernels", lambda: None)
    monkeypatch.setattr(engine.executor.model_runner, "native_enabled", lambda: False)
    with caplog.at_level(logging.WARNING, logger="engine.executor.model_runner"):
        llm = LLM(str(tiny_fp8), dtype="float32", block_size=8)
    assert "fp8 weights" in caplog.text and "decoded to torch.float32" in caplog.text
    assert llm.llm_engine.engine_core.runner.model.layers[0].self_attn.qkv_proj.packing() is None
    check_against(llm, _reference(tiny_fp8), [list(range(100, 120))], tolerance=1e-3)


def _with_config(src, dst, change):
    import shutil
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    change(config["quantization_config"])
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("fmt, change, named", [
    ("fp8", lambda q: q.update(weight_block_size=[128]), "weight_block_size \\[128\\]"),
    ("fp8", lambda q: q.update(fmt="e5m2"), "fmt 'e5m2'"),
    ("compressed-tensors", lambda q: q["config_groups"]["group_0"]["input_activations"].update(
        type="int"), "int activations over float weights"),
    ("compressed-tensors", lambda q: q.update(format="int-quantized"),
     "8-bit float weights in format 'int-quantized'"),
    ("compressed-tensors", lambda q: q["config_groups"]["group_0"]["weights"].update(
        strategy="block"), "weights by block with block_structure None"),
    ("compressed-tensors", lambda q: q["config_groups"]["group_0"]["weights"].update(
        strategy="group"), "weights by 'group'"),
])
def test_fp8_schemes_not_served_are_refused_by_name(tiny_hf, tmp_path, fmt, change, named):
    path = _with_config(write_fp8(tiny_hf, tmp_path / "src", fmt), tmp_path / "other", change)
    with pytest.raises(UnsupportedQuantizationError, match=named):
        LLM(str(path), dtype="float32")


@pytest.mark.parametrize("method", ["fp8", "compressed-tensors"])
def test_an_fp8_config_over_float_weights_is_refused(tiny_hf, tmp_path, method):
    """Before fp8 was read, such a checkpoint had its weights widened as they were copied;
    a config claiming a format its weights are not in is refused, not served as floats."""
    path = _with_config(write_fp8(tiny_hf, tmp_path / "src", method), tmp_path / "float",
                        lambda q: None)
    (path / "model.safetensors").unlink()
    import shutil
    shutil.copy(tiny_hf / "model.safetensors", path / "model.safetensors")
    with pytest.raises(UnsupportedQuantizationError, match="none of its linear weights"):
        LLM(str(path), dtype="float32")


@pytest.mark.parametrize("names", ["k_scale", "output_scale"])
def test_a_kv_cache_scheme_s_scales_are_the_fp8_cache_s(tiny_hf, tmp_path, caplog, names):
    """llm-compressor's static fp8 kv_cache_scheme: its per-layer scales (self_attn.k_scale,
    or the older k_proj / v_proj output_scale) scale an fp8 cache; under kv_cache_dtype
    auto the cache holds floats and the log says the scales go unused, as in vLLM."""
    path = write_fp8(tiny_hf, tmp_path / "ckpt", "compressed-tensors", True, kv_scales=names)
    llm = LLM(str(path), dtype="float32", block_size=16, kv_cache_dtype="fp8")
    runner = llm.llm_engine.engine_core.runner
    assert runner.kv_caches.dtype == torch.float8_e4m3fn
    attns = [layer.self_attn for layer in runner.model.layers]
    assert [a.k_scale for a in attns] == pytest.approx([0.1 * (i + 1) for i in range(2)])
    assert [a.v_scale for a in attns] == pytest.approx([0.2 * (i + 1) for i in range(2)])
    with caplog.at_level(logging.INFO, logger="engine.executor.model_runner"):
        plain = LLM(str(path), dtype="float32", block_size=16)
    assert plain.llm_engine.engine_core.runner.kv_caches.dtype == torch.float32
    assert "fp8 KV cache scales" in caplog.text
    prompts = [list(range(100, 120)), list(range(700, 706))]
    check_against(llm, _reference(path), prompts, tolerance=0.5, tie=0.5, exact_share=0.5)


@pytest.mark.parametrize("change, named", [
    (dict(type="int"), "kv_cache_scheme of 8-bit int"),
    (dict(strategy="attn_head"), "kv_cache_scheme of scales by 'attn_head'"),
    (dict(dynamic=True), "kv_cache_scheme of dynamic"),
])
def test_kv_cache_schemes_not_served_are_refused_by_name(tiny_hf, tmp_path, change, named):
    path = _with_config(write_fp8(tiny_hf, tmp_path / "src", "compressed-tensors",
                                  kv_scales="k_scale"), tmp_path / "other",
                        lambda q: q["kv_cache_scheme"].update(change))
    with pytest.raises(UnsupportedQuantizationError, match=named):
        LLM(str(path), dtype="float32")


def test_quantization_option_names_the_fp8_format(tiny_fp8):
    LLM(str(tiny_fp8), dtype="float32", quantization="fp8", block_size=8)
    with pytest.raises(UnsupportedQuantizationError, match="quantized as 'fp8'"):
        LLM(str(tiny_fp8), dtype="float32", quantization="compressed-tensors")
