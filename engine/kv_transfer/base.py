"""The KV connector interface: what moves KV blocks into and out of an engine's pool.

Why two halves (the split vLLM's v1 connectors use): the scheduler decides which of a
request's tokens come from outside the pool and which blocks they land in, and must
never wait for bytes; the worker holds the cache tensors and moves the bytes, in the
background where they come from far away. The halves talk only through a StepTransfers
each step (scheduler -> worker) and a FinishedTransfers (worker -> scheduler), so a
worker can live in another process (a tensor-parallel rank) without the scheduler
knowing.

A step with a connector (engine/kv_transfer/steps.py drives it):
1. worker.get_finished: loads done since the last step are in the pool; the scheduler
   half learns which requests' KV arrived (they run from the next schedule), which
   sends finished (their delayed blocks are freed), which loads failed (the request
   recomputes or fails: kv_load_failure_policy).
2. schedule: for a waiting request, after its pool prefix hits, the scheduler half says
   how many more tokens it can supply (get_num_new_matched_tokens); the scheduler
   allocates their blocks and tells it which (update_state_after_alloc); the request
   then waits in its own state (WAITING_FOR_KV) while others run.
3. build_step_transfers -> worker.start_load_kv (returns at once) before the forward,
   worker.save_kv after it (the blocks this step filled).
4. When a request finishes, request_finished says whether its blocks must outlive it
   (a send still reading them) and what kv_transfer_params its final output carries.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.core.request import Request


@dataclass(frozen=True)
class BlockRef:
    """One block of a transfer: where it is in this pool, and what it holds (its hash in
    the prefix cache's chain, and its identity: the tokens and adapter, compared on
    every read so that even a hash collision never hands out another block's KV)."""

    block_id: int
    block_hash: int
    identity: tuple


@dataclass
class StepTransfers:
    """The scheduler half's orders to the worker half for one step."""

    # request id -> the blocks to fill from outside before the request runs
    loads: dict[str, list[BlockRef]] = field(default_factory=dict)
    # blocks this step's forward fills, to copy out after it
    saves: list[BlockRef] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves)


@dataclass
class FinishedTransfers:
    """What the worker half finished since it was last asked."""

    received: set[str] = field(default_factory=set)  # request ids whose loads are in the pool
    sent: set[str] = field(default_factory=set)  # request ids whose sends no longer read blocks
    # request id -> why its load failed (a missing, corrupt or refused block)
    failed: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class KVLayout:
    """What a pool's blocks look like, checked on both sides of every transfer: a block
    read by an engine whose layout differs would be wrong KV, not an error."""

    block_shape: tuple[int, ...]  # one block across every layer, as the worker copies it
    dtype: torch.dtype
    block_size: int  # tokens per block
    fingerprint: str  # model, dtype, block size, layout and TP shape, hashed


class ConnectorScheduler(ABC):
    """The scheduler's half. Runs on the engine's step thread and never waits for bytes."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """How many tokens past num_computed_tokens (the pool's prefix hits, whole blocks)
        this connector can supply, in whole blocks and leaving at least one token to
        compute; and whether they arrive asynchronously (the request then waits)."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        """The pool blocks the scheduler gave the external tokens, in order."""

    @abstractmethod
    def build_step_transfers(self, scheduled: list[tuple[Request, int]]) -> StepTransfers:
        """This step's loads (those ordered since the last call) and saves (blocks the
        scheduled (request, new tokens) pairs fill)."""

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """(keep its blocks until the worker reports the request sent, the
        kv_transfer_params its final output carries). Default: free now, nothing."""
        return False, None

    def request_dropped(self, request: Request) -> None:
        """A request waiting for its KV was aborted: forget its pending load (the worker
        discards what it reads for it)."""

    def take_events(self, snapshot: bool) -> dict[str, list[int]] | None:
        """Where blocks live outside the pool, for the routers: KVEvents' host_* and
        disk_* fields since the last call (snapshot: everything held now). None: this
        connector keeps no tier."""
        return None


class ConnectorWorker(ABC):
    """The worker's half: owns the bytes' movement, beside the cache tensors."""

    @abstractmethod
    def register_kv_caches(self, caches: torch.Tensor, layout: KVLayout) -> None:
        """The pool, and how its blocks look (before the first step)."""

    @abstractmethod
    def start_load_kv(self, loads: dict[str, list[BlockRef]]) -> None:
        """Begin filling these requests' blocks; returns at once."""

    @abstractmethod
    def save_kv(self, saves: list[BlockRef]) -> None:
        """Copy out blocks this step filled (before any of them can be reused)."""

    @abstractmethod
    def get_finished(self, waiting: set[str]) -> FinishedTransfers:
        """Loads of the `waiting` requests that completed are copied into the pool now
        (on the step thread, between steps); loads of requests no longer waiting are
        dropped unread into the pool."""

    def wait(self, timeout: float) -> None:
        """Block up to timeout while loads are in flight and nothing else can run."""

    def shutdown(self) -> None:
        """Stop background threads; release sockets and files."""


@dataclass(frozen=True)
class ConnectorContext:
    """What a connector is built for: the engine's pool and how it is kept."""

    caches: Any  # the pool's tensor (block-major: [layers, blocks, 2, kv heads, bs, dim])
    layout: KVLayout
    prefix_caching: bool  # blocks are named by hash (a tier's keys)
    kv_groups: int  # KV groups with their own block tables (1 for most models)
    state_blocks: bool  # a hybrid's recurrent state rides in a block of its own
    tensor_parallel_size: int
    block_major: bool  # one block's KV of every layer is caches[:, block_id]


@dataclass
class Connector:
    """A configured connector's two halves, as the registry makes them."""

    name: str
    scheduler: ConnectorScheduler
    worker: ConnectorWorker


__all__ = ["BlockRef", "Connector", "ConnectorContext", "ConnectorScheduler", "ConnectorWorker",
           "FinishedTransfers", "KVLayout", "StepTransfers"]
