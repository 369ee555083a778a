"""OffloadingConnector: the shared KV tier as a connector (vLLM's name for its native
CPU offloading; `--kv-offloading-size` sets it up the same way here).

Every full block a step computes is copied out to a host-memory tier (and, with a
`disk_path`, written in the background to a disk tier that several engines, and nodes
on shared storage, can share); a waiting request's prefix lookup continues past the
pool's hits into the tier, and the blocks found there are read on a background thread
and copied into the pool between steps while the request waits apart. Keys are the
prefix cache's block hashes (adapter folded in), and each read compares the block's
identity (its tokens and adapter), so no request reads another's KV.

kv_connector_extra_config:
- cpu_bytes_to_use: the host tier's bound in bytes (vLLM's key; default 1 GiB);
- disk_path: a directory for the disk tier (none: host memory only);
- disk_bytes_to_use: the disk tier's bound in bytes (default 8 GiB).
"""
from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from engine.core.block_hash import block_hash, root_seed
from engine.core.kv_cache_manager import block_key
from engine.core.request import Request
from engine.errors import InvalidRequestError
from engine.kv_transfer.base import (BlockRef, Connector, ConnectorContext,
                                     ConnectorScheduler, ConnectorWorker,
                                     FinishedTransfers, KVLayout, StepTransfers)
from engine.kv_transfer.tier import DiskTier, HostTier, TierCorruptError, TieredStore
from engine.kv_transfer.tier_events import DISK, HOST, TierEvents

NAME = "OffloadingConnector"
DEFAULTS = {"cpu_bytes_to_use": 1 << 30, "disk_path": None, "disk_bytes_to_use": 8 << 30}
# blocks waiting for the disk writer, at most (past it a write is dropped, not waited
# for): a 4k-token prompt's blocks of SmolLM2 (94 MB) with room to spare
WRITE_QUEUE_BYTES = 256 << 20


def _chain(request: Request, blocks: int, block_size: int) -> list[tuple[int, tuple]]:
    """(hash, identity) of the request's first `blocks` full blocks: the prefix cache's
    own chain (the hashes it registered, continued where it stopped)."""
    tokens, root = request.all_token_ids, request.cache_root
    chain = []
    parent = root_seed(request.lora)
    for i in range(blocks):
        piece = tuple(tokens[i * block_size:(i + 1) * block_size])
        h = request.block_hashes[i] if i < len(request.block_hashes) \
            else block_hash(parent, piece)
        chain.append((h, block_key(root, piece)))
        parent = h
    return chain


