"""Stored Responses: what `store: true` keeps so that `previous_response_id`, GET and
DELETE /v1/responses/{id} work, bounded by count and by age.

Where it lives (why): in Serve, the app's Coordinator deployment holds the one
ResponseStore, and every ingress replica reaches it through its handle
(deployments/serve/ingress.py: CoordinatorResponses). A follow-up is then answered by
whichever replica the load balancer picks, with no store to run beside the app (no
Redis, no database): the coordinator is already the app's single stateful actor and
is off the token path (one call per response, ~1 ms). The cost: the store is in
memory, so a coordinator restart forgets stored responses (a follow-up naming one
gets a 404, as it would after expiry), and its size is bounded by
`response_store_max` responses, `response_store_max_bytes` bytes (a record holds the
whole conversation so far, so long agent sessions are big) and `response_store_ttl_s`
seconds. Outside Serve (an
in-process app, tests) LocalResponses keeps one in the process.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Callable

import msgspec


class ResponseStore:
    """Stored responses by id, in store order; each expires ttl_s after it was stored,
    and the oldest go first past max_items records or max_bytes of them (their JSON
    size). One record larger than max_bytes is not kept (put says so)."""

    def __init__(self, max_items: int = 10_000, ttl_s: float = 3600.0,
                 max_bytes: int = 256 << 20,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_items < 1 or ttl_s <= 0 or max_bytes < 1:
            raise ValueError("response store: max_items and max_bytes must be >= 1, "
                             "ttl_s > 0")
        self.max_items, self.ttl_s, self.max_bytes = max_items, ttl_s, max_bytes
        self._clock = clock
        self._items: OrderedDict[str, tuple[float, int, dict[str, Any]]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        self._expire()
        return len(self._items)

    def put(self, response_id: str, record: dict[str, Any]) -> bool:
        """record: {"response": the Response object, "conversation": the messages that
        led to it, its own output included (what a follow-up continues)}. False: it is
        larger than the whole store may be, and was not kept."""
        self._expire()
        self.delete(response_id)
        size = len(msgspec.json.encode(record))
        if size > self.max_bytes:
            return False
        self._items[response_id] = (self._clock() + self.ttl_s, size, record)
        self.bytes += size
        while len(self._items) > self.max_items or self.bytes > self.max_bytes:
            _, (_, dropped, _) = self._items.popitem(last=False)
            self.bytes -= dropped
        return True

    def get(self, response_id: str) -> dict[str, Any] | None:
        self._expire()
        item = self._items.get(response_id)
        return None if item is None else item[2]

    def delete(self, response_id: str) -> bool:
        self._expire()
        item = self._items.pop(response_id, None)
        if item is None:
            return False
        self.bytes -= item[1]
        return True

    def _expire(self) -> None:
        now = self._clock()
        while self._items:
            first = next(iter(self._items))
            if self._items[first][0] > now:
                # entries are in store order and share one ttl: the rest are younger
                return
            self.bytes -= self._items.pop(first)[1]


class LocalResponses:
    """The async interface the routes use, over a store in this process."""

    def __init__(self, max_items: int, ttl_s: float, max_bytes: int) -> None:
        self.store = ResponseStore(max_items, ttl_s, max_bytes)

    async def put_response(self, response_id: str, record: dict[str, Any]) -> bool:
        return self.store.put(response_id, record)

    async def get_response(self, response_id: str) -> dict[str, Any] | None:
        return self.store.get(response_id)

    async def delete_response(self, response_id: str) -> bool:
        return self.store.delete(response_id)
