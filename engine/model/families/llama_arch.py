"""The Llama family's declaration (no torch): Llama, Mistral, Qwen2 and Qwen3, one
network (engine.model.families.llama) whose variants differ in flags of the shape."""
from __future__ import annotations

from typing import Any

from engine.model.families.arch import Architecture, Family, ShapeFields


def qkv_biased(cfg: Any) -> ShapeFields:
    """Qwen2: q/k/v carry biases whatever attention_bias says, o_proj none."""
    return {"qkv_bias": True, "o_bias": False}


def qk_normed(cfg: Any) -> ShapeFields:
    """Qwen3 and the families that took it up: q and k RMS-normalised per head."""
    return {"qk_norm": True}


FAMILY = Family(module="llama", architectures=(
    Architecture("LlamaForCausalLM", "llama"),
    Architecture("MistralForCausalLM", "mistral"),
    Architecture("Qwen2ForCausalLM", "qwen2", qkv_biased),
    Architecture("Qwen3ForCausalLM", "qwen3", qk_normed),
))

__all__ = ["FAMILY", "qk_normed", "qkv_biased"]
