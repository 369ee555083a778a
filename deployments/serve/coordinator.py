"""Coordinator: one Serve replica that knows the engines and speaks for all of them.

- Assigns data-parallel ranks to EngineServer replicas (a replica that comes back
  with the same id keeps its rank; a new replica takes a free rank, or the rank
  of an engine that stopped reporting).
- Keeps the registry rank -> (address, ready response) for the ingress replicas,
  with a version number that changes whenever an engine joins or leaves (the
  ingress replicas poll it and move to the new set; engine autoscaling adds and
  removes ranks at run time).
- Fans utility calls out to every engine over its own EngineClient, with the
  aggregation rules of docs/architecture.md (is_sleeping must agree, reset is an AND,
  sleep / wake_up must succeed everywhere and failures name the rank).
- Keeps the rank table in Ray's GCS (deployments/serve/rank_store.py): a coordinator that
  Serve restarts hands out no rank twice and lists whichever engines re-register. Its
  writes run off this replica's event loop; it is deleted only with the application.
- Sums the ingress replicas' request metrics, so that /metrics never goes backwards
  whichever replica a scrape reaches; forgets the replicas Serve no longer runs.
"""
from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any

import msgspec
from ray import serve

from deployments.apis.responses.store import ResponseStore
from deployments.config import AppArgs
from deployments.serve.metrics_sum import MetricsSum, ReplicaSweep, serve_running_replicas
from deployments.serve.rank_store import STORE_TIMEOUT_S, RankStore, RankTable, StoreWriter
from engine.errors import NoEnginesError
from engine.wire.core_client import EngineClient
from engine.wire.curve_auth import ClientKeys, client_keys

logger = logging.getLogger(__name__)
STALE_AFTER_S = 30.0
PROBE_TIMEOUT_S = 2.0


async def _accepts(address: str) -> bool:
    """Whether anything takes TCP connections at a tcp://host:port address (a stopped
    process still does: its kernel accepts for it; a dead one's port refuses)."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)),
                                           PROBE_TIMEOUT_S)
    except (OSError, ValueError, asyncio.TimeoutError):
        return False
    writer.close()
    return True


async def _answers(address: str, keys: dict | None) -> bool:
    """Whether an engine-core server answers HELLO at `address` (a liveness probe);
    keys: its clients' CURVE keys, as it registered them."""
    import zmq
    import zmq.asyncio

    from engine.wire.protocol import HELLO, PROTOCOL_VERSION, READY, Hello
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys:
        ClientKeys.from_dict(keys).apply(sock)
    try:
        sock.connect(address)
        await sock.send_multipart([HELLO, msgspec.msgpack.encode(Hello("coordinator-probe", PROTOCOL_VERSION))])
        while True:
            kind, _ = await asyncio.wait_for(sock.recv_multipart(), PROBE_TIMEOUT_S)
            if kind == READY:
                return True
    except (asyncio.TimeoutError, zmq.ZMQError):
        return False
    finally:
        ctx.destroy(linger=0)  # closes the socket; never blocks (see EngineClient._close_sockets)


# No access log: every ingress replica polls membership twice a second and every engine
# heartbeats: a log line per call is CPU taken from the cores the engines compute on.
# No practical cap on concurrent calls: with Serve's default of 5, calls that wait on the
# engines (a utility, list_loras while a handshake is pending: up to 30 s each; the
# readiness probe of `flotilla serve` sends /v1/models every second) filled every slot, and
# the engines' heartbeats and registrations could no longer be routed: seen in CI, the
# engine replicas failed their health checks and their replacements retried registering
# for 10+ minutes. Every method is async or instant, so concurrency costs nothing here.
COORDINATOR_MAX_ONGOING_REQUESTS = 10_000


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0},
                  max_ongoing_requests=COORDINATOR_MAX_ONGOING_REQUESTS,
                  logging_config={"enable_access_log": False})
