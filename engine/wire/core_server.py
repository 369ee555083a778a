"""EngineCoreServer: one engine core behind a ZMQ ROUTER socket (tcp:// or ipc://).

Threads, so that socket work never runs on the model thread:
- io thread: owns the ROUTER socket; receives and decodes client frames onto the
  input queue; forwards encoded outputs from the outbox to their client; sends a
  heartbeat (stats only) to every client when the engine has been quiet for a while.
- encoder thread: encodes (client, EngineCoreOutputs) pairs and hands the bytes to
  the io thread through an inproc socket; step outputs already queued for a client
  when it gets to them go out as one message (engine/wire/coalesce.py).
- core loop (the caller's thread, or one started by start()): drains the input
  queue, steps the core, routes each output to the client that sent the request.
  When idle it blocks on the input queue: no busy loop. It restarts its LoopWatch at
  each unit of work it completes (engine/wire/loop_watch.py); heartbeats carry the
  watch's reading, so a loop stuck anywhere, in a step or not, shows.

KV events (the core's prefix-cache changes, engine/core/kv_events.py) go to every
connected client at most every kv_events_interval_s, riding on that step's outputs
(or alone); a client that says HELLO first gets a snapshot (cleared + every cached
hash), so a router that connects late starts with the engine's whole cache.

The core is anything that implements EngineCoreLike (engine/core/interface.py):
EngineCore, or the model-free MockEngineCore (engine/mock/core.py).

A bad frame, an unknown type or a refused request is logged and, where a request
id is known, answered with an error output; the server keeps serving.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from typing import Any

import msgspec
import zmq

from engine.core.interface import EngineCoreLike
from engine.core_messages import (
    FINISH_ERROR,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    KVEvents,
    StartDPWave,
    UtilityOutput,
    UtilityRequest,
)
from engine.errors import EngineDeadError, EngineDrainingError, FlotillaError
from engine.wire.coalesce import coalesce
from engine.wire.curve_auth import CurveServer, EngineKeys
from engine.wire.protocol import (
    ABORT,
    ADD,
    HELLO,
    OUTPUTS,
    PING,
    PROTOCOL_VERSION,
    READY,
    START_DP_WAVE,
    UTILITY,
    Hello,
)
from engine.wire.loop_watch import LoopWatch

logger = logging.getLogger(__name__)
MAX_QUEUED_ADDS = 4096  # for a core without config.max_waiting_requests


def queued_adds_bound(config: Any) -> int:
    """How many ADDs may wait for the core loop while a step runs: as many as an idle
    core would take, its batch (max_num_seqs) and its waiting queue. Bounding them by the
    waiting queue alone refused a burst that arrived during a step with 429 although the
    batch had room for part of it."""
    waiting = getattr(config, "max_waiting_requests", None)
    if waiting is None:
        return MAX_QUEUED_ADDS
    return waiting + getattr(config, "max_num_seqs", 0)

# The utilities a client may call by name. The last four are the ones vLLM's frontends
# also send (profiling, multimodal / encoder cache resets, a data-parallel dummy step);
# a core that lacks one answers with a clear failure rather than "unknown method".
UTILITY_METHODS = frozenset({
    "get_supported_tasks", "is_sleeping", "sleep", "wake_up", "reset_prefix_cache",
    "get_stats", "ready_response", "has_unfinished_requests", "get_memory_usage",
    "add_lora", "remove_lora", "list_loras",
    "profile", "reset_mm_cache", "reset_encoder_cache", "execute_dummy_batch"})
HEARTBEAT_INTERVAL_S = 1.0
# a client not heard from (requests, PINGs every CLIENT_PING_S) for this long is gone: an
# OOM-killed or downscaled ingress replica; its requests are aborted, so they hold no KV
# blocks and no slots, and it gets no more heartbeats or KV events
CLIENT_TIMEOUT_S = 30.0
_CLIENT_GONE = b"gone"  # input-queue markers, never on the wire
_CLIENT_BACK = b"back"
KV_EVENTS_INTERVAL_S = 0.1  # the most often KV events are sent (batched in between)
ENCODE_BATCH = 256  # the most queued messages the encoder takes (and merges) at once
_STOP = object()


def engine_addresses(address: str, count: int) -> list[str]:
    """Addresses of `count` engines started from one base address.

    tcp://host:port -> ports port, port+1, ...; ipc://path -> path, path-1, path-2, ...
    """
    if count == 1:
        return [address]
    if address.startswith("tcp://"):
        host, port = address[len("tcp://"):].rsplit(":", 1)
        return [f"tcp://{host}:{int(port) + i}" for i in range(count)]
    return [address if i == 0 else f"{address}-{i}" for i in range(count)]


class EngineCoreServer:
    """Serves `core` (an EngineCore or a MockEngineCore) at `address`."""

    def __init__(self, core: EngineCoreLike, address: str, engine_index: int = 0,
                 heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
                 kv_events_interval_s: float = KV_EVENTS_INTERVAL_S,
                 client_timeout_s: float = CLIENT_TIMEOUT_S,
                 keys: EngineKeys | None = None) -> None:
        """keys: serve over CURVE, admitting only the client key pair in them
        (engine/wire/curve_auth.py); None: a plain socket."""
        self.core = core
        self.client_timeout_s = client_timeout_s
        self._client_seen: dict[bytes, float] = {}  # io thread only: client -> last frame
        self._io_pass_at = time.monotonic()  # the io loop's last look at its clients
        self.address = address
        self.engine_index = engine_index
        self.heartbeat_interval_s = heartbeat_interval_s
        self._ctx = zmq.Context()
        self._curve = CurveServer(self._ctx, keys) if keys is not None else None
        self._inputs: queue.Queue = queue.Queue()
        self.loop_watch = LoopWatch()  # a loop that completes nothing is not liveness
        # ADDs the io thread queued and the core loop took: a step that runs long (a big
        # prefill, a stalled device) would otherwise let a flood of requests pile up here
        # unbounded, ahead of the waiting queue's own bound. Each counter has one writer.
        self._adds_in = 0  # io thread
        self._adds_out = 0  # core loop
        self.max_queued_adds = queued_adds_bound(getattr(core, "config", None))
        self._to_encode: queue.Queue = queue.Queue()
        self._stopped = threading.Event()
        self._outbox_address = f"inproc://outbox-{id(self)}"
        self._owner_of: dict[str, bytes] = {}  # request id -> client routing id
        self._clients: set[bytes] = set()
        self._wave = 0
        self._bound = threading.Event()
        self._draining = threading.Event()
        self._dead_error: str | None = None  # set when the core can no longer step
        self._bind_error: BaseException | None = None
        self._threads: list[threading.Thread] = []
        self._loop_thread: threading.Thread | None = None
        self.kv_events_interval_s = kv_events_interval_s
        self._kv_dirty = False  # the cache may have changed since the last batch was sent
        # requests aborted since stats last went to every client: the counts changed with
        # no output to carry them, and a client would read the old ones until a
        # heartbeat (1 s): /metrics showed a dropped storm still running (issue 62)
        self._stats_due = False
        self._kv_sent_at = 0.0  # time.monotonic() of the last batch

    # ---- life cycle ---------------------------------------------------------------------
    def start(self) -> "EngineCoreServer":
        """Run everything in background threads; returns once the socket is bound."""
        self._start_io()
        self._loop_thread = threading.Thread(target=self._core_loop, name="engine-core",
                                             daemon=True)
        self._loop_thread.start()
        return self

    def run(self) -> None:
        """Serve in the calling thread until shutdown() (or KeyboardInterrupt)."""
        self._start_io()
        try:
            self._core_loop()
        finally:
            self.shutdown()

    def alive(self) -> bool:
        """The core loop and the io thread are running."""
        threads = self._threads + ([self._loop_thread] if self._loop_thread else [])
        return (not self._stopped.is_set() and self._dead_error is None
                and all(t.is_alive() for t in threads))

    def drain(self, timeout: float, min_s: float = 0.0) -> bool:
        """Refuse new requests, let in-flight ones finish for up to `timeout` seconds, then
        abort what is left. Returns True when everything finished on its own.

        min_s: keep refusing for at least this long even when nothing is in flight, so
        that clients that have not yet seen this engine leave their routing set are told
        to go elsewhere (refused, resubmitted) instead of sending into a closed socket."""
        self._draining.set()
        start = time.monotonic()
        deadline = start + max(timeout, min_s)
        while ((self._owner_of or time.monotonic() < start + min_s)
               and time.monotonic() < deadline and self.alive()):
            time.sleep(0.05)
        left = list(self._owner_of)
        if left:
            self._inputs.put((b"", ABORT, left))
            time.sleep(0.2)  # let the loop send their abort outputs
        return not left

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the loops, close the sockets. In-flight requests are dropped."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._inputs.put(_STOP)
        self._to_encode.put(_STOP)
        for thread in self._threads + ([self._loop_thread] if self._loop_thread else []):
            if thread is not threading.current_thread():
                thread.join(timeout)
        if self._curve is not None:
            self._curve.stop()
        self._ctx.term()
        self.core.shutdown()  # tensor-parallel workers, the grammar compile thread

    def _start_io(self) -> None:
        outbox = self._ctx.socket(zmq.PULL)
        outbox.bind(self._outbox_address)
        io = threading.Thread(target=self._io_loop, args=(outbox,), name="engine-io",
                              daemon=True)
        enc = threading.Thread(target=self._encode_loop, name="engine-encode", daemon=True)
        self._threads = [io, enc]
        io.start()
        self._bound.wait()
        if self._bind_error is not None:
            self._stopped.set()
            if self._curve is not None:
                self._curve.stop()
            raise self._bind_error
        enc.start()

    # ---- io thread ----------------------------------------------------------------------
    def _io_loop(self, outbox: zmq.Socket) -> None:
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
                self._inputs.put((identity, _CLIENT_GONE, None))

    def _on_frames(self, frames: list[bytes]) -> None:
        """Decode one client message onto the input queue (errors: log + error output)."""
        if len(frames) != 3:
            logger.warning("engine %d: dropped a malformed message of %d frames",
                           self.engine_index, len(frames))
            return
        identity, kind, payload = frames
        if identity not in self._client_seen and kind != HELLO:
            self._inputs.put((identity, _CLIENT_BACK, None))  # forgotten, yet it speaks
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
        ready = _stamped(self.core.ready_response(self.engine_index))
        self._to_encode.put((identity, READY, ready))
        return True

    # ---- encoder thread -----------------------------------------------------------------
    def _encode_loop(self) -> None:
        push = self._ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(self._outbox_address)
        encoder = msgspec.msgpack.Encoder()
        try:
            while True:
                items = [self._to_encode.get()]
                while len(items) < ENCODE_BATCH and items[-1] is not _STOP:
                    try:
                        items.append(self._to_encode.get_nowait())
                    except queue.Empty:
                        break
                stop = items[-1] is _STOP
                for identity, kind, msg in coalesce(items[:-1] if stop else items):
                    push.send_multipart([identity, kind, encoder.encode(msg)])
                if stop:
                    return
        finally:
            push.close(linger=0)

    def _send(self, identity: bytes, outputs: EngineCoreOutputs) -> None:
        self._to_encode.put((identity, OUTPUTS, outputs))

    # ---- core loop ----------------------------------------------------------------------
    def _core_loop(self) -> None:
        try:
            self._loop()
        finally:  # a stopped loop is not a stuck one (alive() says it stopped)
            self.loop_watch.waiting()

    def _loop(self) -> None:
        """Each input handled and each step is a unit of work: the watch restarts after
        it. Only the wait for input stops the watch; everything else the loop does
        (its bookkeeping, the stats and KV events it gathers) counts toward the next
        unit, so a hang there shows as well."""
        core, watch = self.core, self.loop_watch
        watch.progressed()
        while not self._stopped.is_set():
            busy = core.has_unfinished_requests()
            delay = _next_delay(core) if busy else None
            if self._kv_dirty:  # wake up when the pending KV events are due
                due = max(0.0, self._kv_sent_at + self.kv_events_interval_s - time.monotonic())
                delay = due if delay is None else min(delay, due)
            if delay == 0:
                try:
                    item = self._inputs.get_nowait()
                except queue.Empty:
                    item = None
            else:
                watch.waiting()
                try:
                    item = self._inputs.get(timeout=delay)
                except queue.Empty:
                    item = None
                watch.progressed()
            while item is not None:
                if item is _STOP:
                    return
                self._handle(*item)
                watch.progressed()
                self._kv_dirty = True
                try:
                    item = self._inputs.get_nowait()
                except queue.Empty:
                    item = None
            if not (core.has_unfinished_requests() and self._dead_error is None):
                self._route([], self._due_kv_events())
            else:
                try:
                    outputs = core.step()
                except EngineDeadError as exc:  # e.g. a tensor-parallel worker died
                    # keep answering (every request now fails with this error), and
                    # report not alive, so that the replica gets restarted
                    logger.error("engine %d is dead: %s", self.engine_index, exc)
                    self._dead_error = f"EngineDeadError: {exc}"
                    outputs = self._fail_all(self._dead_error, step=False)
                except Exception:  # a broken step must not leave clients waiting forever
                    logger.exception("engine %d: step failed; failing its requests",
                                     self.engine_index)
                    outputs = self._fail_all("engine step failed")
                watch.progressed()
                self._kv_dirty = True
                self._route(outputs, self._due_kv_events())

    def _handle(self, identity: bytes, kind: bytes, msg: Any) -> None:
        if kind == ADD:
            self._adds_out += 1
            try:
                if self._dead_error is not None:
                    raise EngineDeadError(self._dead_error.removeprefix("EngineDeadError: "))
                if self._draining.is_set():
                    raise EngineDrainingError(f"engine {self.engine_index} is shutting down")
                self.core.add_request(msg)
            except (FlotillaError, ValueError) as exc:
                logger.info("engine %d: refused request %s: %s", self.engine_index,
                            msg.request_id, exc)
                self._send(identity, EngineCoreOutputs(self.engine_index, [EngineCoreOutput(
                    msg.request_id, [], FINISH_ERROR, error=f"{type(exc).__name__}: {exc}")],
                    timestamp=time.time()))
                return
            self._owner_of[msg.request_id] = identity
        elif kind == ABORT:
            self.core.abort_requests(msg)
            self._stats_due = True
        elif kind == UTILITY:  # a wake_up or add_lora that never returns shows on the watch
            result = self._call_utility(msg)
            self._send(identity, EngineCoreOutputs(
                self.engine_index, utility_output=result,
                timestamp=time.time(), scheduler_stats=self._safe_stats()))
        elif kind == START_DP_WAVE:
            self._wave = max(self._wave, msg.wave)
        elif kind == _CLIENT_GONE and identity in self._clients:
            self._clients.discard(identity)
            orphans = [r for r, owner in self._owner_of.items() if owner == identity]
            if orphans:
                logger.warning("engine %d: client %s silent for %.0fs: aborting its %d "
                               "requests", self.engine_index, identity[:8].decode(errors="replace"),
                               self.client_timeout_s, len(orphans))
                self.core.abort_requests(orphans)
                self._stats_due = True
        elif kind == HELLO:  # answered READY on the io thread already
            self._welcome(identity)
        elif kind == _CLIENT_BACK:  # it was silent past the timeout, and spoke again
            self._welcome(identity)

    def _welcome(self, identity: bytes) -> None:
        """Add a client to those that get heartbeats and KV events, starting with a
        snapshot of the prefix cache (the others first get what came before it)."""
        self._route([], self._due_kv_events(force=True))
        self._clients.add(identity)
        self._send(identity, EngineCoreOutputs(self.engine_index, timestamp=time.time(),
                                               kv_events=self.core.kv_cache_snapshot()))

    def _call_utility(self, req: UtilityRequest) -> UtilityOutput:
        if req.method not in UTILITY_METHODS:
            return UtilityOutput(req.call_id, failure_message=f"unknown method {req.method!r}")
        method = getattr(self.core, req.method, None)
        if method is None:
            return UtilityOutput(req.call_id, failure_message=(
                f"engine {self.engine_index} ({type(self.core).__name__}) does not support "
                f"{req.method!r}"))
        try:
            result = method(*req.args, **req.kwargs)
            if req.method == "ready_response":
                result = _stamped(result)
            return UtilityOutput(req.call_id, result=result)
        except Exception as exc:
            logger.warning("engine %d: utility %s failed: %s", self.engine_index, req.method, exc)
            return UtilityOutput(req.call_id, failure_message=f"{type(exc).__name__}: {exc}")

    def _due_kv_events(self, force: bool = False) -> KVEvents | None:
        """The core's KV events when a batch is due (force: now), else None."""
        if not self._kv_dirty:
            return None
        now = time.monotonic()
        if not force and now - self._kv_sent_at < self.kv_events_interval_s:
            return None
        self._kv_dirty = False
        self._kv_sent_at = now
        try:
            return self.core.take_kv_events()
        except Exception:  # events are an optimisation: never fail serving for them
            logger.exception("engine %d: could not take KV events", self.engine_index)
            return None

    def _route(self, outputs: list[EngineCoreOutput], kv_events: KVEvents | None = None
               ) -> None:
        """Send each client its requests' outputs; KV events go to every client, and
        the stats too after aborts."""
        if not outputs and kv_events is None and not self._stats_due:
            return
        per_client: dict[bytes, list[EngineCoreOutput]] = defaultdict(list)
        for out in outputs:
            identity = self._owner_of.get(out.request_id)
            if identity is None:
                continue
            if out.finish_reason is not None:
                del self._owner_of[out.request_id]
            per_client[identity].append(out)
        stats = self._safe_stats()
        now = time.time()
        for identity, outs in per_client.items():
            self._send(identity, EngineCoreOutputs(self.engine_index, outs, timestamp=now,
                                                   scheduler_stats=stats, kv_events=kv_events))
        if kv_events is not None or self._stats_due:
            self._stats_due = False
            for identity in [c for c in self._clients if c not in per_client]:
                self._send(identity, EngineCoreOutputs(self.engine_index, timestamp=now,
                                                       scheduler_stats=stats,
                                                       kv_events=kv_events))

    def _fail_all(self, message: str, step: bool = True) -> list[EngineCoreOutput]:
        ids = list(self._owner_of)
        try:
            self.core.abort_requests(ids)
            if step:
                self.core.step()
        except Exception:
            logger.exception("engine %d: could not abort after a failed step", self.engine_index)
        return [EngineCoreOutput(i, [], FINISH_ERROR, error=message) for i in ids]

    def _safe_stats(self):
        try:
            return self.core.get_stats()
        except Exception:
            return None


def _stamped(ready: EngineCoreReadyResponse) -> EngineCoreReadyResponse:
    """A core's ready response as this server sends it: with the wire's PROTOCOL_VERSION,
    which the core (below the wire) does not know."""
    return msgspec.structs.replace(ready, protocol_version=PROTOCOL_VERSION)


def _next_delay(core: EngineCoreLike) -> float:
    """How long the loop may wait for input before the next step is due."""
    value = core.next_step_delay()
    return 0 if value is None else max(0.0, value)


def _request_id_of(payload: bytes) -> str | None:
    """Best effort: the request id of an ADD payload that failed validation."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return None
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        return raw[0]
    return None
