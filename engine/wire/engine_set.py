"""The engines a client talks to: connection, handshake, membership and health.

Apart from the requests that run on them, so that each half can be read alone: this
module knows sockets, heartbeats and who is dead, and nothing of streams, routing or
utility calls. EngineSet is the base of the client (engine/wire/core_client.py), which
fills in the three hooks (_engine_message, _engine_died, _engine_revived) to deliver
outputs and fail or resubmit the requests of an engine that went away.

Background loops, each with one job:
- output reader (one per engine): takes every message queued on the socket per
  wake-up (at most READ_BATCH before it yields), notes the engine's last-heard time,
  stats and step time, and hands the decoded message to the client.
- ping loop: tells every engine this client is alive (an engine drops the requests of
  a client it stops hearing from).
- health monitor: an engine silent past the heartbeat timeout (or whose process died)
  is dead; the client reports unhealthy, keeping the first error.
- connection watch (one per engine): a dropped TCP connection shortens the wait for
  the heartbeat to DISCONNECT_GRACE_S.
An engine declared dead for its silence that speaks again is revived.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from engine.core_messages import EngineCoreOutputs, EngineCoreReadyResponse, SchedulerStats
from engine.errors import EngineDeadError, FlotillaError
from engine.wire.curve_auth import ClientKeys
from engine.wire.protocol import HELLO, OUTPUTS, PING, PROTOCOL_VERSION, READY, Hello

logger = logging.getLogger(__name__)

READ_BATCH = 64  # messages read before this reader yields to the event loop (fairness cap)
CLIENT_PING_S = 1.0  # PING every engine this often: an engine drops a silent client's requests
DISCONNECT_GRACE_S = 2.0  # after a TCP disconnect: time to hear from the engine (beats 1 s)
STALLED_STEP_S = 10.0  # an engine whose loop completed nothing this long gets no new request


class HandshakeError(FlotillaError):
    """An engine did not answer HELLO in time, or answered something incompatible."""


@dataclass
class EngineLink:
    """One engine as this client sees it: its socket, what its READY said, its health
    and load."""
    index: int
    address: str
    socket: zmq.asyncio.Socket
    ready: EngineCoreReadyResponse
    last_heard: float
    stats: SchedulerStats | None = None
    stats_at: float = 0.0  # time.monotonic() when `stats` came
    in_flight: int = 0
    dead: bool = False
    silent: bool = False  # dead because it went quiet (not gone, not by its own word)
    pending_aborts: list[str] = field(default_factory=list)  # for when it speaks again
    draining: bool = False  # it refused a request because it is shutting down
    is_alive: Callable[[], bool] | None = None
    adapters: set[int] = field(default_factory=set)  # LoRA ids this client sent it
    step_running_s: float = 0.0  # how long its loop has completed nothing (heartbeats)


class EngineSet:
    """N engines behind DEALER sockets, and whether each is alive."""

    def __init__(self) -> None:
        self.engines: list[EngineLink] = []
        self.client_id = uuid.uuid4().hex
        self.dead_error: EngineDeadError | None = None
        self.heartbeat_timeout_s = 10.0
        self.stalled_step_s = STALLED_STEP_S  # a step this long: no new request (placement)
        self._ctx: zmq.asyncio.Context | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)

    # ---- hooks: what the client does with the engines' news -----------------------------
    def _engine_message(self, engine: EngineLink, msg: EngineCoreOutputs) -> None:
        """An OUTPUTS message, once its stats and step time are recorded."""

    def _engine_died(self, engine: EngineLink, error: EngineDeadError) -> None:
        """The engine was just declared dead (dead_error is set)."""

    def _engine_revived(self, engine: EngineLink) -> None:
        """A quiet engine speaks again: its pending_aborts are still on it."""

    # ---- joining ----------------------------------------------------------------------------
    async def _join(self, addresses: list[str], timeout: float,
                    is_alive: list[Callable[[], bool]] | None,
                    keys: dict[str, ClientKeys]) -> list[EngineCoreReadyResponse]:
        """Handshake with every engine at once and keep them; their READYs in order. A
        failed or cancelled handshake closes every socket (none is left to block)."""
        self._ctx = zmq.asyncio.Context()
        handshakes = [asyncio.ensure_future(self._handshake(i, a, timeout, keys.get(a)))
                      for i, a in enumerate(addresses)]
        try:
            readies = await asyncio.gather(*handshakes)
        except BaseException:  # one failed, or the caller gave up: end the others too
            for h in handshakes:
                h.cancel()
            for result in await asyncio.gather(*handshakes, return_exceptions=True):
                if isinstance(result, tuple):
                    result[0].close(linger=0)
            await self._close_sockets()
            raise
        for i, (address, (socket, ready)) in enumerate(zip(addresses, readies)):
            alive = is_alive[i] if is_alive else None
            self.engines.append(EngineLink(i, address, socket, ready, time.monotonic(),
                                           is_alive=alive))
        sizes = {r.block_size for _, r in readies}
        if len(sizes) != 1:
            await self._close_sockets()
            raise HandshakeError(f"engines disagree on block_size: {sorted(sizes)}")
        return [r for _, r in readies]

    async def _handshake(self, index: int, address: str, timeout: float,
                         keys: ClientKeys | None = None
                         ) -> tuple[zmq.asyncio.Socket, EngineCoreReadyResponse]:
        socket = self._ctx.socket(zmq.DEALER)
        if keys is not None:
            keys.apply(socket)
        socket.setsockopt(zmq.IDENTITY, self.client_id.encode())
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, 0)  # the engine's outputs wait here while the loop is busy
        socket.setsockopt(zmq.SNDHWM, 0)
        try:
            socket.connect(address)
            await socket.send_multipart([HELLO, self._encoder.encode(
                Hello(self.client_id, PROTOCOL_VERSION))])
            while True:
                kind, payload = await asyncio.wait_for(socket.recv_multipart(), timeout)
                if kind == READY:
                    ready = msgspec.msgpack.decode(payload, type=EngineCoreReadyResponse)
                    if ready.protocol_version != PROTOCOL_VERSION:
                        raise HandshakeError(
                            f"engine {index} at {address} speaks protocol "
                            f"{ready.protocol_version}, this client {PROTOCOL_VERSION}")
                    return socket, ready
        except asyncio.TimeoutError:
            socket.close(linger=0)
            raise HandshakeError(f"engine {index} at {address} did not answer within "
                                 f"{timeout:.0f}s") from None
        except BaseException:  # cancelled (the caller gave up), a bad address, ...
            socket.close(linger=0)
            raise

    # ---- what the engines reported --------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return min(e.ready.max_model_len for e in self.engines)

    @property
    def num_gpu_blocks(self) -> int:
        return sum(e.ready.num_gpu_blocks for e in self.engines)

    @property
    def block_size(self) -> int:
        return self.engines[0].ready.block_size

    # ---- background loops -------------------------------------------------------------------
    async def _read_outputs(self, engine: EngineLink) -> None:
        """After each awaited message, read what else is queued on the socket without
        awaiting: pyzmq's asyncio wrapper costs a future and a poller registration per
        await, as much as decoding the message itself."""
        direct = zmq.Socket(shadow=engine.socket.underlying)  # same socket, no asyncio
        try:
            while True:
                self._on_message(engine, await engine.socket.recv_multipart())
                for _ in range(READ_BATCH):
                    try:
                        frames = direct.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_message(engine, frames)
                # Awaiting a receive whose message is already there does not yield to the
                # loop: with a standing backlog this task would run alone, and the HTTP
                # handlers and Serve's health checks with it (seen: an ingress replica
                # silent for 100 s under load, then killed as unhealthy).
                await asyncio.sleep(0)
        except (asyncio.CancelledError, zmq.ContextTerminated):
            return

    def _on_message(self, engine: EngineLink, frames: list[bytes]) -> None:
        kind, payload = frames
        engine.last_heard = time.monotonic()
        if engine.silent:
            self._revive(engine)
        if kind != OUTPUTS:
            return
        try:
            msg = self._decoder.decode(payload)
        except msgspec.DecodeError:
            logger.warning("engine %d sent an undecodable frame", engine.index)
            return
        if msg.scheduler_stats is not None:
            engine.stats, engine.stats_at = msg.scheduler_stats, engine.last_heard
        engine.step_running_s = msg.step_running_s  # 0 on what its loop sends
        self._engine_message(engine, msg)

    async def _ping_loop(self) -> None:
        """Tell every engine this client is alive (dead ones too: a quiet engine that
        resumes must not drop the requests of a client it missed)."""
        try:
            while True:
                for engine in self.engines:
                    try:
                        await engine.socket.send_multipart([PING, b""], flags=zmq.NOBLOCK)
                    except zmq.ZMQError:  # at the high-water mark: the next one will do
                        pass
                await asyncio.sleep(CLIENT_PING_S)
        except asyncio.CancelledError:
            return

    async def _monitor_health(self) -> None:
        """After a stall of this client's own event loop (its process stopped, a long
        blocking call) the engines' messages still wait in the sockets: it judges no
        engine on that pass but gives each a new heartbeat_timeout_s (an ingress
        SIGSTOPped for 15 s declared both live engines dead on waking, failing its
        streams)."""
        period = max(0.05, min(1.0, self.heartbeat_timeout_s / 4))
        last_pass = time.monotonic()
        try:
            while True:
                await asyncio.sleep(period)
                now = time.monotonic()
                stalled, last_pass = now - last_pass > self.heartbeat_timeout_s / 2, now
                if stalled:
                    for e in self.engines:
                        e.last_heard = max(e.last_heard, now)
                    continue
                for e in self.engines:
                    if e.dead:
                        continue
                    silent = now - e.last_heard > self.heartbeat_timeout_s
                    gone = e.is_alive is not None and not e.is_alive()
                    if silent or gone:
                        why = "process exited" if gone else (
                            f"silent for {now - e.last_heard:.1f}s")
                        self._mark_dead(e, why)
                        e.silent = not gone
        except asyncio.CancelledError:
            return

    async def _watch_connection(self, engine: EngineLink) -> None:
        """A dropped connection (the engine's process died, its node went away) shortens
        the wait for the heartbeat to DISCONNECT_GRACE_S: if the engine does not speak
        again by then, the health monitor declares it dead. A live engine reconnects
        and its next heartbeat (1 s) clears the suspicion."""
        monitor = engine.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED and not engine.dead:
                    suspect = time.monotonic() - self.heartbeat_timeout_s + DISCONNECT_GRACE_S
                    engine.last_heard = min(engine.last_heard, suspect)
                    logger.warning("engine %d at %s: connection lost", engine.index,
                                   engine.address)
        except (asyncio.CancelledError, zmq.ZMQError):
            return
        finally:
            try:
                engine.socket.disable_monitor()
            except zmq.ZMQError:
                pass
            monitor.close(linger=0)

    # ---- membership ---------------------------------------------------------------------
    def _revive(self, engine: EngineLink) -> None:
        """An engine declared dead for its silence spoke again (a stopped process
        resumed, a network blip ended): route to it again, and send it the aborts of
        the requests whose streams failed meanwhile, which it would otherwise decode to
        max_tokens."""
        if engine.is_alive is not None and not engine.is_alive():
            return
        engine.dead = engine.silent = False
        logger.warning("engine %d at %s answers again: back in service (%d aborts sent)",
                       engine.index, engine.address, len(engine.pending_aborts))
        self._engine_revived(engine)
        engine.pending_aborts = []
        if not any(e.dead for e in self.engines):
            self.dead_error = None

    def _mark_dead(self, engine: EngineLink, why: str) -> None:
        engine.dead = True
        error = EngineDeadError(f"engine {engine.index} at {engine.address} is dead: {why}")
        if self.dead_error is None:
            self.dead_error = error
        logger.error("%s", error)
        self._engine_died(engine, error)

    async def _close_sockets(self) -> None:
        """Close every socket and the context. destroy, not term: term blocks the calling
        thread (here the event loop) until every socket of the context is closed, so one
        socket left open froze the whole process. Seen: a coordinator whose handshake was
        cancelled (a readiness probe that gave up after 2 s) never answered again, and its
        engines failed their health checks."""
        for e in self.engines:
            e.socket.close(linger=0)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
