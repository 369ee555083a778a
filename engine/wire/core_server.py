"""EngineCoreServer: one engine core behind a ZMQ ROUTER socket (tcp:// or ipc://).

Threads, so that socket work never runs on the model thread:
- io thread (engine/wire/server_io.py): owns the ROUTER socket; receives and decodes
  client frames onto the input queue; forwards encoded outputs from the outbox to their
  client; sends a heartbeat (stats only) to every client when the engine has been quiet
  for a while, and hands the core loop each client silent past client_timeout_s
  (engine/wire/server_clients.py).
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
EngineCore, or the model-free MockEngineCore (engine/mock/core.py). Utilities a client
calls by name are engine/wire/utility_calls.py's.

This module keeps the server's life cycle, the encoder thread and the core loop; every
call it makes on its core is one EngineCoreLike lists (tests/test_core_interface.py reads
them off this file). A refused request is logged and answered with an error output; the
server keeps serving.
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
from engine.core_messages import FINISH_ERROR, EngineCoreOutput, EngineCoreOutputs, KVEvents
from engine.errors import EngineDeadError, EngineDrainingError, FlotillaError
from engine.wire.coalesce import coalesce
from engine.wire.curve_auth import CurveServer, EngineKeys
from engine.wire.loop_watch import LoopWatch
from engine.wire.protocol import ABORT, ADD, HELLO, OUTPUTS, START_DP_WAVE, UTILITY
from engine.wire.server_clients import (
    CLIENT_BACK,
    CLIENT_GONE,
    CLIENT_TIMEOUT_S,
    HEARTBEAT_INTERVAL_S,
)
from engine.wire.server_io import ServerIO
from engine.wire.utility_calls import UTILITY_METHODS, call_utility  # noqa: F401 (re-exported)

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


class EngineCoreServer(ServerIO):
    """Serves `core` (an EngineCore or a MockEngineCore) at `address`. The io thread's
    methods are ServerIO's, client liveness and heartbeats ClientTracking's (its base)."""

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
            result = call_utility(self.core, self.engine_index, msg)
            self._send(identity, EngineCoreOutputs(
                self.engine_index, utility_output=result,
                timestamp=time.time(), scheduler_stats=self._safe_stats()))
        elif kind == START_DP_WAVE:
            self._wave = max(self._wave, msg.wave)
        elif kind == CLIENT_GONE:
            self._drop_client(identity)
        elif kind == HELLO:  # answered READY on the io thread already
            self._welcome(identity)
        elif kind == CLIENT_BACK:  # it was silent past the timeout, and spoke again
            self._welcome(identity)

    def _welcome(self, identity: bytes) -> None:
        """Add a client to those that get heartbeats and KV events, starting with a
        snapshot of the prefix cache (the others first get what came before it)."""
        self._route([], self._due_kv_events(force=True))
        self._clients.add(identity)
        self._send(identity, EngineCoreOutputs(self.engine_index, timestamp=time.time(),
                                               kv_events=self.core.kv_cache_snapshot()))

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


def _next_delay(core: EngineCoreLike) -> float:
    """How long the loop may wait for input before the next step is due."""
    value = core.next_step_delay()
    return 0 if value is None else max(0.0, value)
