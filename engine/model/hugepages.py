"""Transparent huge pages for the engine's large CPU memory (KV cache and weights).

Decode streams every weight and much of the KV cache through the CPU once per step;
with 4 KiB pages nearly every page of that is a TLB miss. Linux backs memory with
2 MiB pages where asked: madvise(MADV_HUGEPAGE) before memory is first touched (the
KV cache, which we allocate), or MADV_COLLAPSE (Linux 6.1+) on memory already
written (the weights, which torch and oneDNN allocate out of our sight). Measured on
this project's 2-core VM: decode attention over a 2 GiB pool 10-25% faster; the 30
layers' 64-row matmuls with cold weights 38.5 -> 36.9 ms (docs/benchmarks.md). Best
effort: nothing happens where THP is off or the calls are unavailable.
"""
from __future__ import annotations

import atexit
import ctypes
import logging
import math
import mmap
import os
import sys
import threading
import time
import weakref

import torch

logger = logging.getLogger(__name__)

_HUGE = 1 << 21
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_PAGE = mmap.PAGESIZE


def _madvise(start: int, length: int, advice: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), advice) == 0
    except (OSError, AttributeError):
        return False


def _huge_span(start: int, end: int) -> tuple[int, int]:
    """The 2 MiB-aligned part of [start, end): (aligned start, length), length maybe 0."""
    first = (start + _HUGE - 1) & ~(_HUGE - 1)
    return first, max(0, (end & ~(_HUGE - 1)) - first)


def advise_huge_pages(tensor: torch.Tensor) -> None:
    """Ask for 2 MiB pages under a large CPU tensor before it is first touched."""
    size = tensor.numel() * tensor.element_size()
    if size < 4 * _HUGE or not sys.platform.startswith("linux"):
        return
    start, length = _huge_span(tensor.data_ptr(), tensor.data_ptr() + size)
    _madvise(start, length, _MADV_HUGEPAGE)


def lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor on a fresh anonymous mapping, on 2 MiB pages where asked.

    The kernel hands out zero pages as they are first written, so a KV pool costs
    neither a pass of memset nor resident memory until its blocks are used: zeroing a
    2 GiB pool up front (with huge-page compaction) took minutes of system time when
    several engines started at once on a busy 2-core machine. The model runner then
    writes only the blocks a full batch can hold (ModelRunner._prefault_kv)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # holds the mapping while it lives
    offset = -raw.data_ptr() % _HUGE  # 2 MiB-aligned, so every page can be huge
    tensor = raw[offset:offset + nbytes].view(dtype).view(shape)
    advise_huge_pages(tensor)
    return tensor


def populate(tensor: torch.Tensor) -> bool:
    """Back a contiguous CPU tensor's pages with memory now, its contents untouched
    (MADV_POPULATE_WRITE): the kernel takes the first-write faults in one call, and a
    page already written is left as it is, so other threads may be using the tensor.
    (Not faster than writing zeros: on the Zen 4 VM both took 0.15-2.4 s for 2 GiB, the
    host backing the guest's pages being most of it.) False where the kernel cannot
    (before 5.14, not Linux): the caller writes the pages itself."""
    if not sys.platform.startswith("linux"):
        return False
    start = tensor.data_ptr() & ~(_PAGE - 1)
    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    return _madvise(start, end - start, _MADV_POPULATE_WRITE)