class Coordinator:
    def __init__(self, args: dict) -> None:
        self.args = AppArgs.model_validate(args)
        self.initial = self.args.data_parallel_size  # engines to wait for at start
        self.max_ranks = self.args.max_engines
        self.owner: dict[int, str] = {}  # rank -> replica id
        self.registry: dict[int, dict[str, Any]] = {}  # rank -> {address, ready, seen}
        self.addresses: dict[int, str] = {}  # rank -> address, kept over a restart
        self.version = 0  # bumped whenever the set of registered engines changes
        self._started = False  # the initial engines have all registered once
        self.stopping = False  # stop_serving() was called
        self._client: EngineClient | None = None
        self._client_addresses: list[str] = []
        self._lock = asyncio.Lock()
        # assign_rank awaits probes: two replacement engines asking at once both saw the
        # same rank free and both got it. Assignments take turns.
        self._assigning = asyncio.Lock()
        self._assigned_at: dict[int, float] = {}  # rank -> when handed out (unregistered)
        self._metrics = MetricsSum()
        # forgets the ingress replicas Serve no longer runs (their counts stay summed)
        self._metrics_sweep = ReplicaSweep(self._metrics, serve_running_replicas)
        # stored Responses, one store for every ingress replica (its module says why)
        self._responses = ResponseStore(self.args.response_store_max,
                                        self.args.response_store_ttl_s,
                                        self.args.response_store_max_bytes)
        # ranks survive a restart (deployments/serve/rank_store.py): the engines that own them
        # count as seen at the restart, and come back at their next health check
        self._store = StoreWriter(self._rank_store())
        self._restored_at = -STALE_AFTER_S  # no owner restored: none counts as seen
        self._stopped = False
        table = self._store.load()  # no table in time: this start fails, Serve retries
        if table is not None:
            self.owner, self.version = table.owner, table.version + 1
            self.addresses = {r: a for r, a in table.address.items() if r in self.owner}
            self._started = True  # serve whichever engines are alive, however many
            self._restored_at = time.monotonic()
            logger.warning("coordinator restarted: %d ranks owned, membership version %d",
                           len(self.owner), self.version)
            self._save()

    def _rank_store(self):
        return RankStore(serve.get_replica_context().app_name)

    def _save(self):
        """Queue the table's write (off the event loop, in order); its future."""
        return self._store.save(RankTable(dict(self.owner), self.version,
                                          {r: a for r, a in self.addresses.items()
                                           if r in self.owner}))

    def __del__(self) -> None:
        """A graceful stop. The queued writes land first; the table is deleted only when
        the application goes away (its next deploy starts with no ranks owned), not when
        Serve restarts or moves this replica while the engines keep their ranks
        (rank_store.py says how the two are told apart)."""
        if getattr(self, "_stopped", True) or sys.is_finalizing():
            return  # once (Serve calls it, then the collector); not at interpreter exit
        self._stopped = True
        try:
            self._store.flush()
            if self._store.app_going_away():
                self._store.delete()
        except Exception as exc:  # noqa: BLE001 - Ray already down
            logger.warning("rank table not settled at stop: %s", exc)
        self._store.close()

    # ---- ranks and registry ------------------------------------------------------------------
    async def assign_rank(self, replica_id: str) -> int:
        """A rank for a starting EngineServer replica.

        A free rank if there is one; else (Serve replaced a replica that died) the
        rank whose engine no longer answers a handshake, or has been silent too long;
        after a restart, one whose owner has not registered again and whose engine's
        port refuses connections (it died meanwhile: waiting STALE_AFTER_S for it kept
        its replacement out for half a minute).
        """
        async with self._assigning:  # one at a time: each rank is handed out once
            rank = await self._pick_rank(replica_id)
            if self.owner.get(rank) == replica_id:
                return rank  # asked again (a retried start)
            self.owner[rank] = replica_id
            self._assigned_at[rank] = time.monotonic()
            self.addresses.pop(rank, None)
            if self.registry.pop(rank, None) is not None:
                self.version += 1
            written = self._save()
        try:  # on record before the engine uses it, unless the GCS is slow
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(written)),
                                   STORE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - it lands later, in order
            logger.warning("rank %d: the rank table not yet saved: %s", rank, exc)
        logger.info("rank %d assigned to replica %s", rank, replica_id)
        return rank

    async def _pick_rank(self, replica_id: str) -> int:
        """assign_rank's choice; the taken ranks' engines are probed concurrently."""
        for rank, owner in self.owner.items():
            if owner == replica_id:
                return rank
        free = [r for r in range(self.max_ranks) if r not in self.owner]
        if free:
            return min(free)
        now = time.monotonic()

        async def gone(r: int) -> bool:
            entry = self.registry.get(r)
            # an unregistered owner counts as seen when it was handed the rank (or the
            # table restored): it may still be loading its model
            seen = entry["seen"] if entry else max(self._restored_at,
                                                   self._assigned_at.get(r, -STALE_AFTER_S))
            if now - seen > STALE_AFTER_S:
                return True
            if entry is not None:  # a dead engine's port refuses at once; only a live
                # one is asked to answer (ZMQ retries a refused connect until the probe's
                # timeout: every replacement of a killed engine waited PROBE_TIMEOUT_S)
                return not (await _accepts(entry["address"])
                            and await _answers(entry["address"], entry.get("keys")))
            return r in self.addresses and not await _accepts(self.addresses[r])
        ranks = range(self.max_ranks)
        free = [r for r, out in zip(ranks, await asyncio.gather(*map(gone, ranks))) if out]
        if not free:
            raise RuntimeError(f"all {self.max_ranks} data-parallel ranks are taken")
        return min(free)

    def register(self, rank: int, replica_id: str, address: str, ready: dict,
                 keys: dict | None = None) -> None:
        """keys: the CURVE keys its clients connect with (ClientKeys.as_dict()); None
        for an engine serving in the clear."""
        owner = self.owner.get(rank)
        if owner is not None and owner != replica_id:
            raise RuntimeError(f"rank {rank} belongs to replica {owner}, not {replica_id}")
        self.owner[rank] = replica_id
        self.registry[rank] = {"address": address, "ready": ready, "seen": time.monotonic(),
                               "keys": keys}
        self._assigned_at.pop(rank, None)
        self.addresses[rank] = address
        self.version += 1
        self._save()
        logger.info("engine rank %d registered at %s", rank, address)

    def serving(self) -> bool:
        """Whether the server already serves (its initial engines registered and some
        engine is registered now): an engine starting then joins a live server (a
        replacement, a scale-out) and backs its KV pool after ready instead of before."""
        return bool(self.engines())

    def heartbeat(self, rank: int, replica_id: str) -> bool:
        """Whether this coordinator knows the engine; False after a coordinator restart
        (its registry starts empty), and the engine then registers again."""
        if self.owner.get(rank) == replica_id and rank in self.registry:
            self.registry[rank]["seen"] = time.monotonic()
            return True
        return False

    def release(self, rank: int, replica_id: str) -> None:
        """A replica going away (downscale, shutdown): its engine leaves the set first,
        so the ingress replicas stop sending it requests while it drains."""
        if self.owner.get(rank) == replica_id:
            del self.owner[rank]
            self._assigned_at.pop(rank, None)
            self.addresses.pop(rank, None)
            if self.registry.pop(rank, None) is not None:
                self.version += 1
            self._save()
            logger.info("engine rank %d released", rank)

    def engines(self) -> list[str]:
        """Addresses of the registered engines in rank order; [] until the initial
        data_parallel_size engines have all registered (so traffic starts spread)."""
        if not self._started:
            if len(self.registry) < self.initial:
                return []
            self._started = True
        return [self.registry[r]["address"] for r in sorted(self.registry)]

    def membership(self) -> tuple[int, list[str], dict[str, dict], bool]:
        """(version, engines(), address -> the keys to connect with, stopping): the
        ingress replicas poll this to follow changes."""
        addresses = self.engines()
        return self.version, addresses, self._keys_of(addresses), self.stopping

    def stop_serving(self) -> None:
        """The server is stopping (`flotilla serve` got SIGTERM or Ctrl-C): the ingress
        replicas see it at their next membership poll, answer /health with 503 so load
        balancers drain them, and refuse new requests with 503 while their streams
        finish."""
        self.stopping = True

    def _keys_of(self, addresses: list[str]) -> dict[str, dict]:
        by_address = {e["address"]: e.get("keys") for e in self.registry.values()}
        return {a: by_address[a] for a in addresses if by_address.get(a)}

    # ---- utilities across engines -------------------------------------------------------------
    async def _engine_client(self) -> EngineClient:
        addresses = self.engines()
        if not addresses:
            raise NoEnginesError("the engines have not all registered yet")
        async with self._lock:
            if self._client is None or self._client_addresses != addresses or \
                    not self._client.healthy:
                if self._client is not None:
                    await self._client.shutdown()
                self._client = await EngineClient.connect(  # utility calls only
                    addresses, keys=client_keys(self._keys_of(addresses)))
                self._client_addresses = addresses
            return self._client

    async def call(self, method: str, *args: Any) -> list[Any]:
        """Per-rank results of a utility call; a failure names its rank."""
        client = await self._engine_client()
        return await client.call_utility(method, *args)

    async def list_loras(self) -> list:
        """The adapters loaded by name (every engine is given the same ones)."""
        return await (await self._engine_client()).list_loras()

    async def is_sleeping(self) -> bool:
        return await (await self._engine_client()).is_sleeping()

    async def reset_prefix_cache(self, reset_running_requests: bool = False,
                                 reset_external: bool = False) -> bool:
        return await (await self._engine_client()).reset_prefix_cache(
            reset_running_requests, reset_external)

    async def report_metrics(self, replica_id: str, snapshot: list) -> list:
        """An ingress replica's request metrics in; the sum over all replicas out
        (deployments/serve/metrics_sum.py)."""
        total = self._metrics.report(replica_id, snapshot)
        self._metrics_sweep.poke()
        return total

    async def put_response(self, response_id: str, record: dict) -> bool:
        return self._responses.put(response_id, record)

    async def get_response(self, response_id: str) -> dict | None:
        return self._responses.get(response_id)

    async def delete_response(self, response_id: str) -> bool:
        return self._responses.delete(response_id)

    async def stats(self) -> list[dict]:
        client = await self._engine_client()
        ranks = {self.registry[r]["address"]: r for r in self.registry}
        stats = await client.get_stats()
        return [{"rank": ranks.get(e.address, e.index), "num_running_reqs": s.num_running_reqs,
                 "num_waiting_reqs": s.num_waiting_reqs, "kv_cache_usage": s.kv_cache_usage}
                for e, s in zip([e for e in client.engines if not e.dead], stats)]
