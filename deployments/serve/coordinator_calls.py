"""Every call to the coordinator, bounded; and what an ingress replica last heard from it.

The coordinator is one Serve replica. Serve restarts it, a node drain moves it, and a
stopped process (SIGSTOP, a frozen VM) answers nothing while its node still accepts
connections for it. A call with no deadline then hangs whoever made it: an engine
replica's start, an ingress's membership poll and, through the adapter list, requests
naming a model (issue 62: with the coordinator stopped, GET /v1/models hung). So every
call goes through `ask`, which gives up after its timeout with CoordinatorTimeoutError,
and an ingress replica keeps what the coordinator last told it (CoordinatorView): it
serves from that membership while the coordinator is silent, and /health says so.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable

from engine.errors import NoEnginesError

# routine calls (membership, heartbeat, register, the response store): the coordinator
# answers them from memory in milliseconds, so this long means it is not answering
COORDINATOR_CALL_TIMEOUT_S = 10.0
# assign_rank may probe the engines of every taken rank (2 s at most, concurrently) and
# waits behind other replicas' assignments: a start-up call, so generous
ASSIGN_RANK_TIMEOUT_S = 60.0
# utility calls the coordinator fans out to the engines (sleep, wake_up, add_lora):
# its engine client may handshake (30 s) and the engines have 60 s to answer
CONTROL_TIMEOUT_S = 120.0
# how long without an answer before /health reports the coordinator silent (its
# membership is polled every 0.5 s)
SILENT_AFTER_S = 3.0


class CoordinatorTimeoutError(NoEnginesError, TimeoutError):
    """The coordinator did not answer a call in time. A NoEnginesError, so the APIs serve
    it as a 503 (the engines cannot be reached through it just now), and a TimeoutError
    for the callers that already treat a timeout as "the coordinator is restarting"."""


async def ask(call: Awaitable[Any], what: str, timeout_s: float) -> Any:
    """The answer to one coordinator call (a `handle.method.remote(...)` response), or
    CoordinatorTimeoutError naming the call when none comes within timeout_s."""
    try:
        return await asyncio.wait_for(call, timeout_s)
    except asyncio.TimeoutError:
        raise CoordinatorTimeoutError(
            f"the coordinator did not answer {what} within {timeout_s:g}s") from None


class CoordinatorView:
    """What one ingress replica last heard from the coordinator: the membership (version,
    engine addresses, their keys, stopping) and when it last answered anything.

    The replica serves from this while the coordinator is silent: its requests never
    wait on the coordinator once a membership is known."""

    def __init__(self) -> None:
        self.version = -1  # no membership heard yet
        self.addresses: list[str] = []
        self.keys: dict[str, dict] = {}  # address -> its CURVE client keys
        self.stopping = False
        self.answered_at: float | None = None  # monotonic time of the last answer
        self.failure: str | None = None  # the last call's error, until one succeeds

    @property
    def known(self) -> bool:
        return self.version >= 0

    def heard(self, membership: tuple[int, list[str], dict[str, dict], bool]) -> None:
        """A membership answer: (version, addresses, keys, stopping)."""
        self.version, self.addresses, self.keys, self.stopping = membership
        self.answered()

    def answered(self) -> None:
        self.answered_at, self.failure = time.monotonic(), None

    def failed(self, exc: BaseException) -> None:
        self.failure = str(exc) or type(exc).__name__

    def silent_for(self) -> float | None:
        """Seconds since the coordinator last answered (None: it never has)."""
        return None if self.answered_at is None else time.monotonic() - self.answered_at

    def details(self) -> dict[str, Any]:
        """For /health: whether the coordinator answers, and what is served meanwhile."""
        silent = self.silent_for()
        answering = silent is not None and silent < SILENT_AFTER_S and self.failure is None
        out: dict[str, Any] = {"state": "answering" if answering else "silent",
                               "membership_version": self.version,
                               "engines": len(self.addresses)}
        if not answering:
            out["silent_for_s"] = None if silent is None else round(silent, 1)
            out["serving"] = ("the last membership and adapter list it sent" if self.known
                              else "nothing yet: no membership heard")
            if self.failure:
                out["error"] = self.failure
        return out
