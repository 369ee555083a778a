"""GGUF checkpoints served as their blocks (issue 42): the native kernels against the
decoded weights, the file's tensors against transformers' reading of it, and the engine
on tiny GGUF files (written by tests/gguf_helpers.py) against transformers running the
same decoded weights in float32: greedy tokens equal, logprobs within the int8 rounding
of the activations, through chunked prefill, a prefix hit, the decoder stack and the
module path, TP=2 and LoRA."""
from __future__ import annotations

import functools
import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from engine import LLM
from engine.errors import UnsupportedQuantizationError
from engine.quant.gguf_blocks import BLOCK_FORMATS, dequantize
from engine.quant.gguf_weights import GGUFBlocks, iter_gguf_weights
from engine.sampling_params import SamplingParams
from tests.conftest import KERNEL_TARGETS, build_tiny_model, cpu_flags
from tests.gguf_helpers import (check_against, check_tp2_equals_one_rank, random_blocks,
                                 write_gguf)

FORMATS = sorted(BLOCK_FORMATS)


def _blocks(fmt: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    if fmt in ("Q8_0", "Q4_0", "Q4_1"):
        raw = quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32),
                              GGMLQuantizationType[fmt])
    else:
        raw = random_blocks(fmt, rows, cols, rng)
    return torch.from_numpy(np.ascontiguousarray(raw))


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).abs().max() / want.abs().max())


# ---- kernels ----------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernels_decode_blocks_exactly(kernels, fmt):
    raw = _blocks(fmt, 20, 512)
    want = dequantize(raw, fmt, 512)
    assert torch.equal(kernels.gguf_dequantize(raw, fmt, 512, torch.float32), want)
    assert torch.equal(kernels.gguf_dequantize(raw, fmt, 512, torch.bfloat16),
                       want.bfloat16())


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_products_match_the_decoded_weights(kernels, fmt):
    """The int8 dot products are exact; the one error is the activations' rounding to
    int8 runs (measured ~0.3 % of the largest output). Past dense_rows rows the weight
    is decoded and multiplied by oneDNN: float32's own rounding only."""
    n, k = 40, 512
    raw = _blocks(fmt, n, k, seed=1)
    w = dequantize(raw, fmt, k)
    torch.manual_seed(0)
    bias = torch.randn(n)
    for rows in (1, 3, 6, 17):
        x = torch.randn(rows, k)
        want = x @ w.T + bias
        got = kernels.gguf_linear(x, raw, fmt, bias, False, 16)
        assert got.shape == (rows, n) and got.dtype == torch.float32
        assert _relative_error(got, want) < 0.02, rows
        dense = kernels.gguf_linear(x, raw, fmt, bias, False, 0)
        torch.testing.assert_close(dense, want, rtol=1e-4, atol=1e-4)
        logits = kernels.gguf_linear(x.bfloat16(), raw, fmt, None, True, 16)
        assert logits.dtype == torch.float32
        assert _relative_error(logits, x.bfloat16().float() @ w.T) < 0.03


