"""The storage of a shared KV tier: where KV blocks that leave an engine's pool wait,
in host memory and on (possibly shared) disk, to be loaded back instead of recomputed.

Why: a prefix computed once, on one engine, is worth reusing by any engine serving the
same model, and worth keeping across an engine's restart.

Keys are the engine's own prefix-cache block hashes (engine/core/block_hash.py), a hash
chain over the tokens with the LoRA adapter folded into its root: KV computed under one
adapter (one tenant) is never found under another or the base model. Beside each block
the tier keeps its identity (kv_cache_manager.block_key: the tokens, and the adapter root if
any) and compares it on every read, so not even a hash collision hands out another
block's KV.

Every tier is bounded by bytes and drops the least recently used block first:
HostTier (an in-process LRU of CPU tensors), DiskTier (a file per block under
directory/fingerprint/, shared by every engine process, and node on shared storage,
using the directory; recency is the files' mtimes, so LRU holds across processes), and
TieredStore (host in front of disk).
"""
from __future__ import annotations

import logging
import math
import os
import queue
import re
import secrets
import struct
import threading
import time
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Callable

import msgspec
import torch

from engine.errors import FlotillaError

logger = logging.getLogger(__name__)

__all__ = ["DiskTier", "HostTier", "TierCorruptError", "TieredStore"]


def _unlink(path: Path | str) -> bool:
    """Delete path; False when another process already did."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


class TierCorruptError(FlotillaError):
    """A stored block failed its checksum or length check: its bytes are not the KV that
    was written. The caller applies its load-failure policy (recompute or fail)."""


def _cpu_copy(payload: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy the tier owns: the caller's tensor is usually a view into the
    KV pool, which the engine overwrites as soon as the block is reused."""
    out = torch.empty(payload.shape, dtype=payload.dtype, device="cpu")
    out.copy_(payload.detach())
    return out


