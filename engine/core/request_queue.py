"""The scheduler's waiting queue, in the order its policy admits requests.

fcfs: arrival order; a preempted request goes back to the front, so it resumes
before anything that arrived after it had started.
priority: lower `priority` value first, ties by arrival time, then by when the
engine received the request. A preempted request keeps its place by that key, so
it needs no special front slot.

Both keep requests the scheduler passes over this step (a grammar still compiling,
an adapter with no room) in their place through `put_back`.

Removing a request (an abort) costs no scan of the queue: fcfs keeps an insertion-
ordered dict by request id (O(1)), priority finds the request by bisecting on its key
(O(log n) plus the list's shift). Aborting a large fan-out was a linear remove per
request.
"""
from __future__ import annotations

import bisect
import itertools
from collections import OrderedDict
from collections.abc import Iterator

from engine.core.request import Request

POLICIES = ("fcfs", "priority")


class FCFSQueue:
    """First come, first served: request id -> request, in queue order."""

    def __init__(self) -> None:
        self._items: OrderedDict[str, Request] = OrderedDict()

    def add(self, request: Request) -> None:
        self._items[request.request_id] = request

    def add_preempted(self, request: Request) -> None:
        self._items[request.request_id] = request
        self._items.move_to_end(request.request_id, last=False)

    def peek(self) -> Request:
        return next(iter(self._items.values()))

    def pop(self) -> Request:
        return self._items.popitem(last=False)[1]

    def put_back(self, requests: list[Request]) -> None:
        """Requests popped this step, in the order popped, back at the front."""
        for request in reversed(requests):
            self.add_preempted(request)

    def remove(self, request: Request) -> bool:
        """Whether the request was waiting (it is not, after)."""
        if self._items.get(request.request_id) is not request:
            return False
        del self._items[request.request_id]
        return True

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items.values())


class PriorityQueue:
    """Lowest (priority, arrival time, receipt order) first; a sorted list, because the
    scheduler reads the head every step and inserts far less often."""

    def __init__(self) -> None:
        self._items: list[Request] = []
        self._receipt = itertools.count()
        self._order: dict[str, int] = {}  # request id -> receipt order (the last tie-break)

    def key(self, request: Request) -> tuple[int, float, int]:
        order = self._order.get(request.request_id)
        if order is None:
            order = self._order[request.request_id] = next(self._receipt)
        return (request.priority, request.arrival_time, order)

    def add(self, request: Request) -> None:
        bisect.insort(self._items, request, key=self.key)

    add_preempted = add  # its key already says where it belongs

    def pop(self) -> Request:
        return self._items.pop(0)

    def peek(self) -> Request:
        return self._items[0]

    def put_back(self, requests: list[Request]) -> None:
        for request in requests:
            self.add(request)

    def remove(self, request: Request) -> bool:
        """Whether the request was waiting (it is not, after): found by its key."""
        if request.request_id not in self._order:
            return False
        at = bisect.bisect_left(self._items, self.key(request), key=self.key)
        if at < len(self._items) and self._items[at] is request:
            del self._items[at]
            return True
        return False

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)

    def forget(self, request: Request) -> None:
        """Drop a finished request's receipt order."""
        self._order.pop(request.request_id, None)


def make_queue(policy: str) -> FCFSQueue | PriorityQueue:
    if policy == "priority":
        return PriorityQueue()
    if policy == "fcfs":
        return FCFSQueue()
    raise ValueError(f"scheduling_policy must be one of {POLICIES}, got {policy!r}")
