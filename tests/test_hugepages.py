"""Huge pages for weights: memory mapped after a snapshot is found and collapsed."""
import sys
from pathlib import Path

import pytest
import torch

from engine.hugepages import anonymous_regions, collapse_new_regions

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_bytes_in(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mappings that overlap tensor's memory (/proc/self/smaps)."""
    lo, hi = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
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
    weights = torch.ones(16 << 20, dtype=torch.uint8)  # 16 MiB, its own mapping, 4 KiB pages
    assert anonymous_regions() - before, "the new mapping should be visible"
    if "[madvise]" in _THP.read_text():  # not advised: 4 KiB pages until collapsed
        assert _huge_bytes_in(weights) == 0
    collapsed = collapse_new_regions(before)
    assert collapsed >= 8 << 20
    assert _huge_bytes_in(weights) >= 8 << 20
    assert int(weights.sum()) == 16 << 20  # contents unchanged
