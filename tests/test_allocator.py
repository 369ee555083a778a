"""The CPU engine's allocator setting: a freed step-sized block is reused, not faulted in
again page by page (engine/executor/allocator.py). Measured in a fresh process: a
long-lived one's heap has free holes that hide glibc's default behaviour."""
import json
import platform
import subprocess
import sys

import pytest

_MEASURE = """
import ctypes, json, resource, torch
from engine.executor.allocator import keep_freed_memory

torch.set_num_threads(1)

def faults(nbytes):
    # the fewest page faults of an allocate-touch-free round, over the rounds after a
    # first (the rounds a later step would see). Tuned, glibc's heap settles within a few
    # rounds: a freed block may first be passed over for fresh heap above it (measured:
    # up to four rounds of 2,048 faults before one reuses its pages), then is reused.
    counts = []
    for _ in range(9):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = torch.empty(nbytes, dtype=torch.uint8)
        block.fill_(1)
        del block
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return min(counts[1:])

libc = ctypes.CDLL(None)
libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
# glibc's defaults, pinned (mmap and trim thresholds 128 KiB, no top pad)
assert all(libc.mallopt(p, v) == 1 for p, v in ((-3, 128 << 10), (-1, 128 << 10), (-2, 0)))
default = faults(8 << 20)
tuned = keep_freed_memory()
print(json.dumps({"default": default, "tuned": tuned, "after": faults(8 << 20)}))
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="mallopt is glibc's")
def test_a_freed_step_sized_block_is_reused_without_page_faults():
    run = subprocess.run([sys.executable, "-c", _MEASURE], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["tuned"]
    assert got["default"] > 1000  # 8 MiB = 2,048 pages of 4 KiB, mapped and unmapped
    assert got["after"] < 64  # the freed block is reused in place
