"""A coordinator that Serve restarts (issue 40, finding 4): it used to start with no
ranks owned, so a new engine replica could take the rank of a live engine that had not
re-registered yet, and it listed no engine until data_parallel_size had registered,
though fewer might be alive. The rank table now outlives it (deployments/serve/rank_store.py)."""
from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from deployments.serve import coordinator as coordinator_module
from deployments.serve import rank_store as rank_store_module
from deployments.serve.rank_store import RankStore, RankStoreTimeoutError, RankTable


class MemoryRankStore:
    """RankStore's interface, kept in this process instead of Ray's GCS; app_deleted
    stands for Serve's answer to whether the application is being deleted."""

    def __init__(self) -> None:
        self.raw: bytes | None = None
        self.app_deleted = True

    def app_going_away(self) -> bool:
        return self.app_deleted

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

        def _save(self):
            """Written before the call returns: the next coordinator here reads it at
            once (in Serve it runs in another process, later)."""
            written = super()._save()
            written.result()
            return written
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
    # the application deleted (Serve's answer) clears the table: the next deploy starts clean
    second.__del__()
    assert cls(ARGS).owner == {}


def test_the_rank_table_round_trips():
    table = RankTable({0: "a", 3: "d"}, 7, {0: "tcp://10.0.0.1:5000"})
    assert RankTable.decode(table.encode()) == table
    assert RankStore("flotilla").key == b"ranks/flotilla"


def test_concurrent_assign_rank_calls_get_different_ranks(monkeypatch):
    """Issue 62, item 2: assign_rank awaited its probes without a lock, so two replacement
    engines asking at once both found the same dead rank free and both got it."""
    monkeypatch.setattr(coordinator_module, "PROBE_TIMEOUT_S", 0.2)
    store = MemoryRankStore()
    coordinator = _coordinator_class(store)(ARGS)
    dead = []
    for rank, replica in enumerate("ab"):  # two engines that died: nothing answers
        sock, address = _listening()
        sock.close()
        dead.append(address)
        assert asyncio.run(coordinator.assign_rank(replica)) == rank
        coordinator.register(rank, replica, address, {}, None)

    async def replacements():
        return await asyncio.gather(coordinator.assign_rank("c"), coordinator.assign_rank("d"))
    ranks = asyncio.run(replacements())
    assert sorted(ranks) == [0, 1]
    assert {coordinator.owner[r] for r in ranks} == {"c", "d"}


def test_the_rank_table_survives_a_graceful_restart():
    """Issue 62, item 2: the table was deleted at any graceful stop, though Serve also
    stops the coordinator gracefully to restart it (a failed health check) or move it (a
    draining node) while the engines keep their ranks; the next coordinator then handed
    a live engine's rank to another. Only the application's deletion clears it now."""
    store = MemoryRankStore()
    cls = _coordinator_class(store)
    first = cls(ARGS)
    assert asyncio.run(first.assign_rank("a")) == 0
    first.register(0, "a", "tcp://127.0.0.1:1", {}, None)
    store.app_deleted = False  # Serve restarts the replica; the application stays
    first.__del__()
    second = cls(ARGS)
    assert second.owner == {0: "a"} and second.addresses == {0: "tcp://127.0.0.1:1"}
    store.app_deleted = True  # now the application goes
    second.__del__()
    assert cls(ARGS).owner == {}


class BlockedRankStore(MemoryRankStore):
    """A GCS that does not answer writes until `answer` is set (at most 10 s)."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = threading.Event()
        self.finished = 0

    def save(self, table: RankTable) -> None:
        self.answer.wait(10)
        super().save(table)
        self.finished += 1


def test_rank_table_writes_run_off_the_event_loop_with_a_timeout(monkeypatch):
    """Issue 62, item 2: the GCS calls ran on the coordinator's event loop, so a slow GCS
    stalled every call to it (membership, heartbeats). Writes now run on a thread of
    their own: register returns at once, assign_rank waits for its write at most
    STORE_TIMEOUT_S, and a load that gets no answer fails the start with a typed error."""
    monkeypatch.setattr(coordinator_module, "STORE_TIMEOUT_S", 0.2)
    store = BlockedRankStore()
    base = _coordinator_class(store).__mro__[1]

    class Blocked(base):
        def _rank_store(self):
            return store
    coordinator = Blocked(ARGS)

    async def calls():
        rank = await asyncio.wait_for(coordinator.assign_rank("a"), 2.0)
        coordinator.register(rank, "a", "tcp://127.0.0.1:1", {}, None)
        return rank, store.finished
    rank, finished = asyncio.run(calls())
    assert rank == 0 and finished == 0  # answered while the GCS was still silent
    store.answer.set()
    coordinator._store.flush()
    assert store.finished == 2 and RankTable.decode(store.raw).address == {
        0: "tcp://127.0.0.1:1"}  # the writes landed, in order

    monkeypatch.setattr(rank_store_module, "STORE_TIMEOUT_S", 0.2)
    store.load = lambda: threading.Event().wait(10)  # a GCS that does not answer reads
    with pytest.raises(RankStoreTimeoutError, match="load"):
        Blocked(ARGS)
