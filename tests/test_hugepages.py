"""Huge pages for weights: memory mapped after a snapshot is found and collapsed."""
import ctypes
import mmap
import sys
from pathlib import Path

import pytest

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