class OffloadingScheduler(ConnectorScheduler):
    def __init__(self, store: TieredStore, block_size: int) -> None:
        self.store = store
        self.block_size = block_size
        self.events = TierEvents()  # what the tiers gained and lost, for the routers
        store.host.on_change = lambda h, stored: self.events.record(HOST, h, stored)
        if store.disk is not None:
            store.disk.on_change = lambda h, stored: self.events.record(DISK, h, stored)
        self._pending: dict[str, list[BlockRef]] = {}  # loads ordered, not yet started
        self._saved: dict[str, int] = {}  # request id -> its leading blocks in the tier

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        first = num_computed_tokens // self.block_size
        usable = (request.num_tokens - 1) // self.block_size  # one token left to compute
        if usable <= first:
            return 0, False
        found = 0
        for h, identity in _chain(request, usable, self.block_size)[first:]:
            if not self.store.contains(h, identity):
                break
            found += 1
        return found * self.block_size, found > 0

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        first = request.num_computed_tokens // self.block_size
        chain = _chain(request, first + len(block_ids), self.block_size)[first:]
        refs = [BlockRef(b, h, identity) for b, (h, identity) in zip(block_ids, chain)]
        for ref in refs:  # not evicted by this engine's saves before the load reads it
            self.store.host.pin(ref.block_hash)
        self._pending[request.request_id] = refs
        # what it loads is in the tier already: no save of those
        self._saved[request.request_id] = first + len(block_ids)

    def build_step_transfers(self, scheduled: list[tuple[Request, int]]) -> StepTransfers:
        loads, self._pending = self._pending, {}
        saves: list[BlockRef] = []
        for request, n in scheduled:
            full = min(request.num_computed_tokens + n, request.num_tokens) // self.block_size
            # a request's pool hits were saved when they were computed: from its first
            # computed block on
            start = self._saved.setdefault(request.request_id,
                                           request.num_computed_tokens // self.block_size)
            if full <= start or len(request.block_hashes) < full:
                continue  # nothing newly full (or no hashes: prefix caching off)
            tokens, root = request.all_token_ids, request.cache_root
            for i in range(start, full):
                piece = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
                ref = BlockRef(request.block_ids[i], request.block_hashes[i],
                               block_key(root, piece))
                if not self.store.contains(ref.block_hash, ref.identity):
                    saves.append(ref)
            self._saved[request.request_id] = full
        return StepTransfers(loads, saves)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self._saved.pop(request.request_id, None)
        return False, None

    def request_dropped(self, request: Request) -> None:
        for ref in self._pending.pop(request.request_id, ()):  # its load never started
            self.store.host.unpin(ref.block_hash)
        self._saved.pop(request.request_id, None)

    def take_events(self, snapshot: bool) -> dict[str, list[int]]:
        if snapshot or not self.events.enabled:
            disk = self.store.disk
            return self.events.snapshot(self.store.host.hashes(),
                                        disk.hashes() if disk is not None else [])
        return self.events.take()


class OffloadingWorker(ConnectorWorker):
    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self.caches: torch.Tensor | None = None
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-load")
        self._done: dict[str, list[tuple[int, torch.Tensor]] | str] = {}
        self._arrived = threading.Condition()
        self._in_flight = 0
        self.blocks_loaded = self.blocks_saved = 0
        self.block_bytes = 0  # one block's bytes, every layer's (register_kv_caches)

    def register_kv_caches(self, caches: torch.Tensor, layout: KVLayout) -> None:
        self.caches = caches
        self.block_bytes = layout.dtype.itemsize * math.prod(layout.block_shape)

    def start_load_kv(self, loads: dict[str, list[BlockRef]]) -> None:
        for request_id, refs in loads.items():
            with self._arrived:
                self._in_flight += 1
            self._reader.submit(self._read, request_id, refs)

    def _read(self, request_id: str, refs: list[BlockRef]) -> None:
        """On the reader thread: every block's payload, or why one could not be read."""
        try:
            result = self._read_blocks(refs)
        finally:
            for ref in refs:
                self.store.host.unpin(ref.block_hash)
        with self._arrived:
            self._done[request_id] = result
            self._in_flight -= 1
            self._arrived.notify_all()

    def _read_blocks(self, refs: list[BlockRef]) -> list[tuple[int, torch.Tensor]] | str:
        result: list[tuple[int, torch.Tensor]] = []
        for ref in refs:
            try:
                payload = self.store.get(ref.block_hash, ref.identity)
            except TierCorruptError as exc:
                return f"block {ref.block_hash & (2 ** 64 - 1):016x} is corrupt ({exc})"
            except Exception as exc:  # a disk error: the request's policy decides
                return f"block {ref.block_hash & (2 ** 64 - 1):016x}: {exc!r}"
            if payload is None:
                return (f"block {ref.block_hash & (2 ** 64 - 1):016x} left the tier "
                        "before it was read")
            result.append((ref.block_id, payload))
        return result

    def get_finished(self, waiting: set[str]) -> FinishedTransfers:
        with self._arrived:
            done, self._done = self._done, {}
        finished = FinishedTransfers()
        for request_id, result in done.items():
            if request_id not in waiting:
                continue  # aborted while its blocks were read: they may be reused now
            if isinstance(result, str):
                finished.failed[request_id] = result
                continue
            for block_id, payload in result:
                self.caches[:, block_id].copy_(payload.view(self.caches[:, block_id].shape))
            self.blocks_loaded += len(result)
            finished.received.add(request_id)
        return finished

    def save_kv(self, saves: list[BlockRef]) -> None:
        for ref in saves:
            self.store.put(ref.block_hash, ref.identity, self.caches[:, ref.block_id])
        self.blocks_saved += len(saves)

    def wait(self, timeout: float) -> None:
        with self._arrived:
            if not self._done and self._in_flight:
                self._arrived.wait(timeout)

    def shutdown(self) -> None:
        self._reader.shutdown(wait=True, cancel_futures=True)
        self.store.close()


def build(extra: dict[str, Any], context: ConnectorContext) -> Connector:
    """The connector over a pool, its extra config checked (unknown keys refused)."""
    unknown = sorted(set(extra) - set(DEFAULTS))
    if unknown:
        raise InvalidRequestError(f"kv_connector_extra_config: {NAME} does not read "
                          f"{', '.join(map(repr, unknown))}; it reads {', '.join(DEFAULTS)}")
    settings = {**DEFAULTS, **extra}
    check_pool(context)
    for key in ("cpu_bytes_to_use", "disk_bytes_to_use"):
        if not isinstance(settings[key], int) or isinstance(settings[key], bool) \
                or settings[key] <= 0:
            raise InvalidRequestError(f"kv_connector_extra_config {key} must be a positive number "
                              f"of bytes, got {settings[key]!r}")
    layout = context.layout
    disk = None
    if settings["disk_path"] is not None:
        block_bytes = layout.dtype.itemsize * math.prod(layout.block_shape)
        disk = DiskTier(Path(settings["disk_path"]), layout.fingerprint,
                        settings["disk_bytes_to_use"], layout.block_shape, layout.dtype,
                        queue_size=max(64, WRITE_QUEUE_BYTES // max(1, block_bytes)))
    store = TieredStore(HostTier(settings["cpu_bytes_to_use"]), disk)
    worker = OffloadingWorker(store)
    worker.register_kv_caches(context.caches, layout)
    return Connector(NAME, OffloadingScheduler(store, layout.block_size), worker)


def check_pool(context: ConnectorContext) -> None:
    """Refuse, naming it, a pool whose blocks this connector cannot move whole."""
    why = None
    if not context.prefix_caching:
        why = "prefix caching is off (the tier's keys are the prefix cache's block hashes)"
    elif context.tensor_parallel_size > 1:
        why = "tensor parallelism (each rank's share of a block is in another process)"
    elif context.state_blocks:
        why = "a hybrid model (its recurrent state is not in the tier)"
    elif context.kv_groups > 1:
        why = "a model whose layers keep separate block tables (sliding-window groups)"
    elif not context.block_major:
        why = "this attention backend's head-major cache (native and torch keep blocks whole)"
    if why is not None:
        raise InvalidRequestError(f"kv_transfer_config: {NAME} is not served with {why}")


__all__ = ["NAME", "OffloadingScheduler", "OffloadingWorker", "build", "check_pool"]
