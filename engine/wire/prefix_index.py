"""PrefixIndex: which engine holds which prefix-cache blocks, as the engines said.

Why: a request whose prompt starts with blocks an engine has cached skips their
prefill there; the router needs to know, per engine, how long a prompt's cached
prefix is. Each engine publishes its cache's changes as KV events (block hashes
stored / removed, or cleared), batched by its server; every client (each ingress
replica) applies them here. The hashes are the engine's own (engine/core/block_hash.py),
so a lookup here and a hit in the engine agree, up to the events still in flight.

Events lag (batched every ~100 ms), so the blocks of a prompt this client has just
routed count as held by that engine for RECENT_S or until its events say otherwise:
a burst of requests with a new prefix follows the first one instead of computing the
prefix on every engine before the first event arrives.

Beside the pools, the engines' KV tiers (engine/kv_transfer): each engine's host tier,
and the disk tier a deployment's engines share (one set, fed by every engine's events),
so a prefix found there counts as a tier hit on any engine (tier_prefix).
"""
from __future__ import annotations

import time

from engine.core_messages import KVEvents

RECENT_S = 1.0  # how long a routed prompt's blocks count as held without an event


class PrefixIndex:
    """Block hashes cached per engine index."""

    def __init__(self) -> None:
        self._blocks: dict[int, set[int]] = {}
        self._recent: dict[int, dict[int, float]] = {}  # engine -> hash -> until (monotonic)
        self._host: dict[int, set[int]] = {}  # engine -> its host tier's hashes
        self._disk: set[int] = set()  # the shared disk tier's hashes

    def apply(self, engine: int, events: KVEvents) -> None:
        """Apply one batch of an engine's events (cleared, then removed, then stored)."""
        blocks = self._blocks.get(engine)
        recent = self._recent.get(engine)
        if blocks is None or events.cleared:
            blocks = self._blocks[engine] = set()
        if events.cleared and recent:
            recent.clear()
        if events.removed:
            blocks.difference_update(events.removed)
            if recent:
                for h in events.removed:
                    recent.pop(h, None)
        if events.stored:
            blocks.update(events.stored)
        host = self._host.get(engine)
        if events.cleared and host:
            host.clear()
        if events.host_stored or events.host_removed:
            host = self._host.setdefault(engine, set())
            host.difference_update(events.host_removed)
            host.update(events.host_stored)
        self._disk.difference_update(events.disk_removed)
        self._disk.update(events.disk_stored)

    def routed(self, engine: int, hashes: list[int], now: float | None = None) -> None:
        """This client sent a prompt with these blocks to the engine: count them as held
        there until its events catch up (RECENT_S at most)."""
        if not hashes:
            return
        recent = self._recent.setdefault(engine, {})
        now = time.monotonic() if now is None else now
        if len(recent) > 4 * len(hashes) + 1024:  # drop the expired ones now and then
            for h in [h for h, until in recent.items() if until <= now]:
                del recent[h]
        until = now + RECENT_S
        for h in hashes:
            recent[h] = until

    def drop(self, engine: int) -> None:
        """Forget an engine (it died or left): its cache and host tier are gone with it
        (the shared disk tier stays)."""
        self._blocks.pop(engine, None)
        self._recent.pop(engine, None)
        self._host.pop(engine, None)

    def tier_prefix(self, engine: int, hashes: list[int], start: int) -> int:
        """How many blocks of the chain from `start` (past the engine's pool prefix) its
        host tier or the shared disk tier holds, consecutively."""
        host = self._host.get(engine, ())
        n = 0
        for h in hashes[start:]:
            if h not in host and h not in self._disk:
                break
            n += 1
        return n

    def num_blocks(self, engine: int) -> int:
        """How many blocks the engine is known to hold."""
        return len(self._blocks.get(engine, ()))

    def holds(self, engine: int, block_hash: int) -> bool:
        return block_hash in self._blocks.get(engine, ())

    def cached_prefix(self, engine: int, hashes: list[int]) -> int:
        """How many leading blocks of a prompt's hash chain the engine holds."""
        blocks = self._blocks.get(engine, ())
        recent = self._recent.get(engine)
        now = None
        n = 0
        for h in hashes:
            if h not in blocks:
                until = recent.get(h) if recent else None
                if until is None:
                    break
                if now is None:
                    now = time.monotonic()
                if until <= now:
                    break
            n += 1
        return n
