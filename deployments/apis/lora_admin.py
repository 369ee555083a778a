"""The ingress's view of the LoRA adapters: which `model` names are adapters.

Adapters live in the engines (lora_modules at start, /v1/load_lora_adapter at run
time). An ingress keeps the list it last fetched and fetches it again when it is old,
so every ingress replica learns of an adapter another one loaded, without a shared
store.

A request never waits long on that fetch. It goes through the coordinator in Serve, and
a coordinator that stops answering (SIGSTOP, a restart) made every request naming a
model it did not know, and GET /v1/models, hang with it: the fetch ran under a lock
before the request's deadline existed, and a name not in the list was fetched for
again on every request. Now one fetch runs at a time, in the background; a request
waits for it at most WAIT_S, then answers from the last list. A name absent from a list
younger than MISS_AGE_S is a 404 at once (misses are cached that long, so a flood of
unknown names costs the coordinator one call a second).
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from deployments.apis.errors import HTTPError
from engine.lora.request import LoRARequest, adapter_id

logger = logging.getLogger(__name__)
MAX_AGE_S = 5.0  # a known adapter is checked again after this long (unloaded elsewhere?)
MISS_AGE_S = 1.0  # a name absent from a list this recent is unknown, without asking
WAIT_S = 1.0  # the longest a request waits for a fetch (the list answers in milliseconds)


class AdapterDirectory:
    def __init__(self, control, max_age_s: float = MAX_AGE_S, miss_age_s: float = MISS_AGE_S,
                 wait_s: float = WAIT_S) -> None:
        """control: what reaches the engines (list_loras / add_lora / remove_lora)."""
        self.control = control
        self.max_age_s, self.miss_age_s, self.wait_s = max_age_s, miss_age_s, wait_s
        self._by_name: dict[str, LoRARequest] = {}
        self._fetched = -math.inf  # when the list was last fetched
        self._fetch: asyncio.Task | None = None  # the fetch running, if any
        self._fetch_began = -math.inf
        self.failure: str | None = None  # why the last fetch failed, until one succeeds

    async def resolve(self, name: str) -> LoRARequest | None:
        """The adapter called `name`, or None if the last list holds none by that name.
        A list older than max_age_s (miss_age_s for a name it lacks) is fetched again
        first, waiting for it at most wait_s."""
        found = self._by_name.get(name)
        if time.monotonic() - self._fetched > (self.max_age_s if found else self.miss_age_s):
            await self._fresh()
            found = self._by_name.get(name)
        return found

    async def listing(self) -> list[LoRARequest]:
        """Every adapter (GET /v1/models), from a list at most miss_age_s old when the
        fetch answers within wait_s, else from the last one."""
        if time.monotonic() - self._fetched > self.miss_age_s:
            await self._fresh()
        return list(self._by_name.values())

    def refresh_soon(self) -> None:
        """Start a fetch in the background (an ingress replica's first list, fetched
        before a request needs it)."""
        self._start()

    def seed(self, adapters: list[LoRARequest], fetched_at: float) -> None:
        """The list as fetched (at time.monotonic() `fetched_at`) before this directory
        existed: an ingress replica asks for it while starting, so it never serves
        without one."""
        self._take(adapters, fetched_at)

    def details(self) -> dict[str, Any]:
        """For /health: how many adapters are known, and how old the list is."""
        age = time.monotonic() - self._fetched
        out: dict[str, Any] = {"count": len(self._by_name),
                               "age_s": round(age, 1) if math.isfinite(age) else None}
        if self.failure:
            out["error"] = self.failure
        return out

    def _start(self) -> asyncio.Task:
        """The fetch running, or a new one (one at a time: a silent coordinator gets one
        call from this replica, not one per request)."""
        task = self._fetch
        if task is None or task.done():
            task = self._fetch = asyncio.ensure_future(self._run_fetch())
            self._fetch_began = time.monotonic()
        return task

    async def _fresh(self) -> None:
        """Wait for the fetch at most wait_s from when it began; then answer from the list
        there is. With no list yet, that is a 503: a 404 for an adapter that exists is
        wrong, and 'retry' is right."""
        task = self._start()
        left = self._fetch_began + self.wait_s - time.monotonic()
        if left > 0:
            await asyncio.wait({task}, timeout=left)
        if not math.isfinite(self._fetched):
            raise HTTPError(503, "the LoRA adapter list is not available yet "
                            f"({self.failure or 'fetching'}); retry", "ServiceUnavailableError")

    async def _run_fetch(self) -> None:
        try:
            adapters = await self.control.list_loras()
        except Exception as exc:  # noqa: BLE001 - requests answer from the last list
            self.failure = str(exc) or type(exc).__name__
            logger.warning("LoRA adapter list not fetched: %s", self.failure)
            return
        self._take(adapters)

    def _take(self, adapters: list[LoRARequest], fetched_at: float | None = None) -> None:
        self._by_name = {a.lora_name: a for a in adapters}
        self._fetched = time.monotonic() if fetched_at is None else fetched_at
        self.failure = None

    async def load(self, name: str, path: str) -> LoRARequest:
        """Load an adapter on every engine; raises ValueError if the name is taken."""
        if await self.resolve(name) is not None:  # on every engine already
            raise ValueError(f"the LoRA adapter {name!r} has already been loaded")
        lora = LoRARequest(name, adapter_id(name), path)
        await self.control.add_lora(lora)
        self._by_name[name] = lora
        return lora

    async def unload(self, name: str) -> bool:
        """Unload by name everywhere (requests running with it finish); False if unknown."""
        lora = await self.resolve(name)
        if lora is None:
            return False
        await self.control.remove_lora(lora.lora_int_id)
        self._by_name.pop(name, None)
        return True
