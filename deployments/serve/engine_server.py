"""EngineServer: one Serve replica per data-parallel rank, hosting an engine-core server.

The replica asks the coordinator for its rank, builds the engine core (the real
EngineCore, or the mock for model=mock), serves it over ZMQ on its node's address,
and registers the address. Serve's health check reflects the engine loop (a dead
tensor-parallel worker, or a core loop that completed nothing for
engine_step_timeout_s, makes it fail, so Serve restarts the replica); on shutdown the
replica drains, releases its rank and stops the server (and its TP workers).
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

import ray
from ray import serve

from deployments.serve.autoscaling import autoscaling_stats
from deployments.config import AppArgs
from deployments.serve.coordinator_calls import (
    ASSIGN_RANK_TIMEOUT_S,
    COORDINATOR_CALL_TIMEOUT_S,
    ask,
)
from deployments.tokenizers import tokenizer_for
from engine.wire.core_server import EngineCoreServer
from engine.wire.ports import free_port
from engine.wire.curve_auth import EngineKeys

logger = logging.getLogger(__name__)
# Serve's replica logger: its lines reach the replica's log file (logs/serve/) with a
# timestamp, where the engine's own INFO lines are dropped. A start's phases go there,
# so a replacement's time to serving can be read from the logs (bench/recovery.py).
start_log = logging.getLogger("ray.serve")
DRAIN_TIMEOUT_S = 15.0  # below graceful_shutdown_timeout_s
# How long a leaving engine keeps refusing (not dropping) new requests: ingress replicas
# follow the coordinator's membership every 0.5 s, and the release is asynchronous. A
# fake-cluster downscale lost one request when the engine closed at once (nothing in
# flight) while an ingress still routed to it.
ROUTING_SETTLE_S = 2.0



T = TypeVar("T")


async def build_on_own_thread(factory: Callable[[], T]) -> T:
    """Run factory (the engine's construction: weights, warm-up and KV profiling passes)
    on a thread that exits when it is done, without blocking the replica's event loop.

    Why: libgomp keeps one OpenMP thread pool per thread that starts parallel work, and
    once it manages more threads than there are CPUs it stops spinning at barriers and
    puts its workers to sleep after ~100 spins. Built on the replica's thread and stepped
    on the engine-core thread, the engine had two pools on its 2 CPUs: every parallel
    region of a step (hundreds: each linear, norm, attention call) then paid a futex
    wake-up, and the engine's threads idled a quarter of the time under load. A thread's
    pool goes away when the thread exits, so the core loop's pool is the only one left."""
    builder = ThreadPoolExecutor(1, thread_name_prefix="engine-build")
    try:
        return await asyncio.get_running_loop().run_in_executor(builder, factory)
    finally:  # its one thread exits, and its OpenMP pool with it
        await asyncio.to_thread(builder.shutdown)


# Serve learns that a replica's process died only when a health check of it fails: the
# check in flight fails at once, else the next one, up to a period later. At 5 s an
# engine killed under load was noticed 0.9-4.7 s after the kill (bench/recovery.py);
# every second of that counts against a replacement's 30 s to serving (issue 62). A
# check is a call into this replica's event loop and a heartbeat to the coordinator.
HEALTH_CHECK_PERIOD_S = 2.0


@serve.deployment(health_check_period_s=HEALTH_CHECK_PERIOD_S, health_check_timeout_s=30,
                  graceful_shutdown_timeout_s=20)
class EngineServer:
    async def __init__(self, args: dict, coordinator) -> None:
        self.args = AppArgs.model_validate(args)
        self.coordinator = coordinator
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.rank: int | None = None
        self.server: EngineCoreServer | None = None
        await self._start()

    async def _start(self) -> None:
        started = time.perf_counter()
        # bounded: a silent coordinator fails this start (CoordinatorTimeoutError), and
        # Serve starts the replica again, instead of it waiting for ever
        self.rank = await ask(self.coordinator.assign_rank.remote(self.replica_id),
                              "assign_rank", ASSIGN_RANK_TIMEOUT_S)
        start_log.info("engine rank %d: rank assigned in %.1fs", self.rank,
                       time.perf_counter() - started)
        mark = time.perf_counter()
        try:
            core = await self._build_core()
        except BaseException:
            # the rank back at once: an unregistered rank is held STALE_AFTER_S for an
            # owner still loading, and this replica's replacement would wait that long
            self.coordinator.release.remote(self.rank, self.replica_id)
            raise
        host = ray.util.get_node_ip_address()
        address = f"tcp://{host}:{free_port(host)}"
        # CURVE keys made here, handed to clients only through the coordinator (Ray)
        self.keys = EngineKeys.generate()
        self.server = EngineCoreServer(core, address, self.rank, keys=self.keys).start()
        built = time.perf_counter() - mark
        await self._register()
        parts = ", ".join(f"{k} {v:.1f}" for k, v in getattr(core, "startup_s", {}).items())
        start_log.info("engine rank %d: serving %.1fs after its start (built in %.1fs: %s; "
                       "registered in %.1fs)", self.rank, time.perf_counter() - started,
                       built, parts or "-", time.perf_counter() - mark - built)

    async def _build_core(self):
        """The engine core for self.rank: the mock, or the real one (on its own thread)."""
        if self.args.is_mock:
            from engine.mock.core import MockEngineCore
            tokenizer = tokenizer_for(self.args)  # the ingress decodes with it too
            return MockEngineCore(self.args.mock_config(self.rank, len(tokenizer)),
                                  tokenizer=tokenizer if self.args.mock.scripted else None)
        from engine.core.engine_core import EngineCore
        launcher = None
        if self.args.tensor_parallel_size > 1:  # ranks 1..N-1 in our placement group
            from deployments.serve.tp_workers import RayWorkerLauncher
            launcher = RayWorkerLauncher(self.args.engine_cpus, self.args.engine_num_gpus)
        config = self.args.engine_config(self.rank)
        joining = await self._joining()
        return await build_on_own_thread(
            lambda: EngineCore(config, launcher, kv_pages_before_ready=not joining))

    async def _joining(self) -> bool:
        """Whether this engine joins a server that already serves (it replaces a dead
        engine, or scales out): the live engines carry the load meanwhile, so its KV
        pool is backed after ready (hugepages.BackgroundPopulate: it took 4.9-10.9 s of a
        replacement's start under load on 2 cores), not before as at a first
        start, where no engine serves until all have started. Unknown (the coordinator
        silent): as at a first start."""
        try:
            return bool(await ask(self.coordinator.serving.remote(), "serving",
                                  COORDINATOR_CALL_TIMEOUT_S))
        except Exception as exc:  # noqa: BLE001 - only the choice above depends on it
            logger.warning("engine rank %d: the coordinator did not say whether the "
                           "server serves (%s); the KV pool is backed before ready",
                           self.rank, exc or type(exc).__name__)
            return False

    async def _register(self) -> None:
        ready = self.server.core.ready_response(self.rank)
        await ask(self.coordinator.register.remote(
            self.rank, self.replica_id, self.server.address,
            {"block_size": ready.block_size, "max_model_len": ready.max_model_len,
             "num_gpu_blocks": ready.num_gpu_blocks},
            self.keys.for_clients().as_dict()), "register", COORDINATOR_CALL_TIMEOUT_S)

    async def __call__(self) -> dict:
        """Where this engine is (also starts it on first use)."""
        if self.server is None:
            await self._start()
        return {"rank": self.rank, "address": self.server.address,
                "actor_name": ray.get_runtime_context().get_actor_name()}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """This engine's load for the engine autoscaling policy (deployments.serve.autoscaling);
        Serve calls it only when engine_autoscaling is configured."""
        if self.server is None:
            return {}
        try:
            return autoscaling_stats(self.server.core.get_stats())
        except Exception:  # asleep, stopping: report nothing this time
            return {}

    async def check_health(self) -> None:
        if self.server is None:
            await self._start()
            return
        if not self.server.alive():
            raise RuntimeError(f"engine rank {self.rank}: engine loop stopped")
        # a step, a utility call (sleep, wake_up, add_lora) or an input still running:
        # the same bound for each, as each legitimately takes long (a big prefill, a
        # wake_up reloading weights) and none has done anything in 300 s when it hangs
        stuck = self.server.loop_watch.busy_for()
        if stuck > self.args.engine_step_timeout_s:
            raise RuntimeError(
                f"engine rank {self.rank}: its core loop has completed nothing (a step, a "
                f"call, an input) for {stuck:.0f}s (engine_step_timeout_s "
                f"{self.args.engine_step_timeout_s:g})")
        try:
            known = await ask(self.coordinator.heartbeat.remote(self.rank, self.replica_id),
                              "heartbeat", COORDINATOR_CALL_TIMEOUT_S)
            if not known:
                await self._register()
        except (asyncio.TimeoutError, ray.exceptions.ActorDiedError,
                ray.exceptions.ActorUnavailableError) as exc:
            # the coordinator restarting: this engine is fine. A refusal (its rank now
            # owned by another replica) still fails the check, so Serve replaces it.
            logger.warning("engine rank %d: the coordinator did not answer (%s); "
                           "registering again at the next health check", self.rank,
                           exc or type(exc).__name__)

    def __del__(self) -> None:
        """Serve's graceful shutdown (downscale, redeploy): leave the coordinator's engine
        set first (the ingress replicas stop picking this engine within a poll), then
        drain (in-flight requests finish; a request that still arrives is refused as
        draining and the client resubmits it to another engine), then stop."""
        if self.server is None:
            return
        try:
            self.coordinator.release.remote(self.rank, self.replica_id)
        except Exception:  # the coordinator may already be gone at app teardown
            pass
        self.server.drain(DRAIN_TIMEOUT_S, min_s=ROUTING_SETTLE_S)
        self.server.shutdown()
