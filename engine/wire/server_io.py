"""The engine-core server's io thread: the ROUTER socket, client frames decoded onto the
input queue, encoded outputs forwarded to their client, READY answered at once.

Apart from the core loop because socket work must never wait on the model: this
thread alone touches the ROUTER socket, so a HELLO is answered and a PING is heard
whatever step is running, and outputs the encoder thread hands over (through an inproc
PULL socket, the outbox) go out as they come. Heartbeats and client liveness, which it
also drives, are engine/wire/server_clients.py's.

ServerIO is a mixin of EngineCoreServer (engine/wire/core_server.py): the state it
reads is the server's, annotated below.

A bad frame, an unknown type or a refused request is logged and, where a request
id is known, answered with an error output; the server keeps serving.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

import msgspec
import zmq

from engine.core_messages import (
    FINISH_ERROR,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    StartDPWave,
    UtilityRequest,
)
from engine.wire.curve_auth import CurveServer
from engine.wire.protocol import (
    ABORT,
    ADD,
    HELLO,
    PING,
    PROTOCOL_VERSION,
    READY,
    START_DP_WAVE,
    UTILITY,
    Hello,
)
from engine.wire.server_clients import CLIENT_BACK, ClientTracking
from engine.wire.utility_calls import stamped

logger = logging.getLogger(__name__)


class ServerIO(ClientTracking):
    """The io thread of EngineCoreServer (_io_loop) and the frame handling it runs."""

    address: str
    max_queued_adds: int
    _ctx: zmq.Context
    _curve: CurveServer | None
    _to_encode: queue.Queue
    _stopped: threading.Event
    _bound: threading.Event
    _bind_error: BaseException | None
    _adds_in: int  # io thread: the ADDs it queued for the core loop
    _adds_out: int  # core loop: the ADDs it took
    _send: Callable[[bytes, EngineCoreOutputs], None]  # EngineCoreServer's: to the encoder

    def _io_loop(self, outbox: zmq.Socket) -> None:
        """Bind the ROUTER socket (a failure is left in _bind_error for start()), then
        serve it and the outbox until the server stops."""
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a client that has gone: drop its outputs
        # No high-water mark: at one (1,000 messages by default) a ROUTER silently drops
        # what a connected but slow client has not read yet, and its streams lose tokens.
        # Unbounded as vLLM's sockets: the queue grows only while a live client lags.
        router.setsockopt(zmq.SNDHWM, 0)
        router.setsockopt(zmq.RCVHWM, 0)
        if self._curve is not None:
            self._curve.apply(router)
        try:
            router.bind(self.address)
        except zmq.ZMQError as exc:
            self._bind_error = exc
            self._bound.set()
            router.close()
            outbox.close()
            return
        self._bound.set()
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(outbox, zmq.POLLIN)
        heartbeat = msgspec.msgpack.Encoder()
        # when each client was last sent anything: a heartbeat goes to every client that
        # heard nothing for an interval, each on its own clock (one clock for all let a
        # client with streams keep the others' heartbeats from ever going out: an idle
        # ingress replica, a coordinator, took a busy engine for dead)
        sent_at: dict[bytes, float] = {}
        try:
            while not self._stopped.is_set():
                ready = dict(poller.poll(timeout=int(self.heartbeat_interval_s * 1000)))
                if router in ready:
                    while True:
                        try:
                            frames = router.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_frames(frames)
                if outbox in ready:
                    while True:
                        # as zmq frames, forwarded without a copy: a bytes payload sent
                        # with copy=False (over 64 KiB) would start pyzmq's garbage
                        # collector, a context and a thread of its own, at the first big
                        # batch (seen as three new threads in a soak's leak check)
                        try:
                            frames = outbox.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        router.send_multipart(frames)
                        sent_at[frames[0].bytes] = time.monotonic()
                self._forget_silent_clients()
                self._send_heartbeats(router, heartbeat, sent_at)
        finally:
            router.close(linger=0)
            outbox.close(linger=0)

    def _on_frames(self, frames: list[bytes]) -> None:
        """Decode one client message onto the input queue (errors: log + error output)."""
        if len(frames) != 3:
            logger.warning("engine %d: dropped a malformed message of %d frames",
                           self.engine_index, len(frames))
            return
        identity, kind, payload = frames
        if identity not in self._client_seen and kind != HELLO:
            self._inputs.put((identity, CLIENT_BACK, None))  # forgotten, yet it speaks
        self._client_seen[identity] = time.monotonic()
        if kind == PING:
            return
        try:
            if kind == ADD:
                msg = msgspec.msgpack.decode(payload, type=EngineCoreRequest)
                if self._adds_in - self._adds_out >= self.max_queued_adds:
                    self._send(identity, EngineCoreOutputs(self.engine_index, [EngineCoreOutput(
                        msg.request_id, [], FINISH_ERROR, error="EngineOverloadedError: "
                        f"{self.max_queued_adds} requests are queued for engine "
                        f"{self.engine_index} behind a step still running; retry shortly")],
                        # sent from this thread: 0 would tell the client a stuck loop moved
                        step_running_s=self.loop_watch.busy_for()))
                    return
                self._adds_in += 1
            elif kind == ABORT:
                msg = msgspec.msgpack.decode(payload, type=list[str])
            elif kind == UTILITY:
                msg = msgspec.msgpack.decode(payload, type=UtilityRequest)
            elif kind == START_DP_WAVE:
                msg = msgspec.msgpack.decode(payload, type=StartDPWave)
            elif kind == HELLO:
                msg = msgspec.msgpack.decode(payload, type=Hello)
                if not self._answer_hello(identity, msg):
                    return
            else:
                logger.warning("engine %d: unknown request type %r", self.engine_index, kind)
                return
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("engine %d: bad %r payload: %s", self.engine_index, kind, exc)
            request_id = _request_id_of(payload) if kind == ADD else None
            if request_id is not None:
                self._send(identity, EngineCoreOutputs(self.engine_index, [EngineCoreOutput(
                    request_id, [], FINISH_ERROR, error=f"invalid request: {exc}")]))
            return
        self._inputs.put((identity, kind, msg))

    def _answer_hello(self, identity: bytes, hello: Hello) -> bool:
        """READY at once, from the io thread, whatever step is running: a handshake (an
        ingress reconnecting, the coordinator's liveness probe) waited behind the step
        before. ready_response reads only values fixed at start. The welcome (KV
        snapshot, heartbeats) follows on the core loop, after READY in the encoder's
        queue. False for a client of another protocol: it would not PING, not served."""
        if hello.protocol_version != PROTOCOL_VERSION:
            logger.error("engine %d: client %s speaks protocol %d, this engine %d: "
                         "not answered", self.engine_index, hello.client_id,
                         hello.protocol_version, PROTOCOL_VERSION)
            return False
        ready = stamped(self.core.ready_response(self.engine_index))
        self._to_encode.put((identity, READY, ready))
        return True


def _request_id_of(payload: bytes) -> str | None:
    """Best effort: the request id of an ADD payload that failed validation."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return None
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        return raw[0]
    return None
