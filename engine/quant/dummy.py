"""Random checkpoint tensors in a quantized format, for load_format "dummy".

Why: load_format dummy times a model's real shapes without its weight files (bench/gpu.py
runs Llama 1B / 8B shapes from config.json alone). A config that declares fp8 or AWQ
quantization must then run the quantized kernels over quantized bytes, or the benchmark
times bf16 under a quantized name. So the tensors are made as the checkpoint would hold
them (Hugging Face names, the format's own dtypes and layouts) and go through the same
loader as a real checkpoint's, holders and conversions included.

Values are uniform and small, like the float dummy weights: what runs is all that matters.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from engine.errors import UnsupportedQuantizationError

DUMMY_FORMATS = ("fp8", "awq")  # what a dummy load can make; other formats need their files


def _linears(shape: Any) -> list[tuple[str, int, int, bool]]:
    """(HF module name without its layer prefix, out features, in features, bias) of a
    Llama-family decoder layer."""
    q = shape.num_heads * shape.head_dim
    kv = shape.num_kv_heads * shape.head_dim
    h, i = shape.hidden_size, shape.intermediate_size
    return [("self_attn.q_proj", q, h, shape.qkv_bias), ("self_attn.k_proj", kv, h, shape.qkv_bias),
            ("self_attn.v_proj", kv, h, shape.qkv_bias), ("self_attn.o_proj", h, q, shape.o_bias),
            ("mlp.gate_proj", i, h, shape.mlp_bias), ("mlp.up_proj", i, h, shape.mlp_bias),
            ("mlp.down_proj", h, i, shape.mlp_bias)]


def _uniform(shape: tuple[int, ...], generator: torch.Generator, device: torch.device,
             scale: float = 1e-3) -> torch.Tensor:
    return (torch.rand(shape, generator=generator, device=device) * 2 - 1) * scale


TILE_ROWS = 256  # random rows made per tensor; the rest repeat them (8B: seconds, not ~30)


def _tiled(rows: int, make) -> torch.Tensor:
    """make(n) is n random rows; rows of them, the first TILE_ROWS repeated."""
    block = make(min(rows, TILE_ROWS))
    return block.repeat((rows + block.shape[0] - 1) // block.shape[0], 1)[:rows].contiguous()


def _quantized(fmt: str, out: int, inp: int, group_size: int, generator: torch.Generator,
               device: torch.device) -> dict[str, torch.Tensor]:
    """One linear's checkpoint tensors in fmt, by suffix (group_size -1: one group over
    all of the inputs, as AWQ configs say it)."""
    if fmt == "fp8":  # random e4m3 bytes but NaN's (0x7F, 0xFF), one scale a tensor
        raw = _tiled(out, lambda n: torch.randint(0, 255, (n, inp), generator=generator,
                                                  device=device, dtype=torch.uint8))
        raw = torch.where(raw == 0x7F, 0x7E, raw)
        return {"weight": raw.view(torch.float8_e4m3fn),
                "weight_scale": torch.tensor(1e-3 / 448, device=device)}
    group_size = inp if group_size == -1 else group_size
    if inp % group_size or out % 8:
        raise UnsupportedQuantizationError(
            f"load_format dummy, awq: a {out} x {inp} linear is not a whole number of "
            f"{group_size}-input groups and 8-output words")
    words = _tiled(inp, lambda n: torch.randint(-2 ** 31, 2 ** 31 - 1, (n, out // 8),
                                                generator=generator, device=device,
                                                dtype=torch.int32))
    zeros = torch.randint(-2 ** 31, 2 ** 31 - 1, (inp // group_size, out // 8),
                          generator=generator, device=device, dtype=torch.int32)
    scales = (torch.rand((inp // group_size, out), generator=generator, device=device) * 2e-4
              ).to(torch.float16)
    return {"qweight": words, "qzeros": zeros, "scales": scales}


def quantization_config(fmt: str, group_size: int = 128) -> dict[str, Any]:
    """The quantization_config a checkpoint of fmt declares, as dummy_weights makes it."""
    if fmt == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size,
                "zero_point": True, "version": "gemm"}
    raise UnsupportedQuantizationError(
        f"load_format dummy makes random weights in {', '.join(DUMMY_FORMATS)} only, not "
        f"{fmt!r}: serve that format from its checkpoint")


def dummy_weights(shape: Any, fmt: str, group_size: int = 128,
                  seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of every weight a checkpoint of these shapes holds in fmt: the
    decoder layers' linears quantized, embeddings, norms and biases float32. Made one at
    a time in host memory, as a checkpoint's tensors are read, so the loader's
    conversions (AWQ's regrouping) run as they do for a file."""
    quantization_config(fmt, group_size)  # refuses what it cannot make
    device = torch.device("cpu")
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    h = shape.hidden_size
    yield "model.embed_tokens.weight", _uniform((shape.vocab_size, h), generator, device)
    for layer in range(shape.num_layers):
        prefix = f"model.layers.{layer}"
        for name in ("input_layernorm", "post_attention_layernorm"):
            yield f"{prefix}.{name}.weight", torch.ones(h, device=device)
        if shape.qk_norm:
            for name in ("q_norm", "k_norm"):
                yield f"{prefix}.self_attn.{name}.weight", torch.ones(shape.head_dim,
                                                                      device=device)
        for name, out, inp, bias in _linears(shape):
            for suffix, tensor in _quantized(fmt, out, inp, group_size, generator,
                                             device).items():
                yield f"{prefix}.{name}.{suffix}", tensor
            if bias:
                yield f"{prefix}.{name}.bias", _uniform((out,), generator, device)
    yield "model.norm.weight", torch.ones(h, device=device)
    if not shape.tie_word_embeddings:
        yield "lm_head.weight", _uniform((shape.vocab_size, h), generator, device)
