"""The proposer family: each guesses a request's next tokens without the model's help.

PROPOSERS maps speculative_config's method to its class; make_proposer builds the
configured one.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.spec_decode.proposers.base import Proposer, ProposerContext
from engine.spec_decode.proposers.draft_model import DraftModelProposer
from engine.spec_decode.proposers.eagle3 import Eagle3Proposer
from engine.spec_decode.proposers.ngram import NgramProposer
from engine.spec_decode.proposers.suffix import SuffixProposer

if TYPE_CHECKING:
    from engine.spec_decode.config import SpeculativeConfig

PROPOSERS: dict[str, type[Proposer]] = {
    "ngram": NgramProposer,
    "suffix": SuffixProposer,
    "draft_model": DraftModelProposer,
    "eagle3": Eagle3Proposer,
}


def make_proposer(config: "SpeculativeConfig", context: ProposerContext | None = None
                  ) -> Proposer:
    return PROPOSERS[config.method](config, context)


__all__ = ["PROPOSERS", "Proposer", "ProposerContext", "make_proposer"]
