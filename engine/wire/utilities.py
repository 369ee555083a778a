"""Utility calls: one method run on every live engine, and what the client makes of
the answers (LoRA load and unload, stats, sleep state, prefix-cache reset).

Apart from the requests' streams because a utility call is about the engines, not a
request: it fans out to each live engine, waits for every answer by call id, and names
the engines that failed; the aggregation rules are engine/wire/utility_results.py's.
An engine declared dead fails the calls waiting on it (fail_all).
"""
from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any, Awaitable, Callable

import msgspec

from engine.core_messages import SchedulerStats, UtilityOutput, UtilityRequest
from engine.errors import NoEnginesError, UtilityCallError
from engine.lora.request import LoRARequest
from engine.wire.engine_set import EngineSet
from engine.wire.protocol import UTILITY
from engine.wire.utility_results import all_true, consensus


class UtilityCalls:
    """The utility calls in flight, by call id, over the engines of `members`."""

    def __init__(self, members: EngineSet) -> None:
        self._members = members
        self._waiters: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._encoder = msgspec.msgpack.Encoder()

    def resolve(self, out: UtilityOutput) -> None:
        """An engine's answer (the output reader hands it over)."""
        fut = self._waiters.get(out.call_id)
        if fut is None or fut.done():
            return
        if out.failure_message is not None:
            fut.set_exception(UtilityCallError(out.failure_message))
        else:
            fut.set_result(out.result)

    def fail_all(self, error: BaseException) -> None:
        """An engine died: every waiting call fails with its error."""
        for call_id, fut in list(self._waiters.items()):
            if not fut.done():
                fut.set_exception(error)

    async def call(self, method: str, *args: Any, timeout: float = 60.0,
                   **kwargs: Any) -> list[Any]:
        """Call `method` on every live engine; results in engine order."""
        engines = [e for e in self._members.engines if not e.dead]
        if not engines:
            raise self._members.dead_error or NoEnginesError(f"no engine to call {method}")
        loop = asyncio.get_running_loop()
        calls = []
        for e in engines:
            call_id = next(self._call_ids)
            fut = loop.create_future()
            self._waiters[call_id] = fut
            calls.append((e, call_id, fut))
            msg = UtilityRequest(call_id, method, list(args), dict(kwargs))
            await e.socket.send_multipart([UTILITY, self._encoder.encode(msg)])
        try:
            done = await asyncio.wait_for(asyncio.gather(*(f for _, _, f in calls),
                                                         return_exceptions=True), timeout)
        finally:
            for _, call_id, _ in calls:
                self._waiters.pop(call_id, None)
        failures = [f"engine {e.index}: {r}" for (e, _, _), r in zip(calls, done)
                    if isinstance(r, BaseException)]
        if failures:
            raise UtilityCallError(f"{method} failed on " + "; ".join(failures))
        return list(done)


# The aggregations below take the client's own call (EngineClient.call_utility), looked up
# when they run, so a caller that wraps that method (a test counting calls) sees them all.
UtilityCall = Callable[..., Awaitable[list[Any]]]


# ---- LoRA fan-out -----------------------------------------------------------------------
async def add_lora(call: UtilityCall, lora_request: LoRARequest) -> None:
    """Load an adapter on every engine; UtilityCallError names the engines that
    failed (those that succeeded keep it, so a retry after a fix is harmless)."""
    await call("add_lora", lora_request)


async def remove_lora(members: EngineSet, call: UtilityCall, lora_id: int) -> bool:
    """Unload an adapter everywhere; False if no engine had it."""
    for e in members.engines:
        e.adapters.discard(lora_id)
    return any(await call("remove_lora", lora_id))


async def list_loras(call: UtilityCall) -> list[LoRARequest]:
    """The adapters loaded by name on every live engine (one that some engine
    lacks, after a partly failed load, is not listed, so loading it again is
    allowed and fills the gap)."""
    found = [{msgspec.convert(r, LoRARequest) for r in rs}
             for rs in await call("list_loras")]
    common = set.intersection(*found) if found else set()
    return sorted(common, key=lambda r: r.lora_int_id)


# ---- stats and state --------------------------------------------------------------------
async def get_stats(members: EngineSet, call: UtilityCall) -> list[SchedulerStats]:
    """Every live engine's scheduler stats, fresh (not the last ones seen with
    outputs); kept as each engine's `stats` too."""
    engines = [e for e in members.engines if not e.dead]
    stats = [msgspec.convert(v, SchedulerStats) for v in await call("get_stats")]
    now = time.monotonic()
    for e, s in zip(engines, stats):
        e.stats, e.stats_at = s, now
    return stats


def stats_are_fresh(members: EngineSet, max_age_s: float) -> bool:
    """Whether every live engine's `stats` are at most `max_age_s` old (outputs and
    heartbeats bring stats at least every heartbeat interval, so a scrape rarely has
    to wait on a busy engine's loop)."""
    now = time.monotonic()
    return all(now - e.stats_at <= max_age_s for e in members.engines if not e.dead)


async def is_sleeping(call: UtilityCall) -> bool:
    return consensus("is_sleeping", await call("is_sleeping"))


async def reset_prefix_cache(call: UtilityCall, reset_running_requests: bool,
                             reset_connector: bool) -> bool:
    return all_true("reset_prefix_cache", await call(
        "reset_prefix_cache", reset_running_requests, reset_connector))
