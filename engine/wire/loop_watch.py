"""How long the engine's core loop has gone without completing anything: liveness
that means progress, wherever the loop is stuck.

An engine-core server's io thread answers handshakes and PINGs and sends heartbeats
whatever the core loop is doing, so an engine whose loop hangs looks alive to its
clients and to Serve's health check while it serves nothing. Timing only the step
missed every other place the loop can hang: an ADD (a LoRA load or a grammar compile
inside add_request), an abort, a utility call (wake_up, add_lora stuck on storage),
the stats or KV events it gathers for its outputs. So the loop restarts this clock
each time it completes a unit of work (a step, one input handled) and stops it while
it blocks waiting for input (idle is not stuck). `busy_for()` is what the heartbeats
carry (a client stops routing to the engine past its stalled_step_s) and what the
replica's health check holds to `engine_step_timeout_s`, so Serve replaces it.
"""
from __future__ import annotations

import time


class LoopWatch:
    """Written by the core loop only; read from any thread (one float, one writer)."""

    def __init__(self) -> None:
        self._busy_since: float | None = None  # None: waiting for input

    def progressed(self) -> None:
        """A unit of work done, or the loop woke to work: the clock restarts."""
        self._busy_since = time.monotonic()

    def waiting(self) -> None:
        """The loop blocks on its input queue (or has stopped): nothing is stuck."""
        self._busy_since = None

    def busy_for(self) -> float:
        """Seconds since the loop last completed a unit of work (or woke), while it
        works; 0 while it waits for input."""
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since
