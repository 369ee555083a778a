"""Hands the heap's free memory back to the OS once an ingress replica goes idle after
serving.

glibc keeps what a burst of requests allocated and freed in its arenas, one per
allocating thread (the event loop, ZMQ's I/O thread), so a replica's RSS stays at its
busiest moment and creeps up as those arenas fragment: in the soak (c=256 over mock
engines, session 20) an ingress process held ~100-130 MiB of free heap after each minute
of load, and `malloc_trim(0)` gave it back (523 -> 414 MiB). A Kubernetes memory limit
and the soak's leak check both see RSS, so the replica trims once per burst, after
`idle_s` without a request in flight: the trim never competes with a request, and RSS
at rest is what the replica really holds. Where the C library has no malloc_trim
(musl, macOS) nothing is trimmed.

The trim alone left a replica at its busiest moment's size all the same: CPython's own
small-object allocator (pymalloc) holds 1 MiB arenas that it frees only when every
block in them is free, and a few long-lived objects made during a burst (a new
keep-alive connection, a grown dict) pin the arena they landed in. Measured in the
soak's 60 s at c=256 (Intel Xeon with AMX, session 24): the live blocks stayed at
139 MB while pymalloc's arenas went 146 -> 172 with 1,494 empty 16 KiB pools stranded
in them, +5 to +7 % RSS that no trim reaches. So ingress replicas start with
`ALLOCATOR_ENV`: Python's objects come from glibc (PYTHONMALLOC=malloc), whose free
pages the trim does return, and two arenas instead of one per thread. Same soak: +0.6
to +2.9 % on the ingress replicas, and requests per second no lower.

What the trim still could not return: glibc raises its mmap threshold each time it
frees a mapped chunk (up to 32 MiB), so once start-up has freed a few big ones
(torch, the tokenizer) every buffer below that size (request and response bodies,
JSON, a burst's lists) comes from the heap. A burst then stretches the heap to its
peak, the few long-lived objects made during it land among the freed chunks, and each
pins its page: the 10-minute soak ended at +4 to +7.5 % on one replica (sessions
37-38) while the live bytes (mallinfo2's in-use, tracemalloc) grew by ~3 MB. A fixed
threshold (MALLOC_MMAP_THRESHOLD_, which also turns the raising off) keeps chunks of
64 KiB and more in mappings of their own, unmapped when freed. Four minutes at c=256
(AMD Zen 5, session 39): without it the replicas ended +1.7 / +1.2 % and one peak jumped
522 -> 605 MiB; with it +1.2 / +1.1 % after the first minute, flat for the next three,
peaks 515 / 517 MiB, and as many requests a minute.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import time
from typing import Callable

logger = logging.getLogger(__name__)
IDLE_S = 2.0
# the environment an ingress replica's process starts with (read by the interpreter and
# by glibc at start-up, so it is set through the replica's runtime_env; a value the
# operator exported already is kept)
ALLOCATOR_ENV = {"PYTHONMALLOC": "malloc", "MALLOC_ARENA_MAX": "2",
                 "MALLOC_MMAP_THRESHOLD_": str(64 << 10)}


def allocator_env() -> dict[str, str]:
    """ALLOCATOR_ENV, less what this process's environment already sets."""
    return {k: v for k, v in ALLOCATOR_ENV.items() if k not in os.environ}


@functools.cache
def malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none."""
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def rss_bytes() -> int:
    """This process's resident set (0 where /proc is absent)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


class IdleHeapTrim:
    """Polled from a replica's background loop with the requests in flight and a count
    of requests ever submitted (so a request that came and went between two polls is
    seen); trims once, `idle_s` after the replica went idle, and not again until more
    requests are served."""

    def __init__(self, idle_s: float = IDLE_S,
                 trim: Callable[[int], int] | None = None) -> None:
        self.idle_s = idle_s
        self._trim = trim if trim is not None else malloc_trim()
        self._seen = 0  # requests_submitted at the last poll
        self._served = False  # requests ran since the last trim
        self._idle_since: float | None = None
        self.trims = 0

    def poll(self, in_flight: int, submitted: int, now: float | None = None) -> bool:
        """True when this call trimmed the heap."""
        now = time.monotonic() if now is None else now
        if in_flight or submitted != self._seen:
            self._seen, self._served, self._idle_since = submitted, True, None
            if in_flight:
                return False
        if not self._served or self._trim is None:
            return False
        if self._idle_since is None:
            self._idle_since = now
            return False
        if now - self._idle_since < self.idle_s:
            return False
        debug = logger.isEnabledFor(logging.DEBUG)  # /proc read only for the log line
        before = rss_bytes() if debug else 0
        self._trim(0)
        self._served, self._idle_since = False, None
        self.trims += 1
        if debug:
            logger.debug("idle: returned %d MiB of free heap to the OS",
                         (before - rss_bytes()) >> 20)
        return True
