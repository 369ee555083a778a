"""PrefixIndex: which engine holds which prefix-cache blocks, as the engines said.

Why: a request whose prompt starts with blocks an engine has cached skips their
prefill there; the router needs to know, per engine, how long a prompt's cached
prefix is. Each engine publishes its cache's changes as KV events (block hashes
stored / removed, or cleared), batched by its server; every client (each ingress
replica) applies them here. The hashes are the engine's own (engine/core/block_hash.py),
so a lookup here and a hit in the engine agree, up to the events still in flight.
"""
from __future__ import annotations

from engine.wire.protocol import KVEvents


class PrefixIndex:
    """Block hashes cached per engine index."""

    def __init__(self) -> None:
        self._blocks: dict[int, set[int]] = {}

    def apply(self, engine: int, events: KVEvents) -> None:
        """Apply one batch of an engine's events (cleared, then removed, then stored)."""
        blocks = self._blocks.get(engine)
        if blocks is None or events.cleared:
            blocks = self._blocks[engine] = set()
        if events.removed:
            blocks.difference_update(events.removed)
        if events.stored:
            blocks.update(events.stored)

    def drop(self, engine: int) -> None:
        """Forget an engine (it died or left): its cache is gone with it."""
        self._blocks.pop(engine, None)

    def num_blocks(self, engine: int) -> int:
        """How many blocks the engine is known to hold."""
        return len(self._blocks.get(engine, ()))

    def holds(self, engine: int, block_hash: int) -> bool:
        return block_hash in self._blocks.get(engine, ())

    def cached_prefix(self, engine: int, hashes: list[int]) -> int:
        """How many leading blocks of a prompt's hash chain the engine holds."""
        blocks = self._blocks.get(engine)
        if not blocks:
            return 0
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n
