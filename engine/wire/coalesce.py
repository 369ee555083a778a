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

from engine.core_messages import EngineCoreOutputs
from engine.wire.protocol import OUTPUTS

Item = tuple[bytes, bytes, Any]  # (client identity, message kind, message)


def _mergeable(msg: Any) -> bool:
    """Step outputs only: a utility answer or a wave end goes out as it is."""
    return (isinstance(msg, EngineCoreOutputs) and msg.utility_output is None
            and msg.wave_complete is None)


def _merge(msgs: list[EngineCoreOutputs]) -> EngineCoreOutputs:
    """One message saying what `msgs` said, in order, built once for the whole run.

    Outputs stay in order (a request's outputs fold in order on the client); the
    latest stats win; the timestamp is the first one set (when the earliest of these
    outputs was made: a first token's time is not pushed later); the run's KV events
    (coalesce lets at most one message of a run carry some) ride along; the loop's
    age is the last one's (an io thread refusal carries it)."""
    return EngineCoreOutputs(
        msgs[0].engine_index, [out for m in msgs for out in m.outputs],
        timestamp=next((m.timestamp for m in msgs if m.timestamp), 0.0),
        scheduler_stats=next((m.scheduler_stats for m in reversed(msgs)
                              if m.scheduler_stats is not None), None),
        kv_events=next((m.kv_events for m in msgs if m.kv_events is not None), None),
        step_running_s=msgs[-1].step_running_s)


def coalesce(items: list[Item]) -> list[Item]:
    """The items in order, each client's consecutive step outputs merged into one
    message. Anything else for a client (a utility answer) ends what merges before it,
    so a client sees its messages in the order they were made. KV events are not
    merged with each other (each batch applies as a whole): a second batch starts a
    new message."""
    runs: list[tuple[bytes, bytes, list]] = []  # (client, kind, messages sent as one)
    open_for: dict[bytes, int] = {}  # client -> index in runs of its run of step outputs
    for identity, kind, msg in items:
        if kind != OUTPUTS or not _mergeable(msg):
            open_for.pop(identity, None)
            runs.append((identity, kind, [msg]))
            continue
        at = open_for.get(identity)
        if at is not None and not (msg.kv_events is not None and any(
                m.kv_events is not None for m in runs[at][2])):
            runs[at][2].append(msg)
            continue
        open_for[identity] = len(runs)
        runs.append((identity, kind, [msg]))
    return [(identity, kind, msgs[0] if len(msgs) == 1 else _merge(msgs))
            for identity, kind, msgs in runs]
