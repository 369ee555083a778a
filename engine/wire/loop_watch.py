"""How long the engine's current step (or utility call) has been running: liveness
that means progress.

An engine-core server's io thread answers handshakes and PINGs and sends heartbeats
whatever the core loop is doing, so an engine whose step hangs (a stalled device, a
deadlocked collective, a kernel that never returns, a wake_up or add_lora stuck on
storage) looks alive to its clients and to Serve's health check while it serves
nothing. The core loop marks the start and end of each step and each utility call
here; `running_for()` is what the replica's health check compares with its
`engine_step_timeout_s`, so Serve replaces such an engine.
"""
from __future__ import annotations

import time


class StepWatch:
    """Written by the core loop only; read from any thread (one float, one writer)."""

    def __init__(self) -> None:
        self._started_at: float | None = None

    def started(self) -> None:
        self._started_at = time.monotonic()

    def finished(self) -> None:
        self._started_at = None

    def running_for(self) -> float:
        """Seconds the step now running has taken so far; 0 between steps."""
        started = self._started_at
        return 0.0 if started is None else time.monotonic() - started
