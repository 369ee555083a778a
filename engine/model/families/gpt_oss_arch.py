"""The gpt-oss family's declaration (no torch): attention sinks, and biased experts with
the clamped SwiGLU in Mixtral's config fields."""
from __future__ import annotations

from typing import Any

from engine.model.families.arch import Architecture, Family, ShapeFields
from engine.model.families.moe_arch import local_experts


def _gpt_oss(cfg: Any) -> ShapeFields:
    return {"moe": local_experts(cfg, biased=True, swiglu_alpha=float(cfg.swiglu_alpha),
                                 swiglu_limit=float(cfg.swiglu_limit)),
            "attention_sinks": True}


FAMILY = Family(module="gpt_oss",
                architectures=(Architecture("GptOssForCausalLM", "gpt_oss", _gpt_oss),))

__all__ = ["FAMILY"]
