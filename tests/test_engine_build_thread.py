"""The engine replica builds its engine on a thread of its own that exits afterwards
(deployments.serve.engine_server.build_on_own_thread): the build's OpenMP pool must not outlive
it, so that the engine-core thread's pool is the only one (two pools on the engine's CPUs
made libgomp stop spinning, which cost a quarter of the engine's time under load)."""
from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import torch

from deployments.serve.engine_server import build_on_own_thread


def _threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def test_returns_what_the_factory_built_from_another_thread_that_is_gone():
    seen = {}

    def factory():
        seen["thread"] = threading.current_thread()
        return 42

    assert asyncio.run(build_on_own_thread(factory)) == 42
    assert seen["thread"] is not threading.main_thread()
    assert not seen["thread"].is_alive()


def test_the_factorys_error_reaches_the_caller():
    def factory():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        asyncio.run(build_on_own_thread(factory))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or os.cpu_count() < 2,
                    reason="counts threads through /proc with a multi-threaded OpenMP pool")
def test_the_builds_openmp_pool_goes_with_its_thread():
    torch.set_num_threads(2)
    x = torch.randn(512, 512)
    before = _threads()

    def factory():
        for _ in range(3):
            torch.mm(x, x)  # a parallel region: this thread gets an OpenMP pool
        return _threads()

    new = asyncio.run(build_on_own_thread(factory)) - before
    assert len(new) >= 2  # the build thread and its pool's worker
    deadline = time.monotonic() + 5
    while new & _threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not new & _threads()  # every thread the build started is gone
