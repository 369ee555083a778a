"""Coordinator: one Serve replica that knows the engines and speaks for all of them.

- Assigns data-parallel ranks to EngineServer replicas (a replica that comes back
  with the same id keeps its rank; a new replica takes a free rank, or the rank
  of an engine that stopped reporting).
- Keeps the registry rank -> (address, ready response) for the ingress replicas.
- Fans utility calls out to every engine over its own EngineClient, with the
  aggregation rules of ARCHITECTURE.md (is_sleeping must agree, reset is an AND,
  sleep / wake_up must succeed everywhere and failures name the rank).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec
from ray import serve

from deployments.config import AppArgs
from deployments.tokenizers import tokenizer_for
from engine.core_client import EngineClient
from engine.errors import NoEnginesError

logger = logging.getLogger(__name__)
STALE_AFTER_S = 30.0
PROBE_TIMEOUT_S = 2.0


async def _answers(address: str) -> bool:
    """Whether an engine-core server answers HELLO at `address` (a liveness probe)."""
    import zmq
    import zmq.asyncio

    from engine.protocol import HELLO, READY, Hello
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        await sock.send_multipart([HELLO, msgspec.msgpack.encode(Hello("coordinator-probe"))])
        while True:
            kind, _ = await asyncio.wait_for(sock.recv_multipart(), PROBE_TIMEOUT_S)
            if kind == READY:
                return True
    except (asyncio.TimeoutError, zmq.ZMQError):
        return False
    finally:
        sock.close(0)
        ctx.term()


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class Coordinator:
    def __init__(self, args: dict) -> None:
        self.args = AppArgs.model_validate(args)
        self.size = self.args.data_parallel_size
        self.owner: dict[int, str] = {}  # rank -> replica id
        self.registry: dict[int, dict[str, Any]] = {}  # rank -> {address, ready, seen}
        self._client: EngineClient | None = None
        self._client_addresses: list[str] = []
        self._lock = asyncio.Lock()

    # ---- ranks and registry ------------------------------------------------------------------
    async def assign_rank(self, replica_id: str) -> int:
        """A rank for a starting EngineServer replica.

        A free rank if there is one; else (Serve replaced a replica that died) the
        rank whose engine no longer answers a handshake, or has been silent too long.
        """
        for rank, owner in self.owner.items():
            if owner == replica_id:
                return rank
        free = [r for r in range(self.size) if r not in self.owner]
        if not free:
            now = time.monotonic()
            for r in range(self.size):
                entry = self.registry.get(r)
                silent = now - (entry or {}).get("seen", 0) > STALE_AFTER_S
                if silent or (entry and not await _answers(entry["address"])):
                    free.append(r)
            if not free:
                raise RuntimeError(f"all {self.size} data-parallel ranks are taken")
        rank = min(free)
        self.owner[rank] = replica_id
        self.registry.pop(rank, None)
        logger.info("rank %d assigned to replica %s", rank, replica_id)
        return rank

    def register(self, rank: int, replica_id: str, address: str, ready: dict) -> None:
        self.owner[rank] = replica_id
        self.registry[rank] = {"address": address, "ready": ready, "seen": time.monotonic()}
        logger.info("engine rank %d registered at %s", rank, address)

    def heartbeat(self, rank: int, replica_id: str) -> None:
        if self.owner.get(rank) == replica_id and rank in self.registry:
            self.registry[rank]["seen"] = time.monotonic()

    def release(self, rank: int, replica_id: str) -> None:
        if self.owner.get(rank) == replica_id:
            del self.owner[rank]
            self.registry.pop(rank, None)

    def engines(self) -> list[str]:
        """Addresses of all ranks once every rank has registered, else []."""
        if len(self.registry) < self.size:
            return []
        return [self.registry[r]["address"] for r in range(self.size)]

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
                self._client = await EngineClient.connect(addresses, tokenizer_for(self.args))
                self._client_addresses = addresses
            return self._client

    async def call(self, method: str, *args: Any) -> list[Any]:
        """Per-rank results of a utility call; a failure names its rank."""
        client = await self._engine_client()
        return await client.call_utility(method, *args)

    async def is_sleeping(self) -> bool:
        return await (await self._engine_client()).is_sleeping()

    async def reset_prefix_cache(self, reset_running_requests: bool = False,
                                 reset_external: bool = False) -> bool:
        return await (await self._engine_client()).reset_prefix_cache(
            reset_running_requests, reset_external)

    async def stats(self) -> list[dict]:
        client = await self._engine_client()
        return [{"rank": i, "num_running_reqs": s.num_running_reqs,
                 "num_waiting_reqs": s.num_waiting_reqs, "kv_cache_usage": s.kv_cache_usage}
                for i, s in enumerate(await client.get_stats())]
