"""EngineClient: the frontend's asyncio client for N engine-core servers.

One DEALER socket per engine. Background tasks, each with one job:
- output reader (one per engine): decodes EngineCoreOutputs (every message
  queued on the socket per wake-up), runs the OutputProcessor (detokenization,
  stop strings) and wakes the requests' consumers, which build their output when
  they run (one output for all the steps since their last); resolves utility
  calls; records the engine's stats and last-heard time.
- abort loop: drains the queue of ids to abort (dropped streams, stop-string
  matches), up to 1024 at a time, and sends one ABORT per engine; a send that
  fails is logged and retried until it goes out or its engine is declared dead.
- health monitor: an engine silent past the heartbeat timeout (or whose process
  died) is dead: its in-flight requests end with EngineDeadError and the client
  reports unhealthy, keeping the first error.
Shutdown stops them in reverse order and closes the sockets.
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from engine.core_messages import (
    FINISH_ABORT,
    FINISH_ERROR,
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    SchedulerStats,
    UtilityRequest,
)
from engine.errors import (
    DuplicateRequestError,
    EngineDeadError,
    EngineDrainingError,
    EngineOverloadedError,
    EngineRequestError,
    EngineSleepingError,
    FlotillaError,
    InvalidRequestError,
    NoEnginesError,
    PromptTooLongError,
    RequestAbortedError,
    RequestTimeoutError,
    UtilityCallError,
)
from engine.frontend.output_processor import OutputProcessor
from engine.frontend.prep_offload import PrepOffload, heavy_prompt
from engine.frontend.processor import Processor, Prompt
from engine.lora.request import LoRARequest
from engine.outputs import OutputKind, RequestOutput
from engine.pooling import PoolingParams
from engine.request_limits import RequestLimits
from engine.sampling_params import SamplingParams
from engine.structured.grammar import preload_xgrammar, wait_for_xgrammar
from engine.wire.curve_auth import ClientKeys
from engine.wire.protocol import (
    ABORT,
    ADD,
    HELLO,
    OUTPUTS,
    PING,
    PROTOCOL_VERSION,
    READY,
    UTILITY,
    Hello,
)
from engine.wire.routing import Router
from engine.wire.utility_results import all_true, consensus

logger = logging.getLogger(__name__)

ABORT_BATCH = 1024
READ_BATCH = 64  # messages read before this reader yields to the event loop (fairness cap)
SHUTDOWN_FLUSH_S = 0.05  # after the last ABORTs, before the sockets close
CLIENT_PING_S = 1.0  # PING every engine this often: an engine drops a silent client's requests
DISCONNECT_GRACE_S = 2.0  # after a TCP disconnect: time to hear from the engine (beats 1 s)
STALLED_STEP_S = 10.0  # an engine whose loop completed nothing this long gets no new request
ABORT_RETRY_S = 0.2  # wait before resending aborts whose send failed


async def _wait_until(event: asyncio.Event, deadline: float) -> bool:
    """Wait for the event until the time.monotonic() deadline; False if the deadline
    came first. (Relative: a loop's own clock, uvloop's say, need not be monotonic's.)
    The deadline sets the event itself (callers look at what it guards, and wait again
    if nothing came): a timer handle per wait, where asyncio.timeout's context manager
    cost 5-6 % of a loaded ingress replica's CPU (256 streams, session 43's profile)."""
    if event.is_set():
        return True
    timer = asyncio.get_running_loop().call_later(deadline - time.monotonic(), event.set)
    try:
        await event.wait()
    finally:
        timer.cancel()
    return time.monotonic() < deadline


def _typed_error(message: str) -> FlotillaError:
    """Rebuild the engine's typed error from its "TypeName: message" error output."""
    name, _, text = message.partition(": ")
    cls = {c.__name__: c for c in (EngineSleepingError, PromptTooLongError, EngineDrainingError,
                                   DuplicateRequestError, InvalidRequestError,
                                   EngineDeadError, EngineOverloadedError)}.get(name)
    return cls(text) if cls else EngineRequestError(message)


class HandshakeError(FlotillaError):
    """An engine did not answer HELLO in time, or answered something incompatible."""


@dataclass
class _Engine:
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