def _regrouping(kernels):
    """`kernels`, which must multiply regrouped weights with its CPU family's int8 product
    (an AVX-512 VNNI CPU's native build: VNNI; AVX2 builds: vpmaddubsw); the test skips
    on builds that keep the file's layout (SSE2, NEON)."""
    if kernels.isa not in ("avx512", "avx2"):
        assert not kernels.gguf_regroups()
        pytest.skip(f"the {kernels.isa} build keeps GGUF blocks in the file's layout")
    assert kernels.gguf_regroups()
    if kernels.isa == "avx512" and "avx512_vnni" in cpu_flags():
        assert kernels.gguf_dot_kernel() == "vnni"  # never a narrower fallback
    return kernels


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("n", [50, 776, 1544])
def test_regrouped_prompt_products_are_the_decoded_weights_products(kernels, fmt, n):
    """Past dense_rows rows (a prompt step) the regrouped weight is decoded, on AVX2
    straight into the float32 tile kernels' packed panels, 768 columns at a time: the
    product is the decoded weight's up to float32 rounding, for one chunk or several, a
    ragged last group (50, 776) or a ragged last panel (1544: 2 chunks and 8 columns)."""
    _regrouping(kernels)
    k = 256
    raw = _blocks(fmt, n, k, seed=3)
    w = dequantize(raw, fmt, k)
    packed = kernels.gguf_regroup(raw, fmt, k)
    torch.manual_seed(1)
    bias = torch.randn(n)
    for rows in (1, 20):
        x = torch.randn(rows, k)
        got = kernels.gguf_regrouped_linear(x, packed, fmt, n, bias, False, 0)
        assert got.shape == (rows, n) and got.dtype == torch.float32
        torch.testing.assert_close(got, x @ w.T + bias, rtol=1e-4, atol=1e-4)
        logits = kernels.gguf_regrouped_linear(x.bfloat16(), packed, fmt, n, None, True, 0)
        assert logits.dtype == torch.float32
        assert _relative_error(logits, x.bfloat16().float() @ w.T) < 0.02


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
def test_regrouped_weights_hold_the_same_values(kernels, fmt):
    """The 16-row regrouping (AVX-512 VNNI and AVX2 builds) keeps every weight: rows
    decode to the file's values, products match the decoded weights as the file layout's
    do. Builds without the regrouped products (SSE2, NEON) still read the layout."""
    assert kernels.gguf_regroups() == (kernels.isa in ("avx512", "avx2"))
    n, k = 50, 256  # 50: a last group of 2 rows
    raw = _blocks(fmt, n, k, seed=2)
    w = dequantize(raw, fmt, k)
    packed = kernels.gguf_regroup(raw, fmt, k)
    assert packed.numel() == 64 * (k // 32) * BLOCK_FORMATS[fmt].nbytes  # 4 groups of 16 rows
    ids = torch.tensor([0, 17, 49, 3])
    assert torch.equal(kernels.gguf_regrouped_rows(packed, fmt, n, k, ids, torch.float32), w[ids])
    x = torch.randn(5, k)
    for rows in (1, 2, 5):
        got = kernels.gguf_regrouped_linear(x[:rows], packed, fmt, n, None, False, 16)
        assert _relative_error(got, x[:rows] @ w.T) < 0.02
    with pytest.raises(RuntimeError, match="regrouped"):
        kernels.gguf_regrouped_linear(x, packed, fmt, n + 16, None, False, 16)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
def test_regrouped_blocks_of_rows_equal_one_row_at_a_time(kernels, fmt):
    """From 2 rows of x the regrouped product runs in blocks (VNNI: 4 rows x 2 groups of
    16 weight rows; AVX2: 2 rows x 1 group). Each row's result is exactly the 1-row
    kernel's (the same int8 sums, scaled in the same order), so a sequence's tokens do
    not depend on the batch it ran in: for every row count's tail block, an odd count of
    groups and a last group of a few rows, with a bias, float32 and bf16 x, and bf16 x's
    float32 logits. Both agree with the file layout's kernel (quant_linear.cpp: the
    scalar activation quantizer)."""
    _regrouping(kernels)
    k = 256
    for n in (40, 50, 96):  # 3 groups (the last of 8 rows), 4 (the last of 2), 6
        raw = _blocks(fmt, n, k, seed=n)
        packed = kernels.gguf_regroup(raw, fmt, k)
        torch.manual_seed(n)
        bias = torch.randn(n)
        x = torch.randn(17, k)
        for rows in (2, 3, 4, 5, 8, 9, 17):
            for dtype, float_out in ((torch.float32, False), (torch.bfloat16, False),
                                     (torch.bfloat16, True)):
                xr = x[:rows].to(dtype)
                b = None if float_out else bias.to(dtype)
                got = kernels.gguf_regrouped_linear(xr, packed, fmt, n, b, float_out, 64)
                one = torch.cat([kernels.gguf_regrouped_linear(xr[i:i + 1], packed, fmt, n, b,
                                                               float_out, 64)
                                 for i in range(rows)])
                assert got.dtype == one.dtype and got.shape == (rows, n)
                assert torch.equal(got, one), f"{fmt} n={n} rows={rows} {dtype} {float_out}"
                if dtype == torch.float32:
                    file_layout = kernels.gguf_linear(xr, raw, fmt, b, False, 64)
                    # float sums in another order; one activation rounded to another int8
                    # would move an output by ~1e-2 of its scale
                    torch.testing.assert_close(got, file_layout, rtol=1e-5,
                                               atol=1e-5 * float(got.abs().max()))


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_float_outputs_past_the_streaming_size_equal_the_cached_writes(kernels, fmt):
    """Float outputs past 4 MiB (the LM head's logits at a batch) are written around the
    caches (AVX-512 builds; AVX2's are plain stores); the values equal the same rows in
    small calls, written through them: whole vectors, the last group's 8 lanes, rows that
    start off a cache line (an odd count of 8-column halves a row), float32 x and bf16
    x's float32 logits."""
    _regrouping(kernels)
    n, k, rows = 16408, 64, 72  # 72 x 16408 float32 = 4.7 MB; 8 rows 0.5 MB
    packed = kernels.gguf_regroup(_blocks(fmt, n, k, seed=7), fmt, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7))
    for dtype, float_out in ((torch.float32, False), (torch.bfloat16, True)):
        xr = x.to(dtype)
        got = kernels.gguf_regrouped_linear(xr, packed, fmt, n, None, float_out, 1 << 20)
        chunks = torch.cat([kernels.gguf_regrouped_linear(xr[i:i + 8], packed, fmt, n, None,
                                                          float_out, 1 << 20)
                            for i in range(0, rows, 8)])
        assert got.dtype == torch.float32 and torch.equal(got, chunks), f"{fmt} {dtype}"


