"""KVTransferSteps: where an engine core's step meets its KV connector.

Why apart from the engine core: the step loop stays one loop whether or not a connector
is configured; this holds the order of the calls (engine/kv_transfer/base.py says why
each is where it is) and the load-failure policy, and the engine core calls it at four
points: before scheduling, after scheduling, after the forward, and when idle.
"""
from __future__ import annotations

import logging
from typing import Any

import msgspec

from engine.core.request import Request
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.core_messages import KVEvents
from engine.kv_transfer.base import Connector, ConnectorContext, KVLayout, StepTransfers
from engine.kv_transfer.fingerprint import checkpoint_signature, pool_fingerprint

logger = logging.getLogger(__name__)


class KVTransferSteps:
    """One engine core's connector, driven step by step."""

    def __init__(self, connector: Connector, scheduler: Scheduler,
                 load_failure_policy: str) -> None:
        self.connector = connector
        self.scheduler = scheduler
        self.recompute = load_failure_policy == "recompute"
        scheduler.connector = connector.scheduler
        self._transfers = StepTransfers()
        self.loads_failed = 0  # requests whose load failed (recomputed or failed)

    def before_schedule(self) -> list[tuple[Request, str]]:
        """Take the worker's finished transfers: arrived KV makes its requests
        schedulable, finished sends free their blocks. Returns the requests to fail
        (a failed load under kv_load_failure_policy "fail"), with why."""
        done = self.connector.worker.get_finished(set(self.scheduler.waiting_for_kv))
        self.scheduler.kv_sent(done.sent)
        failed: list[tuple[Request, str]] = []
        for request_id, why in done.failed.items():
            self.loads_failed += 1
            logger.warning("KV load of request %s failed (%s): %s", request_id, why,
                           "recomputing it" if self.recompute else "failing it")
            request = self.scheduler.kv_load_failed(request_id, self.recompute)
            if request is not None:
                failed.append((request, f"the KV cache load failed: {why} "
                                        "(kv_load_failure_policy 'fail')"))
        self.scheduler.kv_arrived(done.received - set(done.failed))
        return failed

    def after_schedule(self, sched: SchedulerOutput) -> None:
        """Start this step's loads (they run while the step does) and note its saves."""
        self._transfers = self.connector.scheduler.build_step_transfers(
            list(zip(sched.requests, sched.num_new_tokens)))
        if self._transfers.loads:
            self.connector.worker.start_load_kv(self._transfers.loads)

    def after_forward(self) -> None:
        """Copy out the blocks the forward filled, before any can be reused."""
        if self._transfers.saves:
            self.connector.worker.save_kv(self._transfers.saves)
        self._transfers = StepTransfers()

    def idle(self, timeout: float = 0.005) -> None:
        """Nothing could run: only loads are in flight. Wait for them a little rather
        than spin."""
        if self.scheduler.waiting_for_kv:
            self.connector.worker.wait(timeout)

    def with_tier_events(self, events: KVEvents | None, snapshot: bool = False
                         ) -> KVEvents | None:
        """The pool's events with the connector's tier events added (a snapshot of the
        tiers where the pool's is one, or was cleared: a router then forgets this
        engine's host tier)."""
        snapshot = snapshot or (events is not None and events.cleared)
        tiers = self.connector.scheduler.take_events(snapshot)
        if not tiers or not any(tiers.values()):
            return events
        if events is None:
            return KVEvents(**tiers)
        return msgspec.structs.replace(events, **tiers)

    def stats(self) -> dict:
        """SchedulerStats' connector fields: counters since the engine started."""
        worker = self.connector.worker
        block = getattr(worker, "block_bytes", 0)
        loaded, saved = getattr(worker, "blocks_loaded", 0), getattr(worker, "blocks_saved", 0)
        return {"kv_connector": self.connector.name,
                "external_prefix_cache_queries": self.scheduler.external_queries,
                "external_prefix_cache_hits": self.scheduler.external_hits,
                "kv_blocks_in": loaded, "kv_blocks_out": saved,
                "kv_bytes_in": loaded * block, "kv_bytes_out": saved * block,
                "kv_load_failures": self.loads_failed}

    def shutdown(self) -> None:
        self.connector.worker.shutdown()


def connect(core: Any) -> KVTransferSteps | None:
    """The connector an engine core's kv_transfer_config names, over its pool (None
    without one). `core` is an EngineCore after its pool and scheduler are made."""
    transfer = core.config.kv_transfer_config
    if transfer is None:
        return None
    from engine.kv_transfer.registry import build_connector
    from engine.model.attention.block_major import BlockMajorCache
    runner = getattr(core.runner, "kv_caches", None) is not None and core.runner
    caches = runner.kv_caches if runner else None
    block_shape = tuple(caches[:, 0].shape) if caches is not None else ()
    kv_dtype = caches.dtype if caches is not None else core.dtype
    tp = core.config.tensor_parallel_size
    layout = KVLayout(block_shape, kv_dtype, core.kv.block_size, pool_fingerprint(
        checkpoint_signature(core.checkpoint, core.config.load_format),
        core.shape.architecture, core.dtype, kv_dtype, core.kv.block_size, block_shape,
        type(runner.attention).__name__ if runner else "tensor-parallel", tp))
    context = ConnectorContext(
        caches, layout, core.kv.enable_prefix_caching, len(core.kv.windows),
        core.kv.state_blocks, tp, bool(runner) and isinstance(runner.attention, BlockMajorCache))
    connector = build_connector(transfer.kv_connector, transfer.kv_connector_extra_config,
                                context)
    logger.info("KV connector %s (%s), pool fingerprint %s", connector.name,
                transfer.kv_role, layout.fingerprint)
    return KVTransferSteps(connector, core.scheduler, transfer.kv_load_failure_policy)


__all__ = ["KVTransferSteps", "connect"]
