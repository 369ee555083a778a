"""Random checkpoint tensors in a quantized format, for load_format "dummy".

Why: load_format dummy times a model's real shapes without its weight files (bench/gpu.py
runs Llama 1B / 8B shapes from config.json alone). A config that declares fp8 or AWQ
quantization must then run the quantized kernels over quantized bytes, or the benchmark
times bf16 under a quantized name. So the tensors are made as the checkpoint would hold
them (Hugging Face names, the format's own dtypes and layouts) and go through the same
loader as a real checkpoint's, holders and conversions included.

Values are uniform and small, like the float dummy weights: what runs is all that matters.
This module walks a decoder's tensors; each format (QuantFormat.dummy_linear) makes its
linears' own, and the registry's quantization_config / dummy_weights look the format up
by name.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

# a format's linear: (out features, in features, generator, device) -> {suffix: tensor}
LinearTensors = Callable[[int, int, torch.Generator, torch.device], dict[str, torch.Tensor]]


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


def uniform(shape: tuple[int, ...], generator: torch.Generator, device: torch.device,
            scale: float = 1e-3) -> torch.Tensor:
    return (torch.rand(shape, generator=generator, device=device) * 2 - 1) * scale


TILE_ROWS = 256  # random rows made per tensor; the rest repeat them (8B: seconds, not ~30)


def tiled(rows: int, make: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """make(n) is n random rows; rows of them, the first TILE_ROWS repeated."""
    block = make(min(rows, TILE_ROWS))
    return block.repeat((rows + block.shape[0] - 1) // block.shape[0], 1)[:rows].contiguous()


def dummy_tensors(shape: Any, linear: LinearTensors,
                  seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of every weight a checkpoint of these shapes holds: the decoder
    layers' linears as `linear` makes them (a format's own tensors), embeddings, norms
    and biases float32. Made one at a time in host memory, as a checkpoint's tensors are
    read, so the loader's conversions (AWQ's regrouping) run as they do for a file."""
    device = torch.device("cpu")
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    h = shape.hidden_size
    yield "model.embed_tokens.weight", uniform((shape.vocab_size, h), generator, device)
    for layer in range(shape.num_layers):
        prefix = f"model.layers.{layer}"
        for name in ("input_layernorm", "post_attention_layernorm"):
            yield f"{prefix}.{name}.weight", torch.ones(h, device=device)
        if shape.qk_norm:
            for name in ("q_norm", "k_norm"):
                yield f"{prefix}.self_attn.{name}.weight", torch.ones(shape.head_dim,
                                                                      device=device)
        for name, out, inp, bias in _linears(shape):
            for suffix, tensor in linear(out, inp, generator, device).items():
                yield f"{prefix}.{name}.{suffix}", tensor
            if bias:
                yield f"{prefix}.{name}.bias", uniform((out,), generator, device)
    yield "model.norm.weight", torch.ones(h, device=device)
    if not shape.tie_word_embeddings:
        yield "lm_head.weight", uniform((shape.vocab_size, h), generator, device)


__all__ = ["LinearTensors", "TILE_ROWS", "dummy_tensors", "tiled", "uniform"]