class _Stream:
    """One user request's link from the output reader to its consumer: a flag saying
    the OutputProcessor holds something new for it, or the error that ended it.
    Nothing is queued per step, so a consumer behind the engine pays once for
    everything that arrived meanwhile."""

    __slots__ = ("wake", "pending", "error")

    def __init__(self) -> None:
        self.wake = asyncio.Event()
        self.pending = False
        self.error: BaseException | None = None

    def touch(self) -> None:
        self.pending = True
        self.wake.set()

    def fail(self, error: BaseException) -> None:
        if self.error is None:  # the first error is the cause
            self.error = error
        self.wake.set()


class EngineClient:
    """Connect with `await EngineClient.connect(addresses, tokenizer)`."""

    def __init__(self) -> None:  # use connect()
        self.engines: list[_Engine] = []
        self.client_id = uuid.uuid4().hex
        self._ctx: zmq.asyncio.Context | None = None
        self.processor: Processor | None = None
        self.output_processor: OutputProcessor | None = None
        self._streams: dict[str, _Stream] = {}  # user request id -> its consumer's link
        self.requests_submitted = 0  # ever, so that a poll sees requests that came and went
        self._parent_of: dict[str, str] = {}  # engine request id -> user request id
        self._engine_of: dict[str, int] = {}  # engine request id -> engine index
        self._utility_waiters: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._abort_queue: asyncio.Queue = asyncio.Queue()
        self.abort_causes: Counter = Counter()  # why requests were aborted (metrics, tests)
        self.abort_messages_sent = 0
        self.abort_send_failures = 0  # ABORT sends that raised (each is retried)
        self._tasks: list[asyncio.Task] = []
        self._rr = itertools.count()
        self.router = Router()  # routing policy, prefix index, sessions (engine/wire/routing.py)
        self.dead_error: EngineDeadError | None = None
        self.heartbeat_timeout_s = 10.0
        self.stalled_step_s = STALLED_STEP_S
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._closed = False
        self.prep = PrepOffload()  # CPU-heavy request preparation off the event loop

    # ---- set-up -------------------------------------------------------------------------
    @classmethod
    async def connect(cls, addresses: list[str], tokenizer=None, *,
                      handshake_timeout_s: float = 30.0, heartbeat_timeout_s: float = 10.0,
                      is_alive: list[Callable[[], bool]] | None = None,
                      routing: str = "prefix",
                      keys: dict[str, ClientKeys] | None = None,
                      stalled_step_s: float = STALLED_STEP_S) -> "EngineClient":
        """Handshake with every engine; the READY values configure the client.
        tokenizer: the model's; None makes a client for utility calls and liveness only
        (the coordinator's: loading a tokenizer costs seconds of CPU and ~100 MiB).
        routing: "prefix" | "least_loaded" | "round_robin" (engine/wire/routing.py).
        keys: address -> the CURVE keys of an engine that serves over CURVE
        (engine/wire/curve_auth.py); an address without them is connected in the clear.
        stalled_step_s: an engine whose heartbeat says its step has run this long gets no
        new request while another engine can take it (it stays connected: its running
        requests go on, and Serve's health check replaces it if the step never ends)."""
        if not addresses:
            raise NoEnginesError("no engine addresses given")
        if tokenizer is not None:
            preload_xgrammar()  # beside the handshakes; done before the first requests
        self = cls()
        self.router = Router(routing)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.stalled_step_s = stalled_step_s
        self._ctx = zmq.asyncio.Context()
        keys = keys or {}
        handshakes = [asyncio.ensure_future(self._handshake(i, a, handshake_timeout_s,
                                                            keys.get(a)))
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
            self.engines.append(_Engine(i, address, socket, ready, time.monotonic(),
                                        is_alive=alive))
        sizes = {r.block_size for _, r in readies}
        if len(sizes) != 1:
            await self._close_sockets()
            raise HandshakeError(f"engines disagree on block_size: {sorted(sizes)}")
        self.router.block_size = sizes.pop()
        if tokenizer is not None:
            await asyncio.to_thread(wait_for_xgrammar)
            limits = [r.limits or RequestLimits.defaults() for _, r in readies]
            self.processor = Processor(tokenizer, self.max_model_len, len(tokenizer),
                                       min(r.max_logprobs for _, r in readies),
                                       functools.reduce(RequestLimits.tightest, limits))
            self.output_processor = OutputProcessor(tokenizer)
        # the model's sampling defaults, from the first engine (they all serve one model)
        self.sampling_defaults: dict[str, int | float] = dict(readies[0][1].sampling_defaults)
        # what every engine can do ("generate", "embed")
        self.supported_tasks: list[str] = [t for t in readies[0][1].supported_tasks
                                           if all(t in r.supported_tasks for _, r in readies)]
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read_outputs(e), name=f"engine-{e.index}-reader")
                       for e in self.engines]
        self._tasks.append(loop.create_task(self._abort_loop(), name="abort-loop"))
        self._tasks.append(loop.create_task(self._ping_loop(), name="ping-loop"))
        self._tasks.append(loop.create_task(self._monitor_health(), name="health-monitor"))
        self._tasks += [loop.create_task(self._watch_connection(e), name=f"engine-{e.index}-tcp")
                        for e in self.engines]
        return self

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

    @property
    def num_in_flight(self) -> int:
        """User requests still streaming through this client."""
        return len(self._streams)

    @property
    def healthy(self) -> bool:
        return self.dead_error is None and not self._closed

    # ---- generation -----------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: Prompt, params: SamplingParams, *,
                       data_parallel_rank: int | None = None,
                       kind: OutputKind = OutputKind.DELTA,
                       pooling_params: PoolingParams | None = None,
                       lora_request: LoRARequest | None = None,
                       priority: int = 0, deadline: float | None = None,
                       session_id: str | None = None,
                       trace_headers: dict[str, str] | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; stopping the iteration early aborts it.
        pooling_params: an embedding request, whose one output carries the vector;
        lora_request: the adapter it runs with; priority: its place in the engine's
        queue under scheduling_policy "priority"; deadline: a time.monotonic() value
        after which the request is aborted at its engine and RequestTimeoutError is
        raised (what was streamed before stays delivered); session_id: requests of one
        session go to one engine while it is live (engine/wire/routing.py);
        trace_headers: the W3C context whose child the engine's span is (engine/tracing.py)."""
        if self.dead_error is not None:
            raise self.dead_error
        if pooling_params is not None and "embed" not in self.supported_tasks:
            raise InvalidRequestError("the served engines do not compute embeddings "
                                      f"(they support: {', '.join(self.supported_tasks)})")
        if request_id in self._streams:
            raise EngineRequestError(f"request id {request_id!r} is already running")
        text, ids, requests = await self.prep.run(
            heavy_prompt(prompt, params), self._prepare, request_id, prompt, params,
            priority=priority, data_parallel_rank=data_parallel_rank,
            pooling_params=pooling_params, lora_request=lora_request)
        if self._closed:  # shut down while it was prepared
            raise EngineDeadError("the client was shut down")
        if request_id in self._streams:  # the same id came in while it was prepared
            raise EngineRequestError(f"request id {request_id!r} is already running")
        if trace_headers:
            for r in requests:
                r.trace_headers = trace_headers
        lora_id = None if lora_request is None else lora_request.lora_int_id
        hashes = self.router.block_hashes(ids, lora_request)
        finished = yielded = False
        abort_cause = "client_disconnect"
        while True:  # again only when a draining engine refused it, or a dead one had
            # given it no token yet
            engine, uncached = self._route(data_parallel_rank, lora_id, len(ids), hashes,
                                           session_id)
            if lora_id is not None:
                engine.adapters.add(lora_id)
            stream = self._submit(request_id, text, requests, kind, engine)
            self.router.submitted(engine.index, requests[0].request_id, uncached, hashes)
            try:
                for r in requests:
                    await engine.socket.send_multipart([ADD, self._encoder.encode(r)])
                metrics = self.output_processor.metrics_of(request_id)
                if metrics is not None:
                    metrics.engine_submit_time = time.time()
                while True:
                    if deadline is None:
                        await stream.wake.wait()
                    elif (time.monotonic() >= deadline
                          or not await _wait_until(stream.wake, deadline)):
                        abort_cause = "deadline"
                        raise RequestTimeoutError(
                            f"request {request_id} passed its deadline and was aborted",
                            request_id, len(ids))
                    stream.wake.clear()
                    if stream.pending:  # what arrived first is delivered before an error
                        stream.pending = False
                        item = self.output_processor.take_output(request_id)
                        if item is not None:
                            finished = item.finished
                            if finished and any(c.finish_reason == FINISH_ABORT
                                                for c in item.outputs):
                                raise RequestAbortedError(
                                    f"request {request_id} was stopped by its engine before "
                                    "it finished (the engine is draining, asleep or reset "
                                    "its running requests); send it again")
                            yielded = True
                            yield item
                            if finished:
                                return
                    error = stream.error
                    if error is None:
                        continue
                    if isinstance(error, (EngineDrainingError, EngineDeadError)) and \
                            not yielded and data_parallel_rank is None and \
                            self._others_than(engine):
                        # nothing came from it yet: another engine takes the request (a
                        # dead one's copy is aborted, should it only have gone quiet)
                        if isinstance(error, EngineDrainingError):
                            engine.draining = True  # shutting down: go to another engine
                        else:
                            abort_cause = "resubmitted"
                        break
                    # an engine declared dead may only have gone quiet: its request still
                    # runs there and is aborted (now, or when it speaks again)
                    finished = not isinstance(error, EngineDeadError)
                    abort_cause = "engine_dead"
                    raise error
            finally:
                unfinished = self.output_processor.abort_requests([request_id])
                if not finished and (yielded or not engine.draining):
                    for engine_id in unfinished:
                        self._queue_abort(engine_id, abort_cause)
                self._forget(request_id, requests)

    def _prepare(self, request_id: str, prompt: Prompt, params: SamplingParams, **kwargs
                 ) -> tuple[str | None, list[int], list]:
        """Tokenize and check a request: (its prompt text, ids, EngineCoreRequests)."""
        if self.processor is None:
            raise RuntimeError("this EngineClient was connected without a tokenizer: it "
                               "makes utility calls only")
        text, ids = self.processor.tokenize(prompt)
        return text, ids, self.processor.make_requests(request_id, ids, params, **kwargs)

    def _submit(self, request_id: str, text, requests, kind: OutputKind,
                engine: _Engine) -> _Stream:
        """Register a request's stream and engine before its ADDs go out."""
        stream = _Stream()
        self._streams[request_id] = stream
        self.requests_submitted += 1
        self.output_processor.add_request(request_id, text, requests, kind)
        for r in requests:
            self._parent_of[r.request_id] = request_id
            self._engine_of[r.request_id] = engine.index
            engine.in_flight += 1
        return stream

    def _others_than(self, engine: _Engine) -> bool:
        return any(e is not engine and not e.dead and not e.draining for e in self.engines)

    def _route(self, rank: int | None, lora_id: int | None, num_tokens: int,
               hashes: list[int], session_id: str | None) -> tuple[_Engine, int]:
        """(engine, prompt tokens it will prefill, about) for a request: the named rank,
        else the session's engine while it is live and staying, else the policy's
        choice (then pinned to the session)."""
        if rank is None and session_id is not None:
            staying = [e for e in self.engines if not e.dead and not e.draining]
            engine = self.router.session_engine(session_id, staying)
            if engine is not None:
                return engine, num_tokens - self.router.block_size * \
                    self.router.index.cached_prefix(engine.index, hashes)
        engine, uncached = self._pick(rank, lora_id, num_tokens, hashes)
        if rank is None:
            self.router.remember_session(session_id, engine)
        return engine, uncached

    def _pick(self, rank: int | None, lora_id: int | None = None, num_tokens: int = 0,
              hashes: list[int] = ()) -> tuple[_Engine, int]:
        """(engine, its prefill tokens) for a request: the named rank, else the routing
        policy's choice (prefix-cache cost, least loaded or round robin), except that a
        request with an adapter goes to an engine it was sent to before (which holds it
        in a slot or its host cache) unless that one is overloaded: more than max(2, a
        quarter of the least load) requests above the chosen one."""
        def uncached(e: _Engine) -> int:
            return num_tokens - self.router.block_size * self.router.index.cached_prefix(
                e.index, hashes)
        alive = [e for e in self.engines if not e.dead and not e.draining] or \
            [e for e in self.engines if not e.dead]
        alive = [e for e in alive if e.step_running_s < self.stalled_step_s] or alive
        if rank is not None:
            if not 0 <= rank < len(self.engines):
                raise InvalidRequestError(
                    f"data_parallel_rank {rank} out of range [0, {len(self.engines)})")
            if self.engines[rank].dead:
                raise self.dead_error or EngineDeadError(f"engine {rank} is dead")
            return self.engines[rank], uncached(self.engines[rank])
        if not alive:
            raise self.dead_error or NoEnginesError("no live engine")
        turn = next(self._rr)

        def score(e: _Engine) -> tuple:
            waiting = e.stats.num_waiting_reqs if e.stats else 0
            return (e.in_flight + waiting, (e.index - turn) % len(self.engines))
        best, best_uncached = self.router.choose(alive, lambda e: score(e)[0], num_tokens,
                                                 hashes)
        if lora_id is not None and lora_id not in best.adapters:
            holders = [e for e in alive if lora_id in e.adapters]
            if holders:
                holder = min(holders, key=score)
                least = score(best)[0]
                if score(holder)[0] <= least + max(2, least // 4):
                    return holder, uncached(holder)
        return best, best_uncached

    def _forget(self, request_id: str, requests) -> None:
        self._streams.pop(request_id, None)
        for r in requests:
            self._parent_of.pop(r.request_id, None)
            self.router.forget(r.request_id)
            index = self._engine_of.pop(r.request_id, None)
            if index is not None:
                self.engines[index].in_flight -= 1

    async def abort(self, request_ids: list[str]) -> None:
        """Abort user requests now: one ABORT message per engine."""
        if self.output_processor is None:  # a utilities-only client has no requests
            return
        engine_ids = self.output_processor.abort_requests(request_ids)
        for request_id in request_ids:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.fail(EngineRequestError(f"request {request_id} was aborted"))
        unsent = await self._send_aborts([(i, self._engine_of.get(i), "explicit")
                                          for i in engine_ids])
        for engine_id, index in unsent:  # the abort loop retries them
            self._abort_queue.put_nowait((engine_id, index, None))

    # ---- utilities --------------------------------------------------------------------------
    async def call_utility(self, method: str, *args: Any, timeout: float = 60.0,
                           **kwargs: Any) -> list[Any]:
        """Call `method` on every live engine; results in engine order."""
        engines = [e for e in self.engines if not e.dead]
        if not engines:
            raise self.dead_error or NoEnginesError(f"no engine to call {method}")
        loop = asyncio.get_running_loop()
        calls = []
        for e in engines:
            call_id = next(self._call_ids)
            fut = loop.create_future()
            self._utility_waiters[call_id] = fut
            calls.append((e, call_id, fut))
            msg = UtilityRequest(call_id, method, list(args), dict(kwargs))
            await e.socket.send_multipart([UTILITY, self._encoder.encode(msg)])
        try:
            done = await asyncio.wait_for(asyncio.gather(*(f for _, _, f in calls),
                                                         return_exceptions=True), timeout)
        finally:
            for _, call_id, _ in calls:
                self._utility_waiters.pop(call_id, None)
        failures = [f"engine {e.index}: {r}" for (e, _, _), r in zip(calls, done)
                    if isinstance(r, BaseException)]
        if failures:
            raise UtilityCallError(f"{method} failed on " + "; ".join(failures))
        return list(done)

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Load an adapter on every engine; UtilityCallError names the engines that
        failed (those that succeeded keep it, so a retry after a fix is harmless)."""
        await self.call_utility("add_lora", lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter everywhere; False if no engine had it."""
        for e in self.engines:
            e.adapters.discard(lora_id)
        return any(await self.call_utility("remove_lora", lora_id))

    async def list_loras(self) -> list[LoRARequest]:
        """The adapters loaded by name on every live engine (one that some engine
        lacks, after a partly failed load, is not listed, so loading it again is
        allowed and fills the gap)."""
        found = [{msgspec.convert(r, LoRARequest) for r in rs}
                 for rs in await self.call_utility("list_loras")]
        common = set.intersection(*found) if found else set()
        return sorted(common, key=lambda r: r.lora_int_id)

    async def get_stats(self) -> list[SchedulerStats]:
        """Every live engine's scheduler stats, fresh (not the last ones seen with
        outputs); kept as each engine's `stats` too."""
        engines = [e for e in self.engines if not e.dead]
        stats = [msgspec.convert(v, SchedulerStats)
                 for v in await self.call_utility("get_stats")]
        now = time.monotonic()
        for e, s in zip(engines, stats):
            e.stats, e.stats_at = s, now
        return stats

    async def refresh_stats(self, max_age_s: float, timeout_s: float) -> None:
        """Make every live engine's `stats` at most `max_age_s` old: asks the engines
        only when one is older (outputs and heartbeats bring stats at least every
        heartbeat interval, so a scrape rarely waits on a busy engine's loop)."""
        now = time.monotonic()
        if all(now - e.stats_at <= max_age_s for e in self.engines if not e.dead):
            return
        await asyncio.wait_for(self.get_stats(), timeout_s)

    async def is_sleeping(self) -> bool:
        return consensus("is_sleeping", await self.call_utility("is_sleeping"))

    async def reset_prefix_cache(self, reset_running_requests: bool = False,
                                 reset_connector: bool = False) -> bool:
        return all_true("reset_prefix_cache", await self.call_utility(
            "reset_prefix_cache", reset_running_requests, reset_connector))

    # ---- background loops -------------------------------------------------------------------
    async def _read_outputs(self, engine: _Engine) -> None:
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

    def _on_message(self, engine: _Engine, frames: list[bytes]) -> None:
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
        if msg.utility_output is not None:
            self._resolve_utility(msg.utility_output)
        if msg.kv_events is not None and not engine.dead:
            self.router.on_kv_events(engine.index, msg.kv_events)
        if msg.outputs:
            for out in msg.outputs:  # its prefill is done: no longer queued there
                self.router.on_output(out.request_id)
            self._dispatch(msg.outputs, msg.timestamp, engine.index)

    def _resolve_utility(self, out) -> None:
        fut = self._utility_waiters.get(out.call_id)
        if fut is None or fut.done():
            return
        if out.failure_message is not None:
            fut.set_exception(UtilityCallError(out.failure_message))
        else:
            fut.set_result(out.result)

    def _dispatch(self, outputs, engine_timestamp: float | None = None,
                  engine_index: int | None = None) -> None:
        if self.output_processor is None:  # a utilities-only client has no requests
            return
        normal = []
        for out in outputs:
            if engine_index is not None and self._engine_of.get(out.request_id) != engine_index:
                continue  # stale: the request was resubmitted elsewhere, or is gone
            if out.finish_reason == FINISH_ERROR:
                parent = self._parent_of.get(out.request_id)
                if parent is None:
                    continue
                for engine_id in self.output_processor.abort_requests([parent]):
                    if engine_id != out.request_id:
                        self._queue_abort(engine_id, "sibling_error")
                error = _typed_error(out.error or "the engine refused the request")
                index = self._engine_of.get(out.request_id)
                if isinstance(error, EngineDeadError) and index is not None:
                    if not self.engines[index].dead:  # the engine says it cannot go on
                        self._mark_dead(self.engines[index], str(error))
                    continue
                stream = self._streams.get(parent)
                if stream is not None:
                    stream.fail(error)
            else:
                normal.append(out)
        updated = self.output_processor.update(normal, engine_timestamp)
        for engine_id in updated.reqs_to_abort:
            self._queue_abort(engine_id, "stop_string")
        for request_id in updated.request_ids:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.touch()

    def _queue_abort(self, engine_id: str, cause: str) -> None:
        """Hand an id to the abort loop (which coalesces bursts into one ABORT per engine)."""
        self._abort_queue.put_nowait((engine_id, self._engine_of.get(engine_id), cause))

    async def _abort_loop(self) -> None:
        """Runs until shutdown: an abort that is not sent leaves a request generating on
        its engine for nothing, so no error ends this loop. Ids whose send failed go
        back to the queue after ABORT_RETRY_S (cause None: counted once already)."""
        while True:
            try:
                batch = [await self._abort_queue.get()]
                while len(batch) < ABORT_BATCH:
                    try:
                        batch.append(self._abort_queue.get_nowait())
                    except asyncio.QueueEmpty:
                        break
                unsent = await self._send_aborts(batch)
                if unsent:  # queued again first: a shutdown meanwhile still sends them
                    for engine_id, index in unsent:
                        self._abort_queue.put_nowait((engine_id, index, None))
                    await asyncio.sleep(ABORT_RETRY_S)
            except asyncio.CancelledError:
                return
            except Exception:  # a bug here must not stop every later abort
                logger.exception("abort loop: unexpected error; continuing")

    async def _send_aborts(self, items: list[tuple[str, int | None, str | None]]
                           ) -> list[tuple[str, int]]:
        """One ABORT per engine; returns the (id, engine) pairs whose send failed."""
        per_engine: dict[int, list[str]] = defaultdict(list)
        for engine_id, index, cause in items:
            if cause is not None:
                self.abort_causes[cause] += 1
            if index is not None:
                per_engine[index].append(engine_id)
        unsent = []
        for index, ids in per_engine.items():
            engine = self.engines[index]
            if engine.dead:  # kept: a quiet engine that speaks again gets them then
                engine.pending_aborts.extend(ids)
                continue
            try:  # NOBLOCK: at the high-water mark an awaited send would stall every
                # engine's aborts behind this one; Again is retried instead
                await engine.socket.send_multipart([ABORT, self._encoder.encode(ids)],
                                                   flags=zmq.NOBLOCK)
                self.abort_messages_sent += 1
            except Exception as exc:  # zmq.Again past the high-water mark, ZMQError, ...
                self.abort_send_failures += 1
                logger.warning("aborting %d requests at engine %d failed (%s: %s); retrying "
                               "in %.1fs", len(ids), index, type(exc).__name__, exc,
                               ABORT_RETRY_S)
                unsent += [(i, index) for i in ids]
        return unsent

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

    async def _watch_connection(self, engine: _Engine) -> None:
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

    def _revive(self, engine: _Engine) -> None:
        """An engine declared dead for its silence spoke again (a stopped process
        resumed, a network blip ended): route to it again, and send it the aborts of
        the requests whose streams failed meanwhile, which it would otherwise decode to
        max_tokens."""
        if engine.is_alive is not None and not engine.is_alive():
            return
        engine.dead = engine.silent = False
        logger.warning("engine %d at %s answers again: back in service (%d aborts sent)",
                       engine.index, engine.address, len(engine.pending_aborts))
        for engine_id in engine.pending_aborts:
            self._abort_queue.put_nowait((engine_id, engine.index, None))
        engine.pending_aborts = []
        if not any(e.dead for e in self.engines):
            self.dead_error = None

    def _mark_dead(self, engine: _Engine, why: str) -> None:
        engine.dead = True
        self.router.engine_gone(engine.index)  # its prefix cache died with it
        error = EngineDeadError(f"engine {engine.index} at {engine.address} is dead: {why}")
        if self.dead_error is None:
            self.dead_error = error
        logger.error("%s", error)
        for engine_id, index in list(self._engine_of.items()):
            if index == engine.index:
                parent = self._parent_of.get(engine_id)
                stream = self._streams.get(parent) if parent else None
                if stream is not None:
                    stream.fail(error)
        for call_id, fut in list(self._utility_waiters.items()):
            if not fut.done():
                fut.set_exception(error)

    # ---- shutdown ---------------------------------------------------------------------------
    async def shutdown(self) -> None:
        """Stop the background tasks (monitor, abort loop, readers), close the sockets."""
        if self._closed:
            return
        self._closed = True
        self.prep.shutdown()
        for task in reversed(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for stream in self._streams.values():
            stream.fail(EngineDeadError("the client was shut down"))
        if await self._abort_everything_owned():
            await asyncio.sleep(SHUTDOWN_FLUSH_S)  # ZMQ's io thread sends them meanwhile
        await self._close_sockets()

    async def _abort_everything_owned(self) -> bool:
        """At shutdown (a retired client, a replica going away): abort at the engines what
        this client still has running there or queued to abort, which would otherwise
        run on with nobody to read it. Whether any ABORT went out."""
        owned: dict[int, list[str]] = defaultdict(list)
        for engine_id, index in self._engine_of.items():
            owned[index].append(engine_id)
        while not self._abort_queue.empty():
            engine_id, index, _ = self._abort_queue.get_nowait()
            if index is not None:
                owned[index].append(engine_id)
        for engine in self.engines:
            owned[engine.index] += engine.pending_aborts
        sent = False
        for index, ids in owned.items():
            if not ids:
                continue
            try:
                await self.engines[index].socket.send_multipart(
                    [ABORT, self._encoder.encode(sorted(set(ids)))], flags=zmq.NOBLOCK)
                sent = True
            except zmq.ZMQError:
                pass  # the engine's own client timeout ends them
        return sent

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
