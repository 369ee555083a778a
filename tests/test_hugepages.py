"""Huge pages for weights: memory mapped after a snapshot is found and collapsed."""
import ctypes
import mmap
import sys
from pathlib import Path

import pytest

from deployments.serve.heap_trim import rss_bytes
from engine.model.hugepages import anonymous_regions, collapse_new_regions

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_SIZE = 16 << 20


def _huge_bytes_in(lo: int, hi: int) -> int:
    """AnonHugePages of the mappings that overlap [lo, hi) (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start < hi and end > lo
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _THP.exists()
                    or "[never]" in _THP.read_text(), reason="needs Linux with THP not off")
def test_memory_mapped_after_the_snapshot_is_collapsed_into_huge_pages():
    before = anonymous_regions()
    # a fresh anonymous mapping, as a model's weights get when they are allocated
    # (an allocation from memory malloc already holds would not be new)
    buf = mmap.mmap(-1, _SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.write(b"\x01" * _SIZE)  # touched: 4 KiB pages unless THP is "always"
        view = ctypes.c_char.from_buffer(buf)
        lo = ctypes.addressof(view)
        assert any(start <= lo < end for start, end in anonymous_regions() - before)
        if "[madvise]" in _THP.read_text():
            assert _huge_bytes_in(lo, lo + _SIZE) == 0
        assert collapse_new_regions(before) >= 8 << 20
        assert _huge_bytes_in(lo, lo + _SIZE) >= 8 << 20
        assert buf[:] == b"\x01" * _SIZE  # contents unchanged
        del view
    finally:
        buf.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_lazily_zeroed_tensor_is_zero_aligned_and_resident_only_where_written():
    import torch

    from engine.model.hugepages import lazily_zeroed
    size = 256 << 20
    before = rss_bytes()
    t = lazily_zeroed((64, size // 64 // 4), torch.float32)
    assert t.shape == (64, size // 256) and t.dtype == torch.float32
    assert t.data_ptr() % (2 << 20) == 0  # every page of it can be a huge page
    assert rss_bytes() - before < 64 << 20  # nothing zeroed up front
    t[3, 5] = 7.0
    assert float(t[3].sum()) == 7.0 and float(t[:3].abs().sum()) == 0.0
    assert rss_bytes() - before < 128 << 20  # the rows read are zero pages, not copies


def _resident(t) -> list[bool]:
    """mincore(2) over the pages of a contiguous CPU tensor: which are in memory."""
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    vec = (ctypes.c_ubyte * (-(-length // page)))()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0
    return [bool(b & 1) for b in vec]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore(2) on Linux")
def test_cpu_engine_backs_the_kv_blocks_a_full_batch_holds_and_no_more(tiny_llama):
    from engine.config import EngineConfig
    from engine.core.engine_core import EngineCore
    core = EngineCore(EngineConfig(model=str(tiny_llama), dtype="float32", max_num_seqs=2,
                                   max_model_len=64))
    try:
        cache = core.runner.kv_caches
        full_batch = 2 * 64 // core.block_size
        assert core.num_blocks > full_batch + 2048  # the pool is far larger than a batch
        for layer in cache:  # a decode step never takes a first-touch fault in these
            assert all(_resident(layer[:full_batch]))
        # beyond them (past the 2 MiB page the last of them shares) nothing was written
        assert not any(_resident(cache[0, full_batch + 1024:full_batch + 2048]))
        # the start's warm-up request wrote a few of them and gave them back
        assert core.kv.num_free_blocks == core.kv.usable_blocks
    finally:
        core.shutdown()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore(2) on Linux")
def test_populate_now_backs_pages_and_keeps_what_was_written():
    import torch

    from engine.model.hugepages import lazily_zeroed, populate_now
    t = lazily_zeroed((8, 64 << 20), torch.uint8)  # 512 MiB, nothing resident
    assert not any(_resident(t[2]))
    t[1, :4096] = 7  # written before: kept
    populate_now([t[1:7]], "test pages")
    assert all(_resident(t[1:7])) and not any(_resident(t[7, 4 << 20:]))
    assert int(t[1, :4096].min()) == 7
    assert int(t[1, 4096:].max()) == 0 and int(t[2:7].max()) == 0


def test_populate_now_zeroes_in_place_where_the_kernel_cannot(monkeypatch):
    import torch

    from engine.model import hugepages
    monkeypatch.setattr(hugepages, "populate", lambda tensor: False)
    t = torch.full((4, 1024), 5.0)
    hugepages.populate_now([t[1:3]], "test pages")
    assert float(t[1:3].abs().sum()) == 0.0 and float(t[0].min()) == float(t[3].min()) == 5.0

