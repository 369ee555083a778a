"""EngineCoreLike: what the engine-core server asks of the core it serves.

Why written down: two cores are served the same way, EngineCore (the model) and
MockEngineCore (engine/mock/core.py, no model), and the server
(engine/wire/core_server.py) must not care which. This lists exactly what the server
calls, so a member that drifts in one core fails tests/test_core_interface.py rather
than a served request.

Besides these members the server reads two things a core may leave out: `config`, for
its queue bounds (max_waiting_requests, max_num_seqs), and the utilities vLLM's
frontends send that only some cores answer (`profile`, `execute_dummy_batch`); a core
without one answers that utility with a failure.
"""
from __future__ import annotations

from typing import Protocol

from engine.core_messages import (
    EngineCoreOutput,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    KVEvents,
    SchedulerStats,
)
from engine.lora.request import LoRARequest


class EngineCoreLike(Protocol):
    """An engine core as the server drives it: the step loop's calls first, then the
    utilities a client may call by name (core_server.UTILITY_METHODS)."""

    # ---- the step loop ------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request; a typed FlotillaError (or ValueError) refuses it."""
        ...

    def abort_requests(self, request_ids: list[str]) -> None:
        """Stop requests (unknown ids ignored); each gets an "abort" output next step."""
        ...

    def has_unfinished_requests(self) -> bool:
        """True while step() has something to do or to report."""
        ...

    def next_step_delay(self) -> float | None:
        """Seconds the server may wait for input before the next step() (0.0: step now;
        None: idle)."""
        ...

    def step(self) -> list[EngineCoreOutput]:
        """One step: the outputs it produced (possibly none)."""
        ...

    def get_stats(self) -> SchedulerStats:
        """The core's load, sent with outputs and heartbeats."""
        ...

    def ready_response(self, engine_index: int) -> EngineCoreReadyResponse:
        """What a client learns at its handshake (the server adds the protocol version)."""
        ...

    def take_kv_events(self) -> KVEvents | None:
        """Prefix-cache changes since the last call, for the routers (None: none)."""
        ...

    def kv_cache_snapshot(self) -> KVEvents:
        """Every cached block hash, for a client that just connected."""
        ...

    def shutdown(self) -> None:
        """Release what the core holds (threads, workers) when the server stops."""
        ...

    # ---- utilities called by name ---------------------------------------------------------
    def get_supported_tasks(self) -> list[str]:
        ...

    def is_sleeping(self) -> bool:
        ...

    def sleep(self, level: int = 1) -> None:
        ...

    def wake_up(self, tags: list[str] | None = None) -> None:
        ...

    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        ...

    def get_memory_usage(self) -> dict[str, int]:
        ...

    def add_lora(self, lora_request: LoRARequest) -> bool:
        ...

    def remove_lora(self, lora_id: int) -> bool:
        ...

    def list_loras(self) -> list[LoRARequest]:
        ...

    def reset_mm_cache(self) -> bool:
        ...

    def reset_encoder_cache(self) -> None:
        ...
