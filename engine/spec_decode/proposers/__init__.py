"""The proposer family: each guesses a request's next tokens without the model's help
(ngram, suffix) or with a small network of its own (draft_model, eagle3).

PROPOSERS maps speculative_config's method to its class, named as "module:Class" so that
the processes that only check a config (the CLI, the ingress) never import torch;
make_proposer imports the configured one.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from engine.spec_decode.proposers.base import ModelProposer, Proposer, ProposerContext

if TYPE_CHECKING:
    from engine.spec_decode.config import SpeculativeConfig

_HERE = "engine.spec_decode.proposers"
PROPOSERS: dict[str, str | type[Proposer]] = {
    "ngram": f"{_HERE}.ngram:NgramProposer",
    "suffix": f"{_HERE}.suffix:SuffixProposer",
    "draft_model": f"{_HERE}.draft_model:DraftModelProposer",
    "eagle3": f"{_HERE}.eagle3:Eagle3Proposer",
}


def make_proposer(config: "SpeculativeConfig", context: ProposerContext | None = None
                  ) -> Proposer:
    cls = PROPOSERS[config.method]
    if isinstance(cls, str):
        module, name = cls.split(":")
        cls = getattr(importlib.import_module(module), name)
    return cls(config, context)


__all__ = ["PROPOSERS", "ModelProposer", "Proposer", "ProposerContext", "make_proposer"]
