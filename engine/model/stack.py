"""The decoder's layers as one native call (engine/model/kernels/decoder_stack.cpp).

Python's per-layer module calls cost ~0.1 ms a layer, which for one sequence's decode
on the default model was as much as its GGUF weights' products. The stack holds the
same weights and calls the same kernels in the same order, so its values are the
modules' own; it serves the paths it can hold and the modules serve the rest (LoRA,
tensor parallelism, q/k norm, Triton or torch attention, unpacked linears).
Its linears: packed for the native kernels, GGUF blocks, int8 W8A8 or fp8 weights.
FLOTILLA_DECODER_STACK=0 turns it off (tests compare the two; benchmarks time both).
"""
from __future__ import annotations

import os

import torch
from torch import nn

from engine.model.layers.linear import Linear
from engine.quant.fp8 import Fp8Weight
from engine.quant.int8_w8a8 import Int8Weight


def stack_enabled() -> bool:
    return os.environ.get("FLOTILLA_DECODER_STACK", "1") != "0"


def _linear_spec(layer: Linear) -> tuple | None:
    """([(kind, weight, format, rows, extras, input_scale), ...], bias, paired) of a
    linear, or None when the stack cannot call it (dense, or packed for oneDNN)."""
    q = layer.quant
    if layer.input_order is not None:  # GPTQ act-order gathers x's columns: the modules do
        return None
    if isinstance(q, Int8Weight):
        return [("int8", q.packed, "", q.rows, [q.comp, q.scales], q.input_scale)], layer.bias, False
    if isinstance(q, Fp8Weight):
        extras = [q.scales] if q.block_scales is None else \
            [q.scales, q.block_scales, torch.tensor([q.block_k])]
        return [("fp8", q.packed, "", q.rows, extras, 0.0)], layer.bias, False
    if q is not None:
        segments = [("gguf_regrouped" if s.regrouped else "gguf", s.data, s.format, s.rows,
                     [], 0.0) for s in q.segments]
        return segments, layer.bias, False
    if layer.packing() == "native":
        return ([("native", layer.packed_weight, "", layer.out_features, [], 0.0)], layer.bias,
                layer._paired)
    return None


def build_stack(model: nn.Module, kernels) -> object | None:
    """A DecoderStack of the model's layers (a DecoderForCausalLM), or None where it does
    not hold them."""
    if kernels is None or not stack_enabled() or model.tp is not None:
        return None
    shape = model.shape
    # q/k norm, experts, sliding windows and other layer layouts: the modules run them
    if shape.qk_norm or shape.moe is not None or any(shape.layer_windows) \
            or not model.stack_layout:
        return None
    first = model.layers[0].self_attn
    stack = kernels.DecoderStack(first.num_heads, first.num_kv_heads, first.head_dim,
                                 shape.rms_norm_eps, first.scale, model.norm.weight)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        specs = [_linear_spec(p) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                           mlp.down_proj)]
        if any(s is None for s in specs):
            return None
        stack.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                        specs, attn.k_scale, attn.v_scale)
    return stack


__all__ = ["build_stack", "stack_enabled"]