@pytest.mark.skipif("avx512_vnni" not in cpu_flags() or "x86-64-v3" not in KERNEL_TARGETS,
                    reason="needs an AVX-512 VNNI CPU building its AVX2 path beside")
@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
def test_avx2_regrouped_products_equal_the_vnni_ones(fmt):
    """The AVX2 build's products (vpmaddubsw) on the same regrouped bytes: the same int8
    sums as VNNI's vpdpbusd, scaled by the same float steps, so Q4_0 / Q4_1 outputs are
    equal bit for bit; Q8_0's AVX2 sums take q signed (VNNI's take q + 128 and subtract
    128 d * sum(x) after), equal to float rounding. For 1 row, blocks of rows with a tail,
    and the dense path's decoded panels."""
    from engine.model.kernels import cpu_kernels
    vnni, avx2 = cpu_kernels(), cpu_kernels("x86-64-v3")
    assert vnni.gguf_dot_kernel() == "vnni" and avx2.isa == "avx2" and avx2.gguf_regroups()
    n, k = 72, 512  # a last group of 8 rows
    raw = _blocks(fmt, n, k, seed=11)
    packed = vnni.gguf_regroup(raw, fmt, k)
    assert torch.equal(avx2.gguf_regroup(raw, fmt, k), packed)
    torch.manual_seed(11)
    bias, x = torch.randn(n), torch.randn(9, k)
    for rows in (1, 2, 5, 9):
        for dtype, float_out in ((torch.float32, False), (torch.bfloat16, False),
                                 (torch.bfloat16, True)):
            xr = x[:rows].to(dtype)
            b = None if float_out else bias.to(dtype)
            got = avx2.gguf_regrouped_linear(xr, packed, fmt, n, b, float_out, 64)
            want = vnni.gguf_regrouped_linear(xr, packed, fmt, n, b, float_out, 64)
            if fmt == "Q8_0":
                torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32
                                           else 1e-2, atol=1e-5 * float(want.abs().max()))
            else:
                assert torch.equal(got, want), f"{fmt} rows={rows} {dtype} {float_out}"
    # the dense path: AVX2 decodes into its float32 tile kernels' panels, VNNI's builds
    # into W^T for oneDNN; the same decoded weights summed in another order
    dense = avx2.gguf_regrouped_linear(x, packed, fmt, n, bias, False, 0)
    want = vnni.gguf_regrouped_linear(x, packed, fmt, n, bias, False, 0)
    torch.testing.assert_close(dense, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_block_columns_split_only_at_block_boundaries():
    raw = _blocks("Q4_1", 4, 128)
    blocks = GGUFBlocks("Q4_1", raw, 128)
    half = blocks[:, 64:128]
    assert half.shape == (4, 64)
    assert torch.equal(half.dequantize(), blocks.dequantize()[:, 64:])
    assert blocks[1:3].shape == (2, 128)
    from engine.errors import UnsupportedModelError
    with pytest.raises(UnsupportedModelError, match="blocks of 32"):
        blocks[:, 16:48]


@pytest.mark.parametrize("flags, decode_rows", [
    ({"avx2", "fma", "f16c"}, 256),  # Zen 3
    ({"avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16"}, 256),  # Zen 4/5
    ({"avx2", "fma", "f16c", "avx512f", "avx512_vnni", "amx_bf16"}, 64),  # AMX Xeon
    ({"sse2"}, 64),
])
def test_decode_steps_leave_the_int8_products_where_measured(monkeypatch, flags, decode_rows):
    """How many rows a decode-only step runs on the int8 block products before the
    decoded panels take over, per CPU type (the measured crossovers)."""
    from engine.quant import gguf_linear
    monkeypatch.setattr(gguf_linear, "cpu_flags", lambda: frozenset(flags))
    assert gguf_linear._decode_crossover() == decode_rows


# ---- tiny GGUF files --------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tiny_tokenizer_dir):
    """The tiny llama as a GGUF file: Q4_1 weights, a Q8_0 v projection (so the fused
    q/k/v holds two formats) and a Q8_0 embedding, as the default model's file mixes."""
    root = tmp_path_factory.mktemp("gguf")
    hf = build_tiny_model(root / "hf", "llama", tiny_tokenizer_dir)
    return write_gguf(hf, root / "tiny.gguf", {"*": "Q4_1", "attn_v.weight": "Q8_0",
                                                "token_embd.weight": "Q8_0"})


@pytest.fixture(scope="module")
def tiny_kquant_gguf(tmp_path_factory, tiny_tokenizer_dir):
    """A llama with 256-wide rows in the K-quants: Q4_K, with Q6_K v and down projections
    (a Q4_K_M file's mix), untied Q6_K output."""
    root = tmp_path_factory.mktemp("kquant")
    hf = build_tiny_model(root / "hf", "llama", tiny_tokenizer_dir, hidden_size=256,
                          intermediate_size=512)
    return write_gguf(hf, root / "tiny.gguf", {"*": "Q4_K", "attn_v.weight": "Q6_K",
                                                "ffn_down.weight": "Q6_K",
                                                "output.weight": "Q6_K",
                                                "token_embd.weight": "Q8_0"})


@functools.cache
def _reference(gguf_path):
    """transformers' own reading of the file (its decoders, its q/k unpermute), float32."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                dtype=torch.float32).eval()


def test_a_gguf_file_reads_as_transformers_reads_it(tiny_gguf):
    """Names, shapes, the q/k rows' order and every value: the file's tensors decoded
    equal transformers' state dict of the same file."""
    want = _reference(tiny_gguf).state_dict()
    seen = set()
    for name, value in iter_gguf_weights(tiny_gguf):
        got = value.dequantize() if isinstance(value, GGUFBlocks) else value
        assert torch.equal(got.float(), want[name]), name
        seen.add(name)
    assert seen == set(want) - {"lm_head.weight"} | ({"lm_head.weight"} & seen)


@pytest.mark.parametrize("stack", ["1", "0"])
def test_engine_on_gguf_blocks_matches_transformers(tiny_gguf, monkeypatch, stack):
    """Chunked prefill (24-token steps), decodes, a prefix hit, on the decoder stack and
    on the module path; the weights stay blocks and memory_usage counts their bytes."""
    monkeypatch.setenv("FLOTILLA_DECODER_STACK", stack)
    ref = _reference(tiny_gguf)
    llm = LLM(str(tiny_gguf), dtype="float32", max_num_batched_tokens=24, block_size=8)
    runner = llm.llm_engine.engine_core.runner
    model = runner.model
    assert (model.stack is not None) == (stack == "1")
    assert model.layers[0].self_attn.qkv_proj.packing() == "gguf:Q4_1+Q8_0"
    assert model.embed_tokens.weight is None and model.embed_tokens.quant.describe() == "Q8_0"
    assert model.lm_head.packing() == "gguf:Q4_1"
    # the file's bytes: its blocks as stored (the tied embedding once), its float32 norms
    in_file = sum(v.nbytes if isinstance(v, GGUFBlocks) else v.numel() * 4
                  for _, v in iter_gguf_weights(tiny_gguf))
    assert runner.memory_usage()["weights_bytes"] == in_file
    rng = np.random.default_rng(3)
    prompts = [rng.integers(100, 40000, n).tolist() for n in (40, 5, 33)]
    check_against(llm, ref, prompts)
    shared = [prompts[0][:32] + [7, 8, 9]]
    out = check_against(llm, ref, shared)
    assert out[0].num_cached_tokens > 0


def test_k_quants_and_mixed_formats_match_transformers(tiny_kquant_gguf):
    ref = _reference(tiny_kquant_gguf)
    llm = LLM(str(tiny_kquant_gguf), dtype="float32", block_size=8)
    model = llm.llm_engine.engine_core.runner.model
    assert model.layers[0].self_attn.qkv_proj.packing() == "gguf:Q4_K+Q6_K"
    assert model.layers[0].mlp.down_proj.packing() == "gguf:Q6_K"
    rng = np.random.default_rng(4)
    # rows of 256 with weights up to ~0.4 give larger logits than the 64-wide model:
    # the activations' int8 rounding moved a logprob by 0.18 here
    check_against(llm, ref, [rng.integers(100, 40000, n).tolist() for n in (20, 7)],
                  tolerance=0.3, tie=0.2)


def test_gguf_under_tensor_parallelism_equals_one_rank(tiny_gguf):
    """Each rank reads its rows (q/k/v, gate/up, vocabulary) and its block columns
    (o, down) of the file; TP=2 gives the single engine's tokens."""
    check_tp2_equals_one_rank(tiny_gguf)


def test_lora_on_a_gguf_base_matches_peft_on_the_decoded_weights(tiny_gguf, tmp_path):
    """Adapters stay in the activation dtype and add to the blocks' products."""
    from engine.lora.request import LoRARequest
    from tests.test_lora import ALL, adapter_id, make_adapter
    from tests.gguf_helpers import save_decoded
    save_decoded(_reference(tiny_gguf), tmp_path / "base")  # the decoded weights, for peft
    model = make_adapter(tmp_path / "base", tmp_path / "ad", 8, ALL, seed=3).eval()
    llm = LLM(str(tiny_gguf), dtype="float32", enable_lora=True, max_lora_rank=8)
    assert llm.llm_engine.engine_core.runner.model.stack is None
    lora = LoRARequest("ad", adapter_id("ad"), str(tmp_path / "ad"))
    prompts = [list(range(300, 320)), list(range(900, 905))]
    # a random adapter flattens the tiny model's choices: more near ties (11 of 16 exact)
    check_against(llm, model, prompts, exact_share=0.5, lora_request=lora)
    # the adapter is applied: without it the tokens are the base's
    plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8,
                                                 ignore_eos=True), use_tqdm=False)
    with_adapter = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8,
                                                        ignore_eos=True), use_tqdm=False,
                                lora_request=lora)
    assert [o.outputs[0].token_ids for o in plain] != [o.outputs[0].token_ids
                                                       for o in with_adapter]


