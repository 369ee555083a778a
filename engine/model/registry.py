"""Which model family serves which Hugging Face architecture.

A checkpoint's config.json names its architecture (`architectures`, else `model_type`);
the registry maps that name to the family module that implements it. The map is plain
strings so the processes that only read configs (the CLI's checks, the deployment
builder) resolve a model without importing torch; the family module is imported when a
model is built. Every family module declares the same names in its own ARCHITECTURES
(a test holds the two in agreement).
"""
from __future__ import annotations

import importlib
from typing import Any

from engine.errors import UnsupportedModelError

# architecture -> family module under engine.model.families
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "MixtralForCausalLM": "moe",
    "Qwen2MoeForCausalLM": "moe",
    "Qwen3MoeForCausalLM": "moe",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3",
    "GptOssForCausalLM": "gpt_oss",
    "GraniteMoeHybridForCausalLM": "granite_hybrid",
}

# a config's model_type -> its architecture, for configs that name no architectures
MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
}


def supported_architectures() -> tuple[str, ...]:
    return tuple(ARCHITECTURES)


def resolve_architecture(cfg: Any) -> str:
    """The architecture of a Hugging Face config that a family serves; raises
    UnsupportedModelError listing the supported ones."""
    named = list(getattr(cfg, "architectures", None) or [])
    arch = next((a for a in named if a in ARCHITECTURES), None)
    if arch is None:  # e.g. LlamaModel, an embedding checkpoint of a served family
        arch = MODEL_TYPES.get(getattr(cfg, "model_type", ""))
    if arch is None:
        raise UnsupportedModelError(
            f"architecture {named or getattr(cfg, 'model_type', None)!r} is not supported; "
            f"supported: {', '.join(supported_architectures())}")
    return arch


def family_module(architecture: str) -> Any:
    """The imported family module that serves an architecture."""
    try:
        family = ARCHITECTURES[architecture]
    except KeyError:
        raise UnsupportedModelError(
            f"architecture {architecture!r} is not supported; "
            f"supported: {', '.join(supported_architectures())}") from None
    return importlib.import_module(f"engine.model.families.{family}")


def model_class(architecture: str) -> type:
    """The nn.Module class that builds an architecture (its family's ARCHITECTURES)."""
    return family_module(architecture).ARCHITECTURES[architecture]


__all__ = ["ARCHITECTURES", "MODEL_TYPES", "family_module", "model_class",
           "resolve_architecture", "supported_architectures"]
