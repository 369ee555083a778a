"""A coordinator that Serve restarts (issue 40, finding 4): it used to start with no
ranks owned, so a new engine replica could take the rank of a live engine that had not
re-registered yet, and it listed no engine until data_parallel_size had registered,
though fewer might be alive. The rank table now outlives it (deployments/serve/rank_store.py)."""
from __future__ import annotations

import asyncio
import socket

import pytest

from deployments.serve import coordinator as coordinator_module
from deployments.serve.rank_store import RankStore, RankTable


class MemoryRankStore:
    """RankStore's interface, kept in this process instead of Ray's GCS."""

    def __init__(self) -> None:
        self.raw: bytes | None = None

    def load(self) -> RankTable | None:
        return RankTable.decode(self.raw) if self.raw else None

    def save(self, table: RankTable) -> None:
        self.raw = table.encode()

    def delete(self) -> None:
        self.raw = None


def _coordinator_class(store: MemoryRankStore):
    base = coordinator_module.Coordinator.func_or_class
    base = base if "_rank_store" in vars(base) else base.__mro__[1]

    class InMemory(base):
        def _rank_store(self):
            return store
    return InMemory


ARGS = {"model": "mock", "data_parallel_size": 2}


def _listening() -> tuple[socket.socket, str]:
    """A port that takes connections, as a live (or stopped) engine's does."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock, f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def test_a_restarted_coordinator_hands_out_no_rank_twice_and_lists_the_live_engines():
    store = MemoryRankStore()
    cls = _coordinator_class(store)
    first = cls(ARGS)
    assert asyncio.run(first.assign_rank("a")) == 0
    assert asyncio.run(first.assign_rank("b")) == 1
    (a_port, a), (b_port, b) = _listening(), _listening()
    first.register(0, "a", a, {}, None)
    first.register(1, "b", b, {}, None)
    version = first.membership()[0]
    # killed: no __del__; Serve starts another with the same args
    second = cls(ARGS)
    assert second.owner == {0: "a", 1: "b"} and second.membership()[0] > version
    with pytest.raises(RuntimeError, match="ranks are taken"):  # not rank 0 or 1 again
        asyncio.run(second.assign_rank("c"))
    # b died before registering again: its port refuses connections, so its
    # replacement gets rank 1 at once (it waited STALE_AFTER_S, 30 s), while a's port
    # still takes them and a keeps rank 0
    b_port.close()
    assert asyncio.run(second.assign_rank("c")) == 1
    assert not second.heartbeat(0, "a")  # unknown until it registers again
    second.register(0, "a", a, {}, None)
    # the one engine alive is served, not nothing
    assert second.membership()[1] == [a]
    assert asyncio.run(second.assign_rank("a")) == 0  # the same replica keeps its rank
    third = cls(ARGS)  # restarted again; c never registered, a's port listens
    assert third.owner == {0: "a", 1: "c"}
    with pytest.raises(RuntimeError, match="ranks are taken"):
        asyncio.run(third.assign_rank("d"))
    a_port.close()
    # a graceful stop clears the table: the next deploy starts clean
    second.__del__()
    assert cls(ARGS).owner == {}


def test_the_rank_table_round_trips():
    table = RankTable({0: "a", 3: "d"}, 7, {0: "tcp://10.0.0.1:5000"})
    assert RankTable.decode(table.encode()) == table
    assert RankStore("flotilla").key == b"ranks/flotilla"
