"""Proposer: what every proposer offers the engine core."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.errors import InvalidRequestError
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


class Proposer(ABC):
    """Guesses up to k next tokens of a request from its context; told when a request
    ends (its buffers go; a proposer may keep its response). A proposer with a model
    also holds KV blocks (bytes_per_block, start) and follows the engine's sleep."""

    def __init__(self, config: "SpeculativeConfig", context: ProposerContext | None = None
                 ) -> None:
        self.config = config
        self._contexts: dict[str, TokenBuffer] = {}

    @abstractmethod
    def propose(self, request: "Request", k: int) -> list[int]:
        """Up to k tokens likely to follow the request's tokens."""

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


class ModelProposer(Proposer):
    """A proposer that runs a network of its own (a draft model, an EAGLE-3 head) over a
    KV cache indexed by the target's block ids, plus `spare` scratch blocks per sequence
    of the batch after the pool for proposed positions past a request's blocks. It
    proposes for the whole batch at once, and tracks per request how far its cache is
    written (from 0 again after a preemption: the request's blocks changed)."""

    def __init__(self, config: "SpeculativeConfig", context: ProposerContext | None) -> None:
        super().__init__(config)
        if context is None or context.target_runner is None:
            raise InvalidRequestError(f"speculative_config method {config.method!r} runs "
                                      "inside an engine (no target runner given)")
        c = context.engine_config
        self.block_size = c.block_size
        self.spare = -(-config.num_speculative_tokens // c.block_size) + 1
        self.max_seqs = c.max_num_seqs
        self.num_blocks = 0  # the pool's; scratch blocks follow
        self._written: dict[str, tuple[int, int]] = {}  # id -> (preemptions, positions)

    @abstractmethod
    def propose_batch(self, requests: list["Request"], rooms: list[int]) -> list[list[int]]:
        """Each request's proposal from one batched run of the network (rooms[i] tokens
        at most; 0: none)."""

    def propose(self, request: "Request", k: int) -> list[int]:
        return self.propose_batch([request], [k])[0]

    def finish(self, request: "Request") -> None:
        super().finish(request)
        self._written.pop(request.request_id, None)

    def table(self, request: "Request", slot: int) -> list[int]:
        """The request's blocks, then the scratch blocks of batch slot `slot`."""
        first = self.num_blocks + slot * self.spare
        return request.block_ids + list(range(first, first + self.spare))

    def written(self, request: "Request") -> int:
        """Positions of the request this proposer's cache holds."""
        preempted, count = self._written.get(request.request_id, (-1, 0))
        return count if preempted == request.num_preemptions else 0

    def mark_written(self, request: "Request", count: int) -> None:
        self._written[request.request_id] = (request.num_preemptions, count)

