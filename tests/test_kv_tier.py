"""The shared KV tier's storage (engine/kv_transfer/tier.py): host LRU, disk files
shared between engines, corruption checks, capacity, background writes."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from engine.errors import FlotillaError
from engine.kv_transfer import tier as tier_mod
from engine.kv_transfer.tier import DiskTier, HostTier, TierCorruptError, TieredStore

SHAPE = (2, 2, 1, 4, 8)  # layers, k/v, kv heads, block size, head dim
LORA = ("lora", 3, "/adapters/a")


def block(seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(dtype)


def ident(i: int) -> tuple:
    return tuple(range(i * 4, i * 4 + 4))


def nbytes(dtype: torch.dtype = torch.bfloat16) -> int:
    return block(0, dtype).nbytes


def disk(path, fingerprint: str = "fp", capacity: int = 1 << 20,
         dtype: torch.dtype = torch.bfloat16, **kw) -> DiskTier:
    return DiskTier(path, fingerprint, capacity, SHAPE, dtype, **kw)


# ---- HostTier -------------------------------------------------------------------------
def test_host_lru_order_and_byte_bound():
    host = HostTier(3 * nbytes())
    for i in range(3):
        host.put(i, ident(i), block(i))
    assert len(host) == 3 and host.nbytes == 3 * nbytes()
    assert host.get(0, ident(0)) is not None  # 0 is now the most recent; 1 the least
    assert host.contains(1, ident(1))  # contains does not refresh 1
    host.put(3, ident(3), block(3))
    assert not host.contains(1, ident(1))
    assert all(host.contains(i, ident(i)) for i in (0, 2, 3))
    assert host.evictions == 1 and host.nbytes == 3 * nbytes() and len(host) == 3
    host.put(2, ident(2), block(2))  # re-put refreshes 2: 0 is now the least recent
    host.put(4, ident(4), block(4))
    assert not host.contains(0, ident(0)) and host.contains(2, ident(2))
    host.clear()
    assert len(host) == 0 and host.nbytes == 0


def test_host_put_clones():
    host = HostTier(1 << 20)
    src = block(1)
    want = src.clone()
    host.put(7, ident(7), src)
    src.fill_(0)
    assert torch.equal(host.get(7, ident(7)), want)


def test_host_identity_mismatch_is_a_miss():
    host = HostTier(1 << 20)
    host.put(7, (LORA, ident(1)), block(1))
    assert host.get(7, ident(1)) is None  # same hash, base model: another block
    assert host.get(7, (("lora", 4, "/adapters/b"), ident(1))) is None
    assert not host.contains(7, ident(1))
    assert torch.equal(host.get(7, (LORA, ident(1))), block(1))


def test_host_too_big_is_not_stored():
    host = HostTier(nbytes() - 1)
    host.put(1, ident(1), block(1))
    assert len(host) == 0 and host.nbytes == 0


# ---- DiskTier -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_disk_round_trip_exact(tmp_path, dtype):
    d = disk(tmp_path, dtype=dtype)
    payload = block(5, dtype)
    h = -(2**63) + 12345  # Python hashes are signed: the name masks to 64 bits
    d.put(h, (LORA, ident(5)), payload)
    assert (tmp_path / "fp" / f"{h & (2**64 - 1):016x}.kv").exists()
    got = d.get(h, (LORA, ident(5)))
    assert got.dtype == dtype and tuple(got.shape) == SHAPE and torch.equal(got, payload)
    assert d.contains(h, (LORA, ident(5)))
    assert d.hits == 1 and d.bytes_read == payload.nbytes and d.bytes_written > payload.nbytes
    d.close()


def test_disk_identity_mismatch_and_missing(tmp_path):
    d = disk(tmp_path)
    d.put(9, (LORA, ident(1)), block(1))
    assert d.get(9, ident(1)) is None  # a collision: another block's file
    assert not d.contains(9, ident(1))
    assert d.get(10, ident(1)) is None
    assert d.misses == 2 and d.corrupt == 0


def test_two_engines_share_a_directory_fingerprints_separate(tmp_path):
    a, b = disk(tmp_path), disk(tmp_path)
    other = disk(tmp_path, fingerprint="other-model")
    a.put(1, ident(1), block(1))
    b.put(2, ident(2), block(2))
    assert torch.equal(b.get(1, ident(1)), block(1))
    assert torch.equal(a.get(2, ident(2)), block(2))
    assert other.get(1, ident(1)) is None and not other.contains(2, ident(2))


def test_fingerprint_must_be_a_file_name(tmp_path):
    for bad in ("../x", "a/b", "", ".hidden"):
        with pytest.raises(ValueError):
            disk(tmp_path, fingerprint=bad)


def test_corrupt_payload_byte(tmp_path):
    d = disk(tmp_path)
    d.put(1, ident(1), block(1))
    path = d._file(1)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x40
    path.write_bytes(bytes(raw))
    with pytest.raises(TierCorruptError) as err:
        d.get(1, ident(1))
    assert isinstance(err.value, FlotillaError)
    assert d.corrupt == 1
    assert not path.exists()  # deleted: the next put rewrites it
    assert d.get(1, ident(1)) is None


def test_truncated_file(tmp_path):
    d = disk(tmp_path)
    d.put(1, ident(1), block(1))
    d.put(2, ident(2), block(2))
    p1 = d._file(1)
    p1.write_bytes(p1.read_bytes()[:-5])
    with pytest.raises(TierCorruptError):
        d.get(1, ident(1))
    p2 = d._file(2)
    p2.write_bytes(p2.read_bytes()[:10])  # not even a whole header
    with pytest.raises(TierCorruptError):
        d.get(2, ident(2))
    assert d.corrupt == 2


def test_wrong_shape_put_refused(tmp_path):
    d = disk(tmp_path)
    with pytest.raises(ValueError):
        d.put(1, ident(1), torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        d.put(1, ident(1), block(1, torch.float32))


def test_capacity_evicts_least_recently_read(tmp_path):
    probe = disk(tmp_path / "probe")
    probe.put(0, ident(0), block(0))
    size = probe._file(0).stat().st_size  # every file here has the same size
    d = disk(tmp_path, capacity=3 * size)
    for i in range(3):
        d.put(i, ident(i), block(i))
    for i, t in enumerate((1000, 2000, 3000)):
        os.utime(d._file(i), (t, t))
    assert d.get(0, ident(0)) is not None  # touched: now the most recent
    d.put(3, ident(3), block(3))
    assert not d._file(1).exists()  # the least recently read went
    assert all(d._file(i).exists() for i in (0, 2, 3))
    assert d.evictions == 1 and d.nbytes == 3 * size


def test_capacity_counts_other_processes_files(tmp_path):
    probe = disk(tmp_path / "probe")
    probe.put(0, ident(0), block(0))
    size = probe._file(0).stat().st_size
    a = disk(tmp_path, capacity=2 * size, rescan_every=1)
    b = disk(tmp_path, capacity=2 * size, rescan_every=1)
    a.put(0, ident(0), block(0))
    os.utime(a._file(0), (1000, 1000))
    b.put(1, ident(1), block(1))
    os.utime(b._file(1), (2000, 2000))
    a.put(2, ident(2), block(2))  # a's scan sees b's file: 3 files, the oldest goes
    assert not a._file(0).exists() and a._file(1).exists() and a._file(2).exists()


def test_vanished_file_is_a_miss(tmp_path):
    a, b = disk(tmp_path), disk(tmp_path)
    a.put(1, ident(1), block(1))
    os.unlink(b._file(1))  # another process evicted it
    assert a.get(1, ident(1)) is None and not a.contains(1, ident(1))
    assert a.misses == 1 and a.corrupt == 0


def test_vanished_file_during_scan(tmp_path, monkeypatch):
    d = disk(tmp_path, capacity=1)  # every put scans and evicts
    d.put(1, ident(1), block(1))
    real_scandir = os.scandir

    class Listing:  # lists, then another process deletes a file before it is stat'ed
        def __init__(self, path):
            with real_scandir(path) as it:
                self.entries = list(it)
            for e in self.entries:
                if e.name.endswith(".kv"):
                    os.unlink(e.path)

        def __enter__(self):
            return iter(self.entries)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(tier_mod.os, "scandir", Listing)
    d.put(2, ident(2), block(2))  # no error
    monkeypatch.undo()
    assert d.get(1, ident(1)) is None and d.get(2, ident(2)) is None


def test_put_async_flush_visible_to_another_engine(tmp_path):
    a, b = disk(tmp_path), disk(tmp_path)
    src = block(4)
    a.put_async(4, ident(4), src)
    src.fill_(0)  # the queued copy is the tier's own
    assert a.flush(timeout=30)
    assert torch.equal(b.get(4, ident(4)), block(4))
    a.close()
    a.put_async(5, ident(5), block(5))  # after close: dropped, not an error
    assert a.dropped_writes == 1


def test_full_queue_drops_rather_than_blocks(tmp_path, monkeypatch):
    d = disk(tmp_path, queue_size=1)
    started, release = threading.Event(), threading.Event()
    real_put = DiskTier.put

    def slow_put(self, *args):
        started.set()
        release.wait(30)
        real_put(self, *args)

    monkeypatch.setattr(DiskTier, "put", slow_put)
    d.put_async(1, ident(1), block(1))
    assert started.wait(30)  # the writer holds write 1
    d.put_async(2, ident(2), block(2))  # queued
    d.put_async(3, ident(3), block(3))  # full: dropped at once
    d.put_async(4, ident(4), block(4))
    assert d.dropped_writes == 2
    release.set()
    assert d.flush(timeout=30)
    d.close()
    assert d.contains(1, ident(1)) and d.contains(2, ident(2))
    assert not d.contains(3, ident(3)) and not d.contains(4, ident(4))


def test_writer_survives_a_failed_write(tmp_path, monkeypatch):
    d = disk(tmp_path)
    real_put = DiskTier.put

    def failing_put(self, block_hash, *args):
        if block_hash == 1:
            raise OSError("disk full")
        real_put(self, block_hash, *args)

    monkeypatch.setattr(DiskTier, "put", failing_put)
    d.put_async(1, ident(1), block(1))
    d.put_async(2, ident(2), block(2))
    assert d.flush(timeout=30)
    d.close()
    assert d.write_errors == 1 and d.contains(2, ident(2))


# ---- TieredStore ----------------------------------------------------------------------
def test_tiered_store_promotes_disk_hits(tmp_path):
    writer = disk(tmp_path)
    writer.put(8, (LORA, ident(8)), block(8))  # written by another engine
    store = TieredStore(HostTier(1 << 20), disk(tmp_path))
    assert not store.host.contains(8, (LORA, ident(8)))
    assert store.contains(8, (LORA, ident(8)))
    assert torch.equal(store.get(8, (LORA, ident(8))), block(8))
    assert store.host.contains(8, (LORA, ident(8)))
    os.unlink(writer._file(8))
    assert torch.equal(store.get(8, (LORA, ident(8))), block(8))  # now from host
    assert store.get(8, ident(8)) is None  # base model: not the adapter's KV
    store.close()


def test_tiered_store_put_writes_both(tmp_path):
    store = TieredStore(HostTier(1 << 20), disk(tmp_path))
    src = block(6)
    store.put(6, ident(6), src)
    src.fill_(0)
    assert torch.equal(store.host.get(6, ident(6)), block(6))
    assert store.disk.flush(timeout=30)
    assert torch.equal(disk(tmp_path).get(6, ident(6)), block(6))
    store.close()
    host_only = TieredStore(HostTier(1 << 20), None)
    host_only.put(1, ident(1), block(1))
    assert host_only.contains(1, ident(1)) and host_only.get(2, ident(2)) is None
    host_only.close()


def test_thread_safety_smoke(tmp_path):
    size = nbytes()
    store = TieredStore(HostTier(8 * size), disk(tmp_path, capacity=1 << 30, queue_size=8))
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(40):
                key = (t * 7 + i) % 24
                if i % 2:
                    store.put(key, ident(key), block(key))
                else:
                    got = store.get(key, ident(key))
                    assert got is None or torch.equal(got, block(key))
                assert store.host.nbytes <= 8 * size
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    assert store.disk.flush(timeout=30)
    store.close()
    assert len(store.host) <= 8 and store.host.nbytes <= 8 * size
    d = disk(tmp_path)
    for key in range(24):
        got = d.get(key, ident(key))
        assert got is None or torch.equal(got, block(key))


def test_a_pinned_host_block_outlives_the_bound_until_unpinned():
    """A block a load was decided on stays until the load read it, even while newer
    blocks push the tier past its bound; then it goes first."""
    import torch as _torch
    from engine.kv_transfer.tier import HostTier
    one = _torch.zeros(4, dtype=_torch.float32)
    tier = HostTier(capacity_bytes=2 * one.nbytes)
    tier.put(1, (1,), one)
    tier.pin(1)
    for h in (2, 3, 4):
        tier.put(h, (h,), one)
    assert tier.contains(1, (1,)) and tier.contains(4, (4,)) and not tier.contains(2, (2,))
    tier.unpin(1)
    tier.put(5, (5,), one)
    assert not tier.contains(1, (1,)) and len(tier) == 2
