"""The engine-core server's utility dispatch: a client's UtilityRequest run by name on
the core, answered with a UtilityOutput.

Apart from the server's loops because it is a policy, not plumbing: which names a client
may call (UTILITY_METHODS, also what tests/test_core_interface.py holds the cores to),
and how a missing or failing one is answered (a failure message, never an exception
that would stop the core loop).
"""
from __future__ import annotations

import logging

import msgspec

from engine.core.interface import EngineCoreLike
from engine.core_messages import EngineCoreReadyResponse, UtilityOutput, UtilityRequest
from engine.wire.protocol import PROTOCOL_VERSION

logger = logging.getLogger(__name__)

# The utilities a client may call by name. The last four are the ones vLLM's frontends
# also send (profiling, multimodal / encoder cache resets, a data-parallel dummy step);
# a core that lacks one answers with a clear failure rather than "unknown method".
UTILITY_METHODS = frozenset({
    "get_supported_tasks", "is_sleeping", "sleep", "wake_up", "reset_prefix_cache",
    "get_stats", "ready_response", "has_unfinished_requests", "get_memory_usage",
    "add_lora", "remove_lora", "list_loras",
    "profile", "reset_mm_cache", "reset_encoder_cache", "execute_dummy_batch"})


def call_utility(core: EngineCoreLike, engine_index: int, req: UtilityRequest
                 ) -> UtilityOutput:
    """Run `req` on `core` (the core loop's thread); every outcome is an answer."""
    if req.method not in UTILITY_METHODS:
        return UtilityOutput(req.call_id, failure_message=f"unknown method {req.method!r}")
    method = getattr(core, req.method, None)
    if method is None:
        return UtilityOutput(req.call_id, failure_message=(
            f"engine {engine_index} ({type(core).__name__}) does not support "
            f"{req.method!r}"))
    try:
        result = method(*req.args, **req.kwargs)
        if req.method == "ready_response":
            result = stamped(result)
        return UtilityOutput(req.call_id, result=result)
    except Exception as exc:
        logger.warning("engine %d: utility %s failed: %s", engine_index, req.method, exc)
        return UtilityOutput(req.call_id, failure_message=f"{type(exc).__name__}: {exc}")


def stamped(ready: EngineCoreReadyResponse) -> EngineCoreReadyResponse:
    """A core's ready response as the server sends it: with the wire's PROTOCOL_VERSION,
    which the core (below the wire) does not know."""
    return msgspec.structs.replace(ready, protocol_version=PROTOCOL_VERSION)
