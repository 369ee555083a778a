"""The engine core's utilities (a mixin of EngineCore): what a client calls by name
besides requests and LoRA — sleep mode, the prefix-cache reset, memory usage, KV events
for the routers — and what the core says about itself (ready response, stats).

Apart from engine_core.py because none of it is the step loop: each is a call on the
core's state between steps, through the engine-core server's utility dispatch
(engine/wire/utility_calls.py) or the offline LLM. It reads the core's config, runner,
scheduler, KV manager, draft model and counters, annotated below, and rebuilds the KV
manager through EngineCore._kv_manager on sleep.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from engine.config import EngineConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core_messages import EngineCoreReadyResponse, KVEvents, SchedulerStats
from engine.errors import InvalidRequestError
from engine.request_limits import RequestLimits
from engine.spec_decode.decoder import SpecDecoder


class CoreUtilities:
    """Sleep mode, cache resets, memory usage, KV events, self-description."""

    config: EngineConfig
    runner: Any  # ModelRunner, or TPExecutor under tensor parallelism
    scheduler: Scheduler
    kv: KVCacheManager
    spec: SpecDecoder | None
    device: torch.device
    dtype: torch.dtype
    num_blocks: int
    max_model_len: int
    block_size: int
    limits: RequestLimits
    sampling_defaults: dict[str, Any]
    requests: dict[str, Request]
    _sleep_level: int  # 0 awake; 1 KV cache freed (weights off GPU); 2 weights freed
    _iteration_counts: list[int]
    _iteration_sum: int
    _kv_manager: Callable[[], KVCacheManager]  # EngineCore's: an empty block pool
    abort_requests: Callable[[list[str]], None]  # EngineCore's

    # ---- utilities --------------------------------------------------------------------
    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        """Drop the prefix cache. With running requests it refuses (False) unless told
        to preempt them first; they then recompute from scratch. There is no KV
        connector, so reset_connector has nothing to reset."""
        if reset_running_requests:
            self.scheduler.preempt_all()
        return self.kv.reset_prefix_cache()

    def take_kv_events(self) -> KVEvents | None:
        """Prefix-cache changes since the last call, for the server to publish to the
        routers (the first call, and the first after sleep, answer a full snapshot)."""
        events = self.kv.take_events()
        if self.kv_transfer is not None:  # and where blocks live in a KV tier
            events = self.kv_transfer.with_tier_events(events)
        return events

    def kv_cache_snapshot(self) -> KVEvents:
        """Every cached block hash, for a router that just connected."""
        events = self.kv.snapshot_events()
        if self.kv_transfer is not None:
            events = self.kv_transfer.with_tier_events(events, snapshot=True)
        return events

    # ---- sleep mode -------------------------------------------------------------------
    def is_sleeping(self) -> bool:
        return self._sleep_level > 0

    def sleep(self, level: int = 1) -> None:
        """Free memory while idle. In-flight requests are aborted.

        Level 1 discards the KV cache and moves the weights off the accelerator (on
        CPU they stay); level 2 also discards the weights, reloaded by wake_up.
        """
        if level not in (1, 2):
            raise InvalidRequestError(f"sleep level must be 1 or 2, got {level}")
        self.abort_requests(list(self.requests))
        self.runner.free_kv_cache()
        if self.spec is not None:
            self.spec.proposer.sleep(level)
        self.kv = self._kv_manager()
        self.scheduler.kv = self.kv
        if level == 2:
            self.runner.free_weights()
        elif self.device.type != "cpu":
            self.runner.offload_weights()
        self._sleep_level = max(self._sleep_level, level)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what sleep() freed (tags: "weights", "kv_cache"; default both)."""
        if not self._sleep_level:
            return
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise InvalidRequestError(f"unknown wake_up tags {sorted(unknown)}")
        if "weights" in tags:
            self.runner.restore_weights()
        if "kv_cache" in tags and self.runner.kv_caches is None:
            self.runner.allocate_kv_cache(self.num_blocks)
        if self.runner.has_weights() and self.runner.kv_caches is not None:
            self._sleep_level = 0
            if self.spec is not None:  # a draft model's weights and cache come back too
                self.spec.proposer.wake()

    def get_memory_usage(self) -> dict[str, int]:
        """Bytes held on the engine's device by the weights and the KV cache."""
        return self.runner.memory_usage()

    def reset_mm_cache(self) -> bool:
        """vLLM's frontends send this; text-only models keep no multimodal cache."""
        return True

    def reset_encoder_cache(self) -> None:
        """As reset_mm_cache: there is no encoder cache to drop."""
        return None

    # ---- description ------------------------------------------------------------------
    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def get_supported_tasks(self) -> list[str]:
        return ["generate", "embed"]

    def ready_response(self, engine_index: int) -> EngineCoreReadyResponse:
        from engine.version import __version__
        return EngineCoreReadyResponse(
            engine_index=engine_index, max_model_len=self.max_model_len,
            num_gpu_blocks=self.num_blocks, block_size=self.block_size,
            dtype=self.dtype_name, version=__version__,
            supported_tasks=self.get_supported_tasks(), max_num_seqs=self.config.max_num_seqs,
            model=self.config.model, max_logprobs=self.config.max_logprobs,
            sampling_defaults=self.sampling_defaults, limits=self.limits)

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.scheduler.running),
            # those waiting for a KV connector's load wait too (as vLLM counts them)
            num_waiting_reqs=len(self.scheduler.waiting) + len(self.scheduler.waiting_for_kv),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_free_blocks=self.kv.num_free_blocks,
            iteration_tokens_counts=list(self._iteration_counts),
            iteration_tokens_sum=self._iteration_sum,
            **(self.spec.stats.as_fields() if self.spec is not None else {}),
            **(self.kv_transfer.stats() if self.kv_transfer is not None else {}))