class HostTier:
    """An in-memory LRU of block payloads, bounded by their bytes.

    Thread-safe: a loader thread reads while the engine thread writes. A payload that
    get() returns is the tier's own tensor: read it (copy it into the pool), never
    modify it."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = int(capacity_bytes)
        self._entries: OrderedDict[int, tuple[tuple, torch.Tensor]] = OrderedDict()
        self._nbytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = 0
        # called (block hash, stored) as a block enters or leaves (TierEvents.record)
        self.on_change: Callable[[int, bool], None] | None = None
        self._pinned: dict[int, int] = {}  # block hash -> loads that will read it

    def pin(self, block_hash: int) -> None:
        """Keep the block from eviction until as many unpin()s: a load was decided on it
        and will read it (past the bound, briefly, if only pinned blocks are left)."""
        with self._lock:
            self._pinned[block_hash] = self._pinned.get(block_hash, 0) + 1

    def unpin(self, block_hash: int) -> None:
        with self._lock:
            left = self._pinned.get(block_hash, 0) - 1
            if left > 0:
                self._pinned[block_hash] = left
            else:
                self._pinned.pop(block_hash, None)

    def get(self, block_hash: int, identity: tuple) -> torch.Tensor | None:
        """The block's payload (now the most recently used), or None when absent or when
        the entry under this hash is another block's (a collision)."""
        with self._lock:
            entry = self._entries.get(block_hash)
            if entry is None or entry[0] != identity:
                self.misses += 1
                return None
            self._entries.move_to_end(block_hash)
            self.hits += 1
            return entry[1]

    def put(self, block_hash: int, identity: tuple, payload: torch.Tensor) -> None:
        """Store a copy of payload (the caller may overwrite its tensor right after)."""
        self._put_owned(block_hash, identity, _cpu_copy(payload))

    def _put_owned(self, block_hash: int, identity: tuple, payload: torch.Tensor) -> None:
        size = payload.nbytes
        if size > self.capacity_bytes:
            return  # would evict everything and still not fit
        changes = []
        with self._lock:
            old = self._entries.pop(block_hash, None)
            if old is not None:
                self._nbytes -= old[1].nbytes
            else:
                changes.append((block_hash, True))
            self._entries[block_hash] = (identity, payload)
            self._nbytes += size
            while self._nbytes > self.capacity_bytes:
                gone = next((h for h in self._entries if h not in self._pinned), None)
                if gone is None:
                    break  # only pinned blocks left: over the bound until they are read
                _, evicted = self._entries.pop(gone)
                self._nbytes -= evicted.nbytes
                self.evictions += 1
                changes.append((gone, False))
        _tell(self.on_change, changes)

    def contains(self, block_hash: int, identity: tuple) -> bool:
        """Whether the block is here; leaves its recency as it was."""
        with self._lock:
            entry = self._entries.get(block_hash)
            return entry is not None and entry[0] == identity

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes of payload held now (never above capacity_bytes)."""
        return self._nbytes

    def hashes(self) -> list[int]:
        """Every block hash held now (a router's snapshot)."""
        with self._lock:
            return list(self._entries)

    def clear(self) -> None:
        with self._lock:
            gone = [(h, False) for h in self._entries]
            self._entries.clear()
            self._nbytes = 0
        _tell(self.on_change, gone)


def _hash_of(name: str) -> int:
    """The (signed, as Python's) block hash a file is named by."""
    value = int(name[:16], 16)
    return value - (1 << 64) if value >= 1 << 63 else value


def _tell(on_change: Callable[[int, bool], None] | None,
          changes: list[tuple[int, bool]]) -> None:
    """Report (hash, stored) changes, outside the tier's lock."""
    if on_change is not None:
        for block_hash, stored in changes:
            on_change(block_hash, stored)


# File layout: header | identity (msgpack) | payload bytes.
# header: magic, format version, flags (0), payload length, crc32 of payload, identity length
_MAGIC = b"FLKV"
_VERSION = 1
_HEADER = struct.Struct("<4sHHQII")
_MAX_IDENTITY = 1 << 20  # an identity is a block's tokens plus an adapter root: small
_STALE_TMP_S = 600.0  # a temp file this old was left by a writer that died
_FINGERPRINT = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
_STOP = object()


class DiskTier:
    """Blocks as files under directory/fingerprint/, shared by concurrent processes.

    A file, named by the block hash as 16 hex digits + ".kv", holds a header, the
    identity (msgpack) and the payload's raw bytes. Writes go to a temp file in the same
    directory, then os.replace: a reader never sees half a file. No fsync (a cache): a
    file a crash left short or garbled fails its checks (TierCorruptError), is deleted.

    Checksum: zlib.crc32. On a 1 MiB payload here crc32 took ~245 us (~4.0 GiB/s),
    hashlib.blake2b(digest_size=8) ~1,100 us (~0.9 GiB/s): 4.5x, on every read and write
    of every block. It must catch accidents (torn, truncated files, bit rot), which a
    32-bit CRC does, not tampering: whoever can write the directory forges any checksum.

    Capacity: after a put that takes the directory past capacity_bytes, the files with
    the oldest mtime go (reads touch files: least recently used in any process). The
    total is a running estimate, corrected by a directory scan every `rescan_every`
    puts (other processes write too) or when it says over: a put is not a scan. Files
    may vanish at any moment (another process evicted them): that is a miss.

    put_async hands writes to one writer thread through a bounded queue; a write that
    finds it full is dropped (dropped_writes): a tier write never blocks a step."""

    def __init__(self, directory: Path, fingerprint: str, capacity_bytes: int,
                 block_shape: tuple[int, ...], dtype: torch.dtype, *,
                 queue_size: int = 64, rescan_every: int = 64) -> None:
        if not _FINGERPRINT.fullmatch(fingerprint):
            raise ValueError(f"fingerprint must be a plain file name, got {fingerprint!r}")
        self.path = Path(directory) / fingerprint
        self.path.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = int(capacity_bytes)
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.payload_bytes = math.prod(self.block_shape) * dtype.itemsize
        self.rescan_every = max(1, rescan_every)
        self._encoder = msgspec.msgpack.Encoder()  # thread-safe since msgspec 0.16
        self._lock = threading.Lock()  # counters and the estimate
        self._scan_lock = threading.Lock()
        self._estimate = 0
        self._puts_since_scan = self.rescan_every  # the first put scans
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, queue_size))
        self._pending = 0
        self._drained = threading.Condition(self._lock)
        self._writer: threading.Thread | None = None
        self._closed = False
        self.hits = self.misses = self.corrupt = self.evictions = 0
        self.bytes_written = self.bytes_read = 0
        self.dropped_writes = self.write_errors = 0
        # called (block hash, stored) as this process writes or evicts a block's file
        self.on_change: Callable[[int, bool], None] | None = None

    def _file(self, block_hash: int) -> Path:  # Python hashes are signed: mask to 64 bits
        return self.path / f"{block_hash & 0xFFFFFFFFFFFFFFFF:016x}.kv"

    def hashes(self) -> list[int]:
        """The block hashes of every file in the tier now (a router's snapshot)."""
        try:
            with os.scandir(self.path) as entries:
                return [_hash_of(e.name) for e in entries
                        if e.name.endswith(".kv") and len(e.name) == 19]
        except FileNotFoundError:
            return []

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    # ---- reads ----------------------------------------------------------------------
    def _read_header(self, f, path: Path) -> tuple[int, int, bytes] | None:
        """(payload length, crc, identity bytes), or None for a file of another format
        version. Raises TierCorruptError for a file that is no block file at all."""
        head = f.read(_HEADER.size)
        if len(head) < _HEADER.size:
            raise TierCorruptError(f"{path}: truncated header")
        magic, version, _flags, length, crc, ident_len = _HEADER.unpack(head)
        if magic != _MAGIC:
            raise TierCorruptError(f"{path}: bad magic")
        if version != _VERSION:
            return None  # written by another release: not ours to judge
        if ident_len > _MAX_IDENTITY:
            raise TierCorruptError(f"{path}: identity length {ident_len}")
        ident = f.read(ident_len)
        if len(ident) < ident_len:
            raise TierCorruptError(f"{path}: truncated identity")
        return length, crc, ident

    def get(self, block_hash: int, identity: tuple) -> torch.Tensor | None:
        """The block's payload (block_shape, dtype), or None when no file holds it or the
        file holds another block (a collision). Touches the file (LRU). Raises
        TierCorruptError when its length or checksum is wrong (the file is deleted)."""
        path = self._file(block_hash)
        try:
            with open(path, "rb", buffering=0) as f:
                header = self._read_header(f, path)
                if header is None or header[2] != self._encoder.encode(identity):
                    self._count(misses=1)
                    return None
                length, crc, ident = header
                expected = _HEADER.size + len(ident) + length
                size = os.fstat(f.fileno()).st_size
                if length != self.payload_bytes or size != expected:
                    raise TierCorruptError(f"{path}: {size} bytes, payload {length}; expected "
                                           f"{_HEADER.size + len(ident) + self.payload_bytes}")
                buf = torch.empty(length, dtype=torch.uint8)
                view = buf.numpy()
                if f.readinto(view) != length:
                    raise TierCorruptError(f"{path}: truncated payload")
                if zlib.crc32(view) != crc:
                    raise TierCorruptError(f"{path}: checksum mismatch")
        except FileNotFoundError:
            self._count(misses=1)
            return None
        except TierCorruptError:
            self._count(corrupt=1)
            if _unlink(path):
                _tell(self.on_change, [(block_hash, False)])
            raise
        try:
            os.utime(path)
        except FileNotFoundError:
            pass  # evicted by another process since: the bytes we read are still good
        self._count(hits=1, bytes_read=length)
        return buf.view(self.dtype).view(self.block_shape)

    def contains(self, block_hash: int, identity: tuple) -> bool:
        """Whether a file holds this block; reads only its header (no payload check). A
        found block becomes the most recently used: a load decided on it reads it next,
        and the least recently used go first."""
        path = self._file(block_hash)
        if not self._holds(path, self._encoder.encode(identity)):
            return False
        try:
            os.utime(path)
        except FileNotFoundError:
            return False
        return True

    def _holds(self, path: Path, ident: bytes) -> bool:  # header and identity only
        try:
            with open(path, "rb", buffering=0) as f:
                header = self._read_header(f, path)
        except (OSError, TierCorruptError):
            return False
        return header is not None and header[2] == ident

    # ---- writes ---------------------------------------------------------------------
    def put(self, block_hash: int, identity: tuple, payload: torch.Tensor) -> None:
        """Write the block now (in the calling thread), then evict past capacity. A block
        already stored under the same identity is only touched, not rewritten."""
        if tuple(payload.shape) != self.block_shape or payload.dtype != self.dtype:
            raise ValueError(f"payload {tuple(payload.shape)} {payload.dtype} is not this "
                             f"tier's {self.block_shape} {self.dtype}")
        path = self._file(block_hash)
        ident = self._encoder.encode(identity)
        if self._holds(path, ident):
            try:
                os.utime(path)
                return
            except FileNotFoundError:
                pass  # evicted in between: write it
        data = payload.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        header = _HEADER.pack(_MAGIC, _VERSION, 0, data.nbytes, zlib.crc32(data), len(ident))
        # A temp name of its own (process, thread, random) in the same directory, so the
        # rename is atomic; mode 0o666 less the umask, as any file (mkstemp's 0o600
        # would hide the block from engines running as other users).
        tag = f"{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(4)}"
        tmp = self.path / f".{path.stem}.{tag}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        try:
            fd = os.open(tmp, flags, 0o666)
        except FileNotFoundError:  # someone removed the directory: make it again
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, flags, 0o666)
        try:
            with os.fdopen(fd, "wb", buffering=0) as f:
                f.write(header)
                f.write(ident)
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise
        _tell(self.on_change, [(block_hash, True)])
        written = len(header) + len(ident) + data.nbytes
        with self._lock:
            self.bytes_written += written
            self._estimate += written
            self._puts_since_scan += 1
            scan = (self._estimate > self.capacity_bytes
                    or self._puts_since_scan >= self.rescan_every)
        if scan:
            self._evict()

    def _evict(self) -> None:
        """Scan the directory; delete the least recently used files until under capacity."""
        if not self._scan_lock.acquire(blocking=False):
            return  # another thread is scanning now
        try:
            files: list[tuple[int, str, int]] = []
            total = 0
            now = time.time()
            try:
                with os.scandir(self.path) as entries:
                    for entry in entries:
                        try:
                            st = entry.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue  # evicted (or renamed into place) by another process
                        if entry.name.endswith(".kv"):
                            files.append((st.st_mtime_ns, entry.name, st.st_size))
                            total += st.st_size
                        elif entry.name.endswith(".tmp") and now - st.st_mtime > _STALE_TMP_S:
                            _unlink(entry.path)  # left by a writer that died
            except FileNotFoundError:
                pass  # the directory itself is gone: nothing to evict
            evicted = 0
            if total > self.capacity_bytes:
                files.sort()
                for _, name, size in files:
                    if total <= self.capacity_bytes:
                        break
                    if _unlink(self.path / name):
                        evicted += 1
                        _tell(self.on_change, [(_hash_of(name), False)])
                    total -= size  # gone either way
            with self._lock:
                self._estimate = total
                self._puts_since_scan = 0
                self.evictions += evicted
        finally:
            self._scan_lock.release()

    @property
    def nbytes(self) -> int:
        """The directory's total as this process last estimated it."""
        return self._estimate

    # ---- background writes ----------------------------------------------------------
    def put_async(self, block_hash: int, identity: tuple, payload: torch.Tensor) -> None:
        """Queue a copy of the block for the writer thread; never blocks: when the queue
        is full (the disk is slower than the engine) the write is dropped and counted."""
        self._enqueue(block_hash, identity, _cpu_copy(payload))

    def _enqueue(self, block_hash: int, identity: tuple, payload: torch.Tensor) -> None:
        """Queue payload itself (a tensor nobody else writes)."""
        with self._lock:
            if self._closed:
                self.dropped_writes += 1
                return
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                                name=f"kv-tier-writer-{self.path.name}")
                self._writer.start()
            try:
                self._queue.put_nowait((block_hash, identity, payload))
            except queue.Full:
                self.dropped_writes += 1
                return
            self._pending += 1

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            try:
                self.put(*item)
            except Exception:  # the writer outlives any one bad write (disk full, ...)
                logger.warning("KV tier write to %s failed", self.path, exc_info=True)
                self._count(write_errors=1)
            finally:
                with self._lock:
                    self._pending -= 1
                    self._drained.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done; False if timeout passed first."""
        with self._drained:
            return self._drained.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float | None = 10.0) -> None:
        """Finish the queued writes and stop the writer; later put_async calls drop."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            writer = self._writer
        if writer is None:
            return
        try:  # after the queued writes (waits for a slot while the queue is full)
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            logger.warning("KV tier writer for %s is stuck; leaving it", self.path)
            return
        writer.join(timeout)


