"""Proposer: what every proposer offers the engine core."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.spec_decode.token_index import TokenBuffer

if TYPE_CHECKING:
    from engine.core.request import Request
    from engine.spec_decode.config import SpeculativeConfig


@dataclass(frozen=True)
class ProposerContext:
    """What a model-based proposer needs of its engine (the others need nothing)."""

    engine_config: Any  # EngineConfig
    target_shape: Any  # ModelShape of the target
    max_model_len: int
    device: Any  # torch.device
    dtype: Any  # torch.dtype
    target_runner: Any = None  # the target's ModelRunner (rank 0's under TP)


class Proposer:
    """Guesses up to k next tokens of a request from its context; told when a request
    ends (its buffers go; a proposer may keep its response). A proposer with a model
    also holds KV blocks (bytes_per_block, start) and follows the engine's sleep."""

    def __init__(self, config: "SpeculativeConfig", context: ProposerContext | None = None
                 ) -> None:
        self.config = config
        self._contexts: dict[str, TokenBuffer] = {}

    def propose(self, request: "Request", k: int) -> list[int]:
        raise NotImplementedError

    def propose_batch(self, requests: list["Request"], rooms: list[int]) -> list[list[int]]:
        """Each request's proposal, rooms[i] tokens at most (0: none)."""
        return [self.propose(r, k) if k > 0 else [] for r, k in zip(requests, rooms)]

    def bytes_per_block(self) -> int:
        """KV bytes this proposer holds per block of the pool (a draft model's cache)."""
        return 0

    def start(self, num_blocks: int) -> None:
        """The pool has num_blocks blocks: allocate what goes with them."""

    def after_step(self) -> None:
        """The target ran a step (an EAGLE head keeps its hidden states)."""

    def sleep(self, level: int) -> None:
        """The engine sleeps (level 1: KV freed; 2: weights too)."""

    def wake(self) -> None:
        """The engine wakes: restore what sleep freed."""

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
