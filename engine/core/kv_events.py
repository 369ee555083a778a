"""KVEventLog: what happened to an engine's prefix cache since someone last asked.

Why: the routers of the frontend keep an index of which engine holds which prefix
blocks (engine/wire/prefix_index.py); the engine tells them by events, batched by
the engine-core server. Recording runs on the engine's step thread, so it is one dict
store per event, and events of one hash coalesce (its last state wins), which keeps a
batch no bigger than the cache's churn since the last batch.

Nothing is recorded until the first take() or snapshot(): an offline engine that no
router listens to pays nothing and keeps no growing log. The first take() answers a
snapshot (cleared + everything cached), so a consumer always starts from full state.
"""
from __future__ import annotations

from collections.abc import Iterable

from engine.core_messages import KVEvents


class KVEventLog:
    """Coalesced stored / removed / cleared events of one prefix cache."""

    __slots__ = ("enabled", "_cleared", "_ops")

    def __init__(self) -> None:
        self.enabled = False
        self._cleared = False
        self._ops: dict[int, bool] = {}  # block hash -> cached now (True) or gone (False)

    def stored(self, block_hash: int) -> None:
        """A block got this hash and is findable in the cache."""
        if self.enabled:
            self._ops[block_hash] = True

    def removed(self, block_hash: int) -> None:
        """The cached block with this hash was reused: no longer findable."""
        if self.enabled:
            self._ops[block_hash] = False

    def cleared(self) -> None:
        """Every cached block was dropped (reset_prefix_cache)."""
        if self.enabled:
            self._cleared = True
            self._ops.clear()

    def take(self, cached: Iterable[int]) -> KVEvents | None:
        """The events since the last take (None: nothing happened). `cached` (the hashes
        cached now) answers the first call, as a snapshot."""
        if not self.enabled:
            return self.snapshot(cached)
        if not self._cleared and not self._ops:
            return None
        ops, self._ops = self._ops, {}
        cleared, self._cleared = self._cleared, False
        return KVEvents(cleared=cleared, stored=[h for h, on in ops.items() if on],
                        removed=[h for h, on in ops.items() if not on])

    def snapshot(self, cached: Iterable[int]) -> KVEvents:
        """The whole state as events (cleared, then every cached hash stored); records
        from now on. Pending events are kept for take(): they are already in it."""
        self.enabled = True
        return KVEvents(cleared=True, stored=list(cached))
