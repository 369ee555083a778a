"""CompilePool: grammar compiles that no request can hold hostage.

xgrammar compiles cannot be interrupted, and a 1 KB JSON schema of twenty bounded
strings already takes seconds (a larger one minutes). On a fixed pool of threads two
such requests held every thread, and every later constrained request of every tenant
waited behind them. Here each compile runs on its own daemon thread, and at most
`slots` run at once; one that passes `timeout_s` is abandoned: its requests fail, its
slot is freed for the next compile, and the thread runs on unseen (its result is
dropped). Abandoned threads still cost a core each, so past `max_abandoned` of them
new compiles are refused at once with EngineOverloadedError (HTTP 429) until they end.
Requests asking for the same constraint share one compile.
"""
from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import OrderedDict
from typing import Any, Callable

from engine.errors import EngineOverloadedError, InvalidRequestError


class _Compile:
    __slots__ = ("key", "work", "future", "started", "users")

    def __init__(self, key: bytes, work: Callable[[], Any]) -> None:
        self.key = key
        self.work = work
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.started: float | None = None  # when its thread began
        self.users = 0  # requests waiting on it


class CompilePool:
    """Used from the engine's core loop only (submit, release, reap); the compile
    threads only set their own future and count themselves out."""

    def __init__(self, slots: int, timeout_s: float, max_abandoned: int) -> None:
        self.slots = slots
        self.timeout_s = timeout_s
        self.max_abandoned = max_abandoned
        self._queued: OrderedDict[bytes, _Compile] = OrderedDict()
        self._running: dict[bytes, _Compile] = {}
        self._lock = threading.Lock()
        self._abandoned = 0  # threads past their timeout that have not ended yet

    @property
    def abandoned(self) -> int:
        with self._lock:
            return self._abandoned

    def submit(self, key: bytes, work: Callable[[], Any]) -> concurrent.futures.Future:
        """A future for work()'s result; joins the compile of the same key if one is
        queued or running. Refused (a failed future) while too many abandoned compiles
        still run."""
        job = self._running.get(key) or self._queued.get(key)
        if job is None:
            if self.abandoned >= self.max_abandoned:
                refused: concurrent.futures.Future = concurrent.futures.Future()
                refused.set_exception(EngineOverloadedError(
                    f"{self.max_abandoned} structured-outputs grammars that passed their "
                    f"{self.timeout_s:g} s compile limit are still compiling; try again "
                    "later"))
                return refused
            job = self._queued[key] = _Compile(key, work)
        job.users += 1
        self._start_queued()
        return job.future

    def release(self, key: bytes) -> None:
        """A request stopped waiting on key's compile (finished, aborted, failed); a
        queued compile nobody waits on any more is dropped."""
        job = self._running.get(key) or self._queued.get(key)
        if job is None:
            return
        job.users -= 1
        if job.users <= 0 and job.key in self._queued:
            del self._queued[job.key]
            job.future.cancel()

    def reap(self) -> None:
        """Abandon running compiles past the timeout (their futures fail with
        InvalidRequestError) and start queued ones in the slots that frees."""
        now = time.monotonic()
        for key, job in list(self._running.items()):
            if job.future.done():
                del self._running[key]
            elif now - job.started > self.timeout_s:
                del self._running[key]
                with self._lock:  # counted first: its thread may end any moment now
                    self._abandoned += 1
                try:
                    job.future.set_exception(InvalidRequestError(
                        f"the structured-outputs grammar did not compile within "
                        f"{self.timeout_s:g} s (structured_outputs_compile_timeout_s)"))
                except concurrent.futures.InvalidStateError:  # it ended just now
                    with self._lock:
                        self._abandoned -= 1
        self._start_queued()

    def _start_queued(self) -> None:
        while self._queued and len(self._running) < self.slots:
            key, job = self._queued.popitem(last=False)
            job.started = time.monotonic()
            self._running[key] = job
            threading.Thread(target=self._run, args=(job,), name="grammar-compile",
                             daemon=True).start()

    def _run(self, job: _Compile) -> None:
        try:
            result = job.work()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting requests
            outcome: tuple[Any, BaseException | None] = (None, exc)
        else:
            outcome = (result, None)
        try:
            if outcome[1] is None:
                job.future.set_result(outcome[0])
            else:
                job.future.set_exception(outcome[1])
        except concurrent.futures.InvalidStateError:  # abandoned meanwhile
            with self._lock:
                self._abandoned -= 1

    def running(self) -> list[concurrent.futures.Future]:
        """Futures of the compiles now on a thread (what an idle engine waits on)."""
        return [job.future for job in self._running.values()]
