"""The coordinator's rank table, kept where a coordinator restart does not lose it.

The coordinator is state only, and Serve restarts it with nothing: before, a restarted
coordinator handed rank 0 to the next engine replica that asked while the engine
already holding rank 0 had not yet re-registered (it does at its next health check), so
two engines served as rank 0; and it waited for data_parallel_size engines before
listing any, though fewer may be alive. So which replica owns which rank, and the
membership version, are written to Ray's GCS key-value store (the store Serve keeps its
own checkpoints in), under the application's name; a new coordinator starts from them.
The engines' addresses are kept too, so a restarted coordinator can tell an owner that
died meanwhile (its port refuses connections) from one that has not re-registered yet;
their keys are not stored: they come back as each live engine re-registers.

The GCS calls block, and a GCS being restarted answers late: they run on one thread of
their own (in order, so a late write never lands after a newer one), never on the
coordinator's event loop, and each is waited for at most STORE_TIMEOUT_S.

The table is deleted only when the application goes away. A graceful stop of the
coordinator's replica is not enough: Serve also stops a replica gracefully to restart
it after a failed health check or to move it off a draining node, while the engines
keep their ranks; deleting the table then let the next coordinator hand out a rank
twice. `app_going_away` asks Serve's controller which it is.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)
NAMESPACE = "flotilla"
STORE_TIMEOUT_S = 5.0  # one GCS read or write; Serve's controller's status answer


class RankStoreTimeoutError(TimeoutError):
    """The GCS did not answer a rank-table read or write within STORE_TIMEOUT_S."""


@dataclass
class RankTable:
    owner: dict[int, str] = field(default_factory=dict)  # rank -> replica id
    version: int = 0
    # rank -> its engine's address, once registered: a restarted coordinator frees the
    # rank of an owner whose port no longer takes connections (it died meanwhile)
    address: dict[int, str] = field(default_factory=dict)

    def encode(self) -> bytes:
        return json.dumps({"owner": self.owner, "version": self.version,
                           "address": self.address}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "RankTable":
        data = json.loads(raw)
        return cls({int(r): o for r, o in data["owner"].items()}, int(data["version"]),
                   {int(r): a for r, a in data.get("address", {}).items()})


class RankStore:
    """Reads and writes one application's RankTable in the GCS key-value store
    (blocking calls: the coordinator makes them through StoreWriter)."""

    def __init__(self, app_name: str) -> None:
        self.key = f"ranks/{app_name}".encode()
        self.app_name = app_name

    def load(self) -> RankTable | None:
        from ray.experimental.internal_kv import _internal_kv_get
        raw = _internal_kv_get(self.key, namespace=NAMESPACE)
        return RankTable.decode(raw) if raw else None

    def save(self, table: RankTable) -> None:
        from ray.experimental.internal_kv import _internal_kv_put
        _internal_kv_put(self.key, table.encode(), overwrite=True, namespace=NAMESPACE)

    def delete(self) -> None:
        """The application is going away: its next deploy starts clean."""
        from ray.experimental.internal_kv import _internal_kv_del
        _internal_kv_del(self.key, namespace=NAMESPACE)

    def app_going_away(self) -> bool:
        """Whether Serve is deleting this application (or no longer knows it), as
        opposed to restarting or moving the coordinator's replica. Unknown (the
        controller not answering in time) counts as not going away: a table kept by
        mistake costs the next deploy a probe of each stale rank's address, a table
        deleted by mistake hands a live engine's rank to another."""
        import ray
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
        from ray.serve.generated import serve_pb2
        try:
            controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
            raw = ray.get(controller.get_serve_status.remote(self.app_name),
                          timeout=STORE_TIMEOUT_S)
            status = serve_pb2.ApplicationStatus.Name(
                serve_pb2.StatusOverview.FromString(raw).app_status.status)
        except Exception as exc:  # noqa: BLE001 - keep the table (the docstring says why)
            logger.warning("could not ask Serve whether %s is being deleted (%s): the rank "
                           "table is kept", self.app_name, exc)
            return False
        return status in ("APPLICATION_STATUS_DELETING", "APPLICATION_STATUS_NOT_STARTED")


class StoreWriter:
    """A RankStore's calls on one thread of their own, each waited for at most
    STORE_TIMEOUT_S (the module docstring says why). The thread holds its queue, not
    the writer: a coordinator being collected can still flush through it (a pool's
    worker leaves once its pool is unreachable)."""

    def __init__(self, store) -> None:
        self.store = store
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=_work, args=(self._jobs,), name="rank-store",
                         daemon=True).start()

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def close(self) -> None:
        """The thread ends once the queued calls have run."""
        self._jobs.put(None)

    def load(self) -> RankTable | None:
        """The stored table; RankStoreTimeoutError if the GCS does not answer (the
        coordinator's start then fails and Serve retries it: starting with no table
        would hand out the ranks of live engines)."""
        return self._wait(self.submit(self.store.load), "load")

    def save(self, table: RankTable) -> Future:
        """Queued, not waited for: the writes land in order."""
        future = self.submit(self.store.save, table)
        future.add_done_callback(_log_failure)
        return future

    def flush(self) -> None:
        """Wait for the queued writes (at most STORE_TIMEOUT_S)."""
        self._wait(self.submit(lambda: None), "flush")

    def delete(self) -> None:
        self._wait(self.submit(self.store.delete), "delete")

    def app_going_away(self) -> bool:
        return self.store.app_going_away()

    @staticmethod
    def _wait(future: Future, what: str):
        try:
            return future.result(timeout=STORE_TIMEOUT_S)
        except TimeoutError:
            raise RankStoreTimeoutError(f"the GCS did not answer the rank table's {what} "
                                        f"within {STORE_TIMEOUT_S:g}s") from None


def _work(jobs: queue.SimpleQueue) -> None:
    while (job := jobs.get()) is not None:
        future, fn, args = job
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                future.set_exception(exc)


def _log_failure(future: Future) -> None:
    exc = future.exception()
    if exc is not None:  # the GCS restarting: the next change writes the table again
        logger.warning("could not save the rank table: %s", exc)
