"""Which model family serves which Hugging Face architecture.

A checkpoint's config.json names its architecture (`architectures`, else `model_type`);
the registry maps that name to the family that implements it. Each family declares its
architectures in its declaration module (engine/model/families/<name>_arch.py, no
torch), which the registry lists once below, so the processes that only read configs
(the CLI's checks, the deployment builder) resolve a model without importing torch;
the family's network module is imported when a model is built, and declares the same
names in its own ARCHITECTURES (a test holds the two in agreement).
"""
from __future__ import annotations

import importlib
from typing import Any

from engine.errors import UnsupportedModelError
from engine.model.families import (gemma3_arch, gpt_oss_arch, granite_hybrid_arch,
                                   llama_arch, moe_arch, phi3_arch)
from engine.model.families.arch import Family

# every family served, in the order the refusals list their architectures
FAMILIES: tuple[Family, ...] = (llama_arch.FAMILY, moe_arch.FAMILY, phi3_arch.FAMILY,
                                gemma3_arch.FAMILY, gpt_oss_arch.FAMILY,
                                granite_hybrid_arch.FAMILY)

_FAMILY_OF: dict[str, Family] = {name: f for f in FAMILIES for name in f.names}

# architecture -> family module under engine.model.families
ARCHITECTURES: dict[str, str] = {name: f.module for name, f in _FAMILY_OF.items()}

# a config's model_type -> its architecture, for configs that name no architectures
MODEL_TYPES: dict[str, str] = {a.model_type: a.name
                               for f in FAMILIES for a in f.architectures}


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


def family(architecture: str) -> Family:
    """The declaration of the family that serves an architecture."""
    try:
        return _FAMILY_OF[architecture]
    except KeyError:
        raise UnsupportedModelError(
            f"architecture {architecture!r} is not supported; "
            f"supported: {', '.join(supported_architectures())}") from None


def family_module(architecture: str) -> Any:
    """The imported family module that serves an architecture."""
    return importlib.import_module(f"engine.model.families.{family(architecture).module}")


def model_class(architecture: str) -> type:
    """The nn.Module class that builds an architecture (its family's ARCHITECTURES)."""
    return family_module(architecture).ARCHITECTURES[architecture]


__all__ = ["ARCHITECTURES", "FAMILIES", "MODEL_TYPES", "family", "family_module",
           "model_class", "resolve_architecture", "supported_architectures"]
