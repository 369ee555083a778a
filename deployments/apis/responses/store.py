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
`response_store_max` responses and `response_store_ttl_s` seconds. Outside Serve (an
in-process app, tests) LocalResponses keeps one in the process.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Callable


class ResponseStore:
    """An LRU of stored responses by id; each expires ttl_s after it was stored, and the
    oldest go first past max_items."""

    def __init__(self, max_items: int = 10_000, ttl_s: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_items < 1 or ttl_s <= 0:
            raise ValueError("response store: max_items must be >= 1 and ttl_s > 0")
        self.max_items, self.ttl_s, self._clock = max_items, ttl_s, clock
        self._items: OrderedDict[str, tuple[float, dict[str, Any]]] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._items)

    def put(self, response_id: str, record: dict[str, Any]) -> None:
        """record: {"response": the Response object, "conversation": the messages that
        led to it, its own output included (what a follow-up continues)}."""
        self._expire()
        self._items[response_id] = (self._clock() + self.ttl_s, record)
        self._items.move_to_end(response_id)
        while len(self._items) > self.max_items:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> dict[str, Any] | None:
        self._expire()
        item = self._items.get(response_id)
        return None if item is None else item[1]

    def delete(self, response_id: str) -> bool:
        self._expire()
        return self._items.pop(response_id, None) is not None

    def _expire(self) -> None:
        now = self._clock()
        while self._items:
            first = next(iter(self._items))
            if self._items[first][0] > now:
                # entries are in store order and share one ttl: the rest are younger
                return
            del self._items[first]


class LocalResponses:
    """The async interface the routes use, over a store in this process."""

    def __init__(self, max_items: int, ttl_s: float) -> None:
        self.store = ResponseStore(max_items, ttl_s)

    async def put_response(self, response_id: str, record: dict[str, Any]) -> None:
        self.store.put(response_id, record)

    async def get_response(self, response_id: str) -> dict[str, Any] | None:
        return self.store.get(response_id)

    async def delete_response(self, response_id: str) -> bool:
        return self.store.delete(response_id)
