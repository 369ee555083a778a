"""The Gemma 3 family's declaration (no torch): GeGLU, q/k norm and scores scaled by
query_pre_attn_scalar; quantized checkpoints refused (converters store its norms
differently, and none is read here yet)."""
from __future__ import annotations

from typing import Any

from engine.model.families.arch import Architecture, Family, ShapeFields
from engine.model.families.llama_arch import qk_normed


def _gemma3(cfg: Any) -> ShapeFields:
    return {**qk_normed(cfg), "attention_scale": float(cfg.query_pre_attn_scalar) ** -0.5}


FAMILY = Family(module="gemma3",
                architectures=(Architecture("Gemma3ForCausalLM", "gemma3_text", _gemma3),),
                activation="gelu_pytorch_tanh",
                quantized_refusal="a Gemma 3 model (its norms' weights are offsets from 1)")

__all__ = ["FAMILY"]