def _spans_to_back(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors' bytes, as spans for populate(); none where the kernel cannot
    populate (a trial on the first page), the tensors then zeroed in place."""
    spans = [t.view(torch.uint8).view(-1) for t in tensors if t.numel()]
    if spans and not populate(spans[0][:_PAGE]):
        for span in spans:
            span.zero_()
        return []
    return spans


def populate_now(tensors: list[torch.Tensor], what: str) -> None:
    """Back the tensors' pages before anything uses them, their contents kept (zeroed in
    place where the kernel cannot populate), as vLLM's torch.zeros writes its pool at
    start. The engine reports ready after this: populated on a thread beside the first
    requests instead (sessions 38-40), the first single-sequence decode ran at 0.58-0.89
    and the first W1 at 0.88-0.91 of the second (Zen 4 held to AVX2, session 41; in a VM
    the host backing a page stalls the vCPU whatever the guest thread's priority), and
    at 0.93-1.13 populated first, for 3-4 s more of start."""
    if not any(t.numel() for t in tensors):
        return
    started = time.perf_counter()
    for span in _spans_to_back(tensors):
        populate(span)
    logger.info("%s backed in %.2fs", what, time.perf_counter() - started)


class BackgroundPopulate:
    """Back tensors' pages on a thread at SCHED_IDLE, so a start does not wait for them:
    for an engine joining a server that already serves (a replacement for a dead one, a
    scale-out), where the live engines carry the load and every second before this one
    serves counts more than its first steps' page faults. Populated before ready, a
    replacement's 2 GiB pool took 4.9 s and 10.9 s of two starts beside an engine
    serving c=128 (and a test run) on the same 2 cores (Zen 4, bench/recovery.py); a
    step writes the blocks it needs itself meanwhile, and the thread gets only the CPU
    time nobody else wants.

    Safe while the tensors are in use: MADV_POPULATE_WRITE leaves written pages as they
    are, and the madvise call (ctypes) runs without the GIL. Where the kernel cannot
    populate, the tensors are zeroed here, before anything uses them."""

    _CHUNK = 64 << 20

    def __init__(self, tensors: list[torch.Tensor], what: str):
        self._spans = _spans_to_back(tensors)
        self._what, self._stop = what, threading.Event()
        self.thread: threading.Thread | None = None
        if self._spans:
            self.thread = threading.Thread(target=self._run, name="kv-populate", daemon=True)
            _LIVE.add(self)
            self.thread.start()

    def _run(self) -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread only
        except (AttributeError, OSError):
            pass
        started = time.perf_counter()
        for span in self._spans:
            for at in range(0, span.numel(), self._CHUNK):
                if self._stop.is_set():
                    return
                populate(span[at:at + self._CHUNK])
        logger.info("%s backed in %.2fs (in the background)", self._what,
                    time.perf_counter() - started)

    def wait(self, timeout: float | None = None) -> bool:
        """True once every page is backed (or the run was stopped)."""
        if self.thread is not None:
            self.thread.join(timeout)
        return self.thread is None or not self.thread.is_alive()

    def stop(self) -> None:
        """Stop between chunks (the tensors are going away) and wait for the thread."""
        self._stop.set()
        self.wait()


_LIVE: "weakref.WeakSet[BackgroundPopulate]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """A daemon thread still inside madvise when the interpreter finalizes aborts the
    process (std::terminate), so exit stops them first (between 64 MiB chunks)."""
    for populator in list(_LIVE):
        populator.stop()


def anonymous_regions() -> set[tuple[int, int]]:
    """The process's writable anonymous mappings (heap included) as (start, end)."""
    if not sys.platform.startswith("linux"):
        return set()
    regions = set()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                if "w" in fields[1] and (len(fields) == 5 or fields[5] == "[heap]"):
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    regions.add((start, end))
    except OSError:
        pass
    return regions


def collapse_new_regions(before: set[tuple[int, int]]) -> int:
    """Collapse into huge pages the anonymous memory mapped (or grown) since `before` was
    taken: where a model's weights went. Returns the bytes collapsed."""
    start_time, done = time.perf_counter(), 0
    for region in anonymous_regions() - before:
        start, length = _huge_span(*region)
        if length and _madvise(start, length, _MADV_COLLAPSE):
            done += length
    if done:
        logger.info("weights on huge pages: %d MiB in %.2fs", done >> 20,
                    time.perf_counter() - start_time)
    return done
