"""TierEvents: what entered and left an engine's KV tiers, for the routers.

Why: a router that knows only the pools would send a request whose prefix sits in a
tier anywhere, as a miss; with these events it counts a tier hit as cheaper than a miss
and dearer than a pool hit (engine/wire/routing.py). The host tier is the engine's own;
the disk tier is shared by the engines of a deployment, so the engine reports the blocks
it wrote there and those it evicted, and a router applies them to every engine.

The tiers change on other threads (the disk writer, the loader), so events are recorded
under a lock and coalesced per hash (the last state wins), as the pool's KVEventLog does;
nothing is recorded until a router first asks (an offline engine keeps no log).
"""
from __future__ import annotations

import threading
from collections.abc import Iterable

HOST, DISK = "host", "disk"


class TierEvents:
    """Coalesced stored / removed events of one engine's tiers."""

    def __init__(self) -> None:
        self.enabled = False
        self._lock = threading.Lock()
        self._ops: dict[str, dict[int, bool]] = {HOST: {}, DISK: {}}

    def record(self, medium: str, block_hash: int, stored: bool) -> None:
        """A block entered (stored) or left the medium's tier."""
        if self.enabled:
            with self._lock:
                self._ops[medium][block_hash] = stored

    def take(self) -> dict[str, list[int]]:
        """host_stored, host_removed, disk_stored, disk_removed since the last take (the
        KVEvents fields); empty lists where nothing happened."""
        with self._lock:
            ops, self._ops = self._ops, {HOST: {}, DISK: {}}
        out: dict[str, list[int]] = {}
        for medium, changes in ops.items():
            out[f"{medium}_stored"] = [h for h, on in changes.items() if on]
            out[f"{medium}_removed"] = [h for h, on in changes.items() if not on]
        return out

    def snapshot(self, host: Iterable[int], disk: Iterable[int]) -> dict[str, list[int]]:
        """Every block the tiers hold now, as stored events; records from now on.
        Pending events are kept for take() (other routers have not seen them; for this
        one they repeat what the snapshot says)."""
        with self._lock:
            self.enabled = True
        return {"host_stored": list(host), "host_removed": [], "disk_stored": list(disk),
                "disk_removed": []}


__all__ = ["DISK", "HOST", "TierEvents"]
