"""The CPU engine's allocator setting: a freed step-sized block is reused, not faulted in
again page by page (engine/executor/allocator.py)."""
import ctypes
import platform
import resource

import pytest
import torch

from engine.executor.allocator import keep_freed_memory


def _glibc() -> bool:
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _faults_of_a_fresh_block(nbytes: int) -> int:
    """Page faults taken by allocating, touching and freeing nbytes, after one warm-up."""
    for _ in range(2):  # the second round is the one a later step would see
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = torch.empty(nbytes, dtype=torch.uint8)
        block.fill_(1)
        del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(not _glibc(), reason="mallopt is glibc's")
def test_a_freed_step_sized_block_is_reused_without_page_faults():
    nbytes = 8 << 20  # 2,048 pages of 4 KiB
    libc = ctypes.CDLL(None)
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    # glibc's defaults (mmap and trim thresholds 128 KiB, no top pad): the block is
    # mapped and unmapped, so every round faults its pages in again
    for param, value in ((-3, 128 << 10), (-1, 128 << 10), (-2, 0)):
        assert libc.mallopt(param, value) == 1
    try:
        assert _faults_of_a_fresh_block(nbytes) > 1000
    finally:
        assert keep_freed_memory()
    assert _faults_of_a_fresh_block(nbytes) < 64
