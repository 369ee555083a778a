"""What a model family declares: the architectures it serves and how each reads its shape.

Each family has a network module (engine/model/families/<name>.py, torch) and a
declaration beside it (<name>_arch.py, no torch) holding one Family. The declarations
are apart from the networks so that the processes that only read configs (the CLI's
checks, the deployment builder) resolve a model and read its ModelShape without
importing torch. engine.model.registry lists the declarations once; ModelShape's
reader and the quantized-checkpoint check ask them instead of naming architectures.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

# ModelShape fields by name (see engine.model.shape.ModelShape), the ones an
# architecture reads its own way over the shared reader's
ShapeFields = dict[str, Any]


def no_fields(cfg: Any) -> ShapeFields:
    """An architecture whose shape the shared reader reads whole."""
    return {}


@dataclass(frozen=True)
class Architecture:
    """One Hugging Face architecture: the name config.json's `architectures` gives it,
    the `model_type` of its configs (for those naming no architecture, e.g. LlamaModel
    embedding checkpoints), and the shape fields it reads its own way."""

    name: str
    model_type: str
    fields: Callable[[Any], ShapeFields] = no_fields


@dataclass(frozen=True)
class Family:
    """A family: its network module, the architectures it builds, the config's hidden
    activation its gated MLP computes, and, where its loader reads float weights only,
    how the refusal of its quantized checkpoints names it."""

    module: str  # the network module under engine.model.families
    architectures: tuple[Architecture, ...]
    activation: str = "silu"  # config.hidden_act (or hidden_activation) it computes
    quantized_refusal: str | None = None  # e.g. "a Phi-3 model (...)"; None: served

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.architectures)

    def shape_fields(self, architecture: str, cfg: Any) -> ShapeFields:
        """The ModelShape fields `architecture` reads from cfg its own way."""
        return next(a for a in self.architectures if a.name == architecture).fields(cfg)

    def classes(self, model: type) -> dict[str, type]:
        """Architecture -> the network class, for a family whose one class builds all
        its architectures (the network module's ARCHITECTURES)."""
        return dict.fromkeys(self.names, model)


__all__ = ["Architecture", "Family", "ShapeFields", "no_fields"]
