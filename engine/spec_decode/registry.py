"""The proposer registry: speculative_config's method -> its proposer class.

Below both of its readers: config.py checks a method against it and proposers/ builds
the configured one (make_proposer). Kept here, importing nothing, so that the config
never imports the proposer family (which imports it back for its types: a circle,
tests/test_import_graph.py), and so that the processes that only check a config (the
CLI, the ingress) never import torch or numpy.

A class is named as "module:Class" and imported only when built; tests register a
Proposer subclass itself.
"""
from __future__ import annotations

_HERE = "engine.spec_decode.proposers"
PROPOSERS: dict[str, str | type] = {
    "ngram": f"{_HERE}.ngram:NgramProposer",
    "suffix": f"{_HERE}.suffix:SuffixProposer",
    "draft_model": f"{_HERE}.draft_model:DraftModelProposer",
    "eagle3": f"{_HERE}.eagle3:Eagle3Proposer",
}

__all__ = ["PROPOSERS"]
