"""Merging an engine's queued output messages per client before they are encoded.

The core loop hands one EngineCoreOutputs per client per step to the encoder thread.
When steps come faster than messages go out (a fast engine, a short model, the mock at
zero model time), every client still paid a whole message per step: an encode, a send,
a receive and a decode on each side, for one or two tokens. The encoder takes every
message already queued and sends one per client instead, as vLLM's frontend folds the
outputs its consumer has not taken yet. A message goes out as soon as it would have:
nothing waits to be merged, only what is already waiting is.
"""
from __future__ import annotations

from typing import Any

from engine.wire.protocol import OUTPUTS, EngineCoreOutputs

Item = tuple[bytes, bytes, Any]  # (client identity, message kind, message)


def _mergeable(msg: Any) -> bool:
    """Step outputs only: a utility answer or a wave end goes out as it is."""
    return (isinstance(msg, EngineCoreOutputs) and msg.utility_output is None
            and msg.wave_complete is None)


def _merge(first: EngineCoreOutputs, later: EngineCoreOutputs) -> EngineCoreOutputs | None:
    """One message saying what `first` then `later` said, or None where it cannot.

    Outputs stay in order (a request's outputs fold in order on the client); the
    latest stats win; the timestamp stays the first's (when the earliest of these
    outputs was made: a first token's time is not pushed later). KV events are not
    merged with each other (each batch applies as a whole), so two messages that both
    carry some stay apart."""
    if first.kv_events is not None and later.kv_events is not None:
        return None
    return EngineCoreOutputs(
        first.engine_index, first.outputs + later.outputs,
        timestamp=first.timestamp or later.timestamp,
        scheduler_stats=later.scheduler_stats if later.scheduler_stats is not None
        else first.scheduler_stats,
        kv_events=first.kv_events if first.kv_events is not None else later.kv_events)


def coalesce(items: list[Item]) -> list[Item]:
    """The items in order, each client's consecutive step outputs merged into one
    message. Anything else for a client (a utility answer) ends what merges before it,
    so a client sees its messages in the order they were made."""
    result: list[Item] = []
    open_for: dict[bytes, int] = {}  # client -> index in result of its mergeable message
    for identity, kind, msg in items:
        if kind != OUTPUTS or not _mergeable(msg):
            open_for.pop(identity, None)
            result.append((identity, kind, msg))
            continue
        at = open_for.get(identity)
        if at is not None:
            merged = _merge(result[at][2], msg)
            if merged is not None:
                result[at] = (identity, kind, merged)
                continue
        open_for[identity] = len(result)
        result.append((identity, kind, msg))
    return result