class TieredStore:
    """Host memory in front of disk: reads try host then disk (a disk hit is promoted to
    host), writes go to host now and to disk in the background."""

    def __init__(self, host: HostTier, disk: DiskTier | None) -> None:
        self.host = host
        self.disk = disk

    def get(self, block_hash: int, identity: tuple) -> torch.Tensor | None:
        """The payload, or None. Raises TierCorruptError from a corrupt disk file."""
        payload = self.host.get(block_hash, identity)
        if payload is None and self.disk is not None:
            payload = self.disk.get(block_hash, identity)
            if payload is not None:  # a fresh tensor: the host tier can own it as is
                self.host._put_owned(block_hash, identity, payload)
        return payload

    def put(self, block_hash: int, identity: tuple, payload: torch.Tensor) -> None:
        copy = _cpu_copy(payload)  # one copy, shared by both tiers (neither writes it)
        self.host._put_owned(block_hash, identity, copy)
        if self.disk is not None:
            self.disk._enqueue(block_hash, identity, copy)

    def contains(self, block_hash: int, identity: tuple) -> bool:
        return self.host.contains(block_hash, identity) or (
            self.disk is not None and self.disk.contains(block_hash, identity))

    def close(self) -> None:
        """Finish the disk tier's queued writes and stop its writer."""
        if self.disk is not None:
            self.disk.close()
