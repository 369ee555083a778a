"""IdleHeapTrim: an ingress replica hands its free heap back to the OS once per burst,
after it has gone idle, never while a request is in flight."""
import os
import platform
import subprocess
import sys
import threading

import pytest

from deployments.serve.heap_trim import IdleHeapTrim, malloc_trim, rss_bytes


class CountingTrim:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, pad: int) -> int:
        self.calls += 1
        return 1


def test_trims_once_idle_s_after_a_burst_and_never_while_busy():
    trim = CountingTrim()
    heap = IdleHeapTrim(idle_s=2.0, trim=trim)
    assert not heap.poll(0, 0, now=0.0) and not heap.poll(0, 0, now=10.0)  # nothing served
    assert not heap.poll(3, 3, now=11.0) and not heap.poll(5, 9, now=20.0)  # busy
    assert not heap.poll(0, 9, now=20.5)  # idle from here
    assert not heap.poll(0, 9, now=22.0)  # not idle for idle_s yet
    assert heap.poll(0, 9, now=22.6) and trim.calls == 1
    assert not heap.poll(0, 9, now=30.0) and not heap.poll(0, 9, now=99.0)  # once per burst
    assert trim.calls == 1 and heap.trims == 1


def test_requests_that_came_and_went_between_polls_count_as_a_burst():
    trim = CountingTrim()
    heap = IdleHeapTrim(idle_s=2.0, trim=trim)
    heap.poll(0, 0, now=0.0)
    assert not heap.poll(0, 4, now=0.5)  # four requests served between the polls
    assert not heap.poll(0, 4, now=1.0)
    assert not heap.poll(0, 5, now=2.9)  # one more: the idle clock starts again
    assert not heap.poll(0, 5, now=3.0)
    assert heap.poll(0, 5, now=5.0) and trim.calls == 1


def test_a_request_arriving_before_idle_s_puts_the_trim_off():
    trim = CountingTrim()
    heap = IdleHeapTrim(idle_s=2.0, trim=trim)
    heap.poll(1, 1, now=0.0)
    heap.poll(0, 1, now=1.0)
    assert not heap.poll(1, 2, now=2.5) and not heap.poll(0, 2, now=3.5)
    assert not heap.poll(0, 2, now=5.0) and heap.poll(0, 2, now=5.6)
    assert trim.calls == 1


def test_malloc_trim_hands_freed_heap_back_on_glibc():
    """Freed chunks below a live one stay in glibc's heap (free() trims only its top);
    malloc_trim(0) returns their pages. Done in a fresh thread, which gets a heap arena
    of its own, so the rest of the process does not blur the figures."""
    trim = malloc_trim()
    if platform.libc_ver()[0] != "glibc":
        assert trim is None or callable(trim)
        return
    assert trim is not None
    figures = {}

    def fragment_then_trim() -> None:
        chunks = [bytearray(4096) for _ in range(40_000)]  # ~160 MiB, below mmap's threshold
        for c in chunks:
            c[::512] = b"x" * 8  # touch every page
        kept = chunks[::64]  # live chunks spread over the heap pin it below them
        del chunks
        figures["freed"] = rss_bytes()
        trim(0)
        figures["trimmed"] = rss_bytes()
        del kept

    t = threading.Thread(target=fragment_then_trim)
    t.start()
    t.join()
    assert figures["freed"] - figures["trimmed"] > 100 << 20, figures


_MMAP_PROBE = r'''
import ctypes
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.free(libc.malloc(8 << 20))  # a mapped chunk freed: glibc raises its threshold past it
before = libc.mallinfo2().hblks
chunks = [libc.malloc(256 << 10) for _ in range(8)]
print(libc.mallinfo2().hblks - before)
for c in chunks:
    libc.free(c)
'''


def _mapped_chunks(env: dict[str, str]) -> int:
    """How many of eight 256 KiB chunks glibc mapped on their own (rather than carving
    them from the heap), in a fresh interpreter started with `env`."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", _MMAP_PROBE], env={**clean, **env},
                         capture_output=True, text=True, check=True)
    return int(out.stdout)


def test_the_ingress_allocator_env_keeps_big_buffers_out_of_the_heap():
    """Without a fixed threshold glibc raises its mmap threshold after freeing a big
    mapped chunk, and later buffers of that size come from the heap, where a burst's
    leftovers pin them (heap_trim's docstring); ALLOCATOR_ENV's fixed threshold maps them
    on their own, so freeing them gives their pages back at once."""
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("MALLOC_MMAP_THRESHOLD_ is glibc's")
    from deployments.serve.heap_trim import ALLOCATOR_ENV
    assert _mapped_chunks({}) == 0  # the raised threshold: all eight from the heap
    assert _mapped_chunks(dict(ALLOCATOR_ENV)) == 8
