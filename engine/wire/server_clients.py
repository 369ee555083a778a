"""The engine-core server's per-client bookkeeping: when each client was last heard,
which clients are gone, their heartbeats, and what happens to a silent client's requests.

Apart from the socket and step loops because client liveness is a policy of its own
(issue 62's silent ingress replicas): a client not heard from (requests, PINGs every
CLIENT_PING_S) for client_timeout_s is gone, an OOM-killed or downscaled ingress
replica. The io thread notices (ClientTracking._forget_silent_clients) and hands the
core loop a CLIENT_GONE marker; the core loop aborts the client's requests
(_drop_client), so they hold no KV blocks and no slots, and it gets no more heartbeats or
KV events. A forgotten client that speaks again comes back with CLIENT_BACK.

ClientTracking is a mixin of EngineCoreServer (engine/wire/core_server.py): the state it
reads is the server's, annotated below (set in its constructor); of it, _client_seen
and _io_pass_at are this module's alone, the io thread's.
"""
from __future__ import annotations

import logging
import queue
import time
from typing import Any, Callable

import msgspec
import zmq

from engine.core.interface import EngineCoreLike
from engine.core_messages import EngineCoreOutputs
from engine.wire.loop_watch import LoopWatch
from engine.wire.protocol import OUTPUTS

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
# a client not heard from (requests, PINGs every CLIENT_PING_S) for this long is gone
CLIENT_TIMEOUT_S = 30.0
CLIENT_GONE = b"gone"  # input-queue markers, never on the wire
CLIENT_BACK = b"back"


class ClientTracking:
    """Client liveness and heartbeats for EngineCoreServer."""

    core: EngineCoreLike
    engine_index: int
    client_timeout_s: float
    heartbeat_interval_s: float
    loop_watch: LoopWatch
    _inputs: queue.Queue
    _clients: set[bytes]  # core loop: the clients that get heartbeats and KV events
    _owner_of: dict[str, bytes]  # core loop: request id -> client routing id
    _stats_due: bool
    _client_seen: dict[bytes, float]  # io thread only: client -> last frame
    _io_pass_at: float  # the io loop's last look at its clients

    _safe_stats: Callable[[], Any]  # EngineCoreServer's: the core's stats, or None

    def _send_heartbeats(self, router: zmq.Socket, encoder: msgspec.msgpack.Encoder,
                         sent_at: dict[bytes, float]) -> None:
        """A heartbeat (stats, the loop's time on its current work) to each client sent nothing for an interval
        (io thread); `sent_at` keeps only the current clients."""
        now = time.monotonic()
        clients = list(self._clients)
        for c in clients:  # a client's clock starts when it joins: its READY goes first
            sent_at.setdefault(c, now)
        due = [c for c in clients if now - sent_at[c] >= self.heartbeat_interval_s]
        if due:
            beat = encoder.encode(EngineCoreOutputs(
                self.engine_index, timestamp=time.time(), scheduler_stats=self._safe_stats(),
                step_running_s=self.loop_watch.busy_for()))
            for identity in due:
                router.send_multipart([identity, OUTPUTS, beat])
                sent_at[identity] = now
        if len(sent_at) > len(clients):
            for gone in set(sent_at).difference(clients):
                del sent_at[gone]

    def _forget_silent_clients(self) -> None:
        """Hand the core loop every client silent past client_timeout_s (io thread).
        After a stall of this thread itself (the process stopped, a VM paused) its
        clients' PINGs may still sit in ZMQ's queues: it judges no one until they had a
        new chance to arrive."""
        now = time.monotonic()
        if now - self._io_pass_at > self.client_timeout_s / 2:
            self._client_seen = dict.fromkeys(self._client_seen, now)
        self._io_pass_at = now
        for identity, seen in list(self._client_seen.items()):
            if now - seen > self.client_timeout_s:
                del self._client_seen[identity]
                self._inputs.put((identity, CLIENT_GONE, None))

    def _drop_client(self, identity: bytes) -> None:
        """A client the io thread found silent (core loop): no more heartbeats or KV
        events for it, and its requests aborted; the stats go out after the aborts."""
        if identity not in self._clients:
            return
        self._clients.discard(identity)
        orphans = [r for r, owner in self._owner_of.items() if owner == identity]
        if orphans:
            logger.warning("engine %d: client %s silent for %.0fs: aborting its %d "
                           "requests", self.engine_index, identity[:8].decode(errors="replace"),
                           self.client_timeout_s, len(orphans))
            self.core.abort_requests(orphans)
            self._stats_due = True
