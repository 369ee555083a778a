"""The proposer family: each guesses a request's next tokens without the model's help
(ngram, suffix) or with a small network of its own (draft_model, eagle3).

PROPOSERS (engine.spec_decode.registry, re-exported here) maps speculative_config's
method to its class, named as "module:Class" so that the processes that only check a
config (the CLI, the ingress) never import torch; make_proposer imports the configured
one.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from engine.spec_decode.proposers.base import ModelProposer, Proposer, ProposerContext
from engine.spec_decode.registry import PROPOSERS

if TYPE_CHECKING:
    from engine.spec_decode.config import SpeculativeConfig


def make_proposer(config: "SpeculativeConfig", context: ProposerContext | None = None
                  ) -> Proposer:
    """The configured method's proposer (its module imported here, on first use)."""
    cls = PROPOSERS[config.method]
    if isinstance(cls, str):
        module, name = cls.split(":")
        cls = getattr(importlib.import_module(module), name)
    return cls(config, context)


__all__ = ["PROPOSERS", "ModelProposer", "Proposer", "ProposerContext", "make_proposer"]