def test_without_the_kernels_blocks_are_decoded_and_the_log_says_so(tiny_gguf, monkeypatch,
                                                                    caplog):
    import engine.executor.model_runner
    monkeypatch.setattr(engine.executor.model_runner, "cpu_kernels", lambda: None)
    monkeypatch.setattr(engine.executor.model_runner, "native_enabled", lambda: False)
    with caplog.at_level(logging.WARNING, logger="engine.executor.model_runner"):
        llm = LLM(str(tiny_gguf), dtype="float32", block_size=8)
    assert "decoded to torch.float32" in caplog.text
    model = llm.llm_engine.engine_core.runner.model
    assert model.layers[0].self_attn.qkv_proj.packing() is None
    check_against(llm, _reference(tiny_gguf), [list(range(100, 120))], tolerance=1e-3)


def test_quantization_option_must_name_the_checkpoint_s_format(tiny_gguf, tiny_llama):
    LLM(str(tiny_gguf), dtype="float32", quantization="gguf", block_size=8)
    with pytest.raises(UnsupportedQuantizationError, match="'bitsandbytes' is not served"):
        LLM(str(tiny_gguf), dtype="float32", quantization="bitsandbytes")
    with pytest.raises(UnsupportedQuantizationError, match="quantized as 'gguf'"):
        LLM(str(tiny_gguf), dtype="float32", quantization="awq")
    with pytest.raises(UnsupportedQuantizationError, match="not quantized"):
        LLM(str(tiny_llama), dtype="float32", quantization="gguf")
