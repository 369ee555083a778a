"""Proposer: what every proposer offers the engine core."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from engine.spec_decode.token_index import TokenBuffer

if TYPE_CHECKING:
    from engine.core.request import Request
    from engine.spec_decode.config import SpeculativeConfig


class Proposer:
    """Guesses up to k next tokens of a request from its context; told when a request
    ends (its buffers go; a proposer may keep its response)."""

    def __init__(self, config: "SpeculativeConfig") -> None:
        self.config = config
        self._contexts: dict[str, TokenBuffer] = {}

    def propose(self, request: "Request", k: int) -> list[int]:
        raise NotImplementedError

    def finish(self, request: "Request") -> None:
        self._contexts.pop(request.request_id, None)

    def context(self, request: "Request") -> np.ndarray:
        """The request's prompt and output as an array, kept in step with its tokens
        (appends only: a request's tokens never change once known)."""
        buf = self._contexts.get(request.request_id)
        if buf is None:
            buf = self._contexts[request.request_id] = TokenBuffer(
                max(256, 2 * request.num_tokens))
        tokens = request.all_token_ids
        if buf.size < len(tokens):
            buf.extend(tokens[buf.size:])
        return buf.view()
