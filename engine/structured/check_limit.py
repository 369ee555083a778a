"""The frontend's grammar check under a time limit inside the request's deadline.

A frontend builds every new structured-outputs constraint once before sending the
request (engine/structured/grammar.py: check_structured_outputs), so that a bad schema
is a 400 before it reaches a scheduler. Builds take milliseconds, but nothing bounded
them: a pathological schema or regex held a prepare thread (the ingress has two,
engine/frontend/prep_offload.py) for as long as xgrammar took, and with it every request
queued behind. Here each build runs on a daemon thread of its own, and the prepare
thread waits for it at most min(CHECK_TIMEOUT_S, the time left before the request's
deadline):

- past CHECK_TIMEOUT_S: CheckTimeoutError, a 400 naming the request's constraint field;
- past the request's own deadline: RequestTimeoutError, a 408, as any request that runs
  out of time before its first token.

xgrammar cannot be interrupted, so a build that runs out of time is abandoned, not
stopped: its thread runs on unseen (its result still marks the spec checked when it
ends). At most MAX_RUNNING builds run at once, abandoned ones included; past that a
new build is refused at once (EngineOverloadedError, a 429), so runaway builds take a
bounded number of cores and never a prepare thread. A request whose spec is being
built already waits on that build instead of starting another (a client retrying a
slow schema adds no thread).

The deadline and the field's name come from the ingress (`scope`, a context variable
that PrepOffload carries onto its threads); without one (the offline LLM, tests) only
CHECK_TIMEOUT_S applies and the field is called structured_outputs.
"""
from __future__ import annotations

import concurrent.futures
import contextvars
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from engine.errors import EngineOverloadedError, InvalidRequestError, RequestTimeoutError

CHECK_TIMEOUT_S = 10.0  # an honest schema builds in milliseconds (a 50-field one: 3 ms)
MAX_RUNNING = 4  # builds on a thread at once, abandoned ones included


class CheckTimeoutError(InvalidRequestError):
    """The constraint did not build within CHECK_TIMEOUT_S; param names its field."""

    def __init__(self, message: str, param: str = "structured_outputs") -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # picklable with its field, as the other request errors
        return type(self), (str(self), self.param)


@dataclass(frozen=True)
class Scope:
    deadline: float | None  # time.monotonic() after which the request has timed out
    param: Callable[[], str]  # the request's constraint field (asked only on an error)


_scope: contextvars.ContextVar[Scope | None] = contextvars.ContextVar(
    "grammar_check_scope", default=None)


def scope(deadline: float | None, param: Callable[[], str]) -> None:
    """The current request's deadline and constraint field, for the checks it makes
    (set in the request's task; its prepare threads see it through PrepOffload)."""
    _scope.set(Scope(deadline, param))


class _Builds:
    """The builds on a thread, by spec digest."""

    def __init__(self) -> None:
        self._running: dict[bytes, concurrent.futures.Future] = {}
        self._lock = threading.Lock()

    def submit(self, digest: bytes, build: Callable[[], Any]) -> concurrent.futures.Future:
        with self._lock:
            future = self._running.get(digest)
            if future is not None:
                return future
            if len(self._running) >= MAX_RUNNING:
                raise EngineOverloadedError(
                    f"{MAX_RUNNING} structured-outputs grammars are still being checked "
                    f"(each past its {CHECK_TIMEOUT_S:g} s limit, or about to be); try "
                    "again later")
            future = self._running[digest] = concurrent.futures.Future()
        threading.Thread(target=self._run, args=(digest, build, future),
                         name="grammar-check", daemon=True).start()
        return future

    def _run(self, digest: bytes, build: Callable[[], Any],
             future: concurrent.futures.Future) -> None:
        try:
            future.set_result(build())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            future.set_exception(exc)
        finally:
            with self._lock:
                del self._running[digest]

    @property
    def running(self) -> int:
        with self._lock:
            return len(self._running)


builds = _Builds()


def run_check(digest: bytes, build: Callable[[], Any]) -> Any:
    """build()'s result, within the current scope's limit (module docstring); blocks
    the calling (prepare) thread for that long at most."""
    current = _scope.get()
    limit, by_deadline = CHECK_TIMEOUT_S, False
    if current is not None and current.deadline is not None:
        left = current.deadline - time.monotonic()
        if left <= CHECK_TIMEOUT_S:
            limit, by_deadline = left, True
    if by_deadline and limit <= 0:
        raise RequestTimeoutError("the request's timeout passed before its "
                                  "structured-outputs grammar was checked")
    future = builds.submit(digest, build)
    try:
        return future.result(timeout=limit)
    except concurrent.futures.TimeoutError:
        if by_deadline:
            raise RequestTimeoutError("the request's timeout passed while its "
                                      "structured-outputs grammar was checked") from None
        param = current.param() if current is not None else "structured_outputs"
        raise CheckTimeoutError(f"{param}: the structured-outputs grammar did not build "
                                f"within {CHECK_TIMEOUT_S:g} s; simplify the schema, "
                                "regex or grammar", param) from None
