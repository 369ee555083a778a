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

from torch import nn

from engine.model.layers.linear import Linear


def stack_enabled() -> bool:
    return os.environ.get("FLOTILLA_DECODER_STACK", "1") != "0"


def _linear_spec(layer: Linear) -> tuple | None:
    """([(kind, weight, format, rows, extras, input_scale), ...], bias, paired) of a
    linear, or None when the stack cannot call it (dense, or packed for oneDNN)."""
    q = layer.quant
    if layer.input_order is not None:  # GPTQ act-order gathers x's columns: the modules do
        return None
    if q is not None:  # a HeldWeight (engine.quant.held): its own segments
        segments = q.stack_segments()
        return None if segments is None else (segments, layer.bias, False)
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
