"""EngineClient: the frontend's asyncio client for N engine-core servers.

The public face (connect, generate, abort, the utility calls, shutdown) and the glue
between the parts it is composed of, each its own module:
- engine/wire/engine_set.py (its base class): connection and handshake, membership
  and health (heartbeats, pings, dropped connections, revival), the output readers;
- engine/wire/inflight.py: one record per in-flight request (its stream, its engine,
  its engine request ids) and the delivery of outputs to it;
- engine/wire/aborts.py: the abort loop (one ABORT per engine per pass, retried);
- engine/wire/utilities.py: utility calls fanned out to every engine, LoRA fan-out;
- engine/wire/placement.py (over routing.py's policy): which engine a request goes to.
What stays here is what ties them: a request is routed, registered, sent and streamed
(resubmitted elsewhere when its engine drains or dies before any output), and an engine
that dies fails its requests and utility calls. Shutdown stops the background tasks in
reverse order and closes the sockets.
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any, AsyncIterator, Callable

from engine.core_messages import FINISH_ABORT, EngineCoreOutputs, SchedulerStats
from engine.errors import (
    EngineDeadError,
    EngineDrainingError,
    EngineRequestError,
    InvalidRequestError,
    NoEnginesError,
    RequestAbortedError,
    RequestTimeoutError,
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
from engine.wire import placement, utilities
from engine.wire.aborts import AbortSender
from engine.wire.curve_auth import ClientKeys
from engine.wire.engine_set import STALLED_STEP_S, EngineLink, EngineSet, HandshakeError
from engine.wire.inflight import InFlight, InFlightRequest
from engine.wire.protocol import ADD
from engine.wire.routing import Router

__all__ = ["EngineClient", "HandshakeError"]

SHUTDOWN_FLUSH_S = 0.05  # after the last ABORTs, before the sockets close


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


class EngineClient(EngineSet):
    """Connect with `await EngineClient.connect(addresses, tokenizer)`."""

    def __init__(self) -> None:  # use connect()
        super().__init__()
        self.processor: Processor | None = None
        self.output_processor: OutputProcessor | None = None
        self._inflight = InFlight()  # one record per user request, by either id
        self.requests_submitted = 0  # ever, so that a poll sees requests that came and went
        self.utility_calls = utilities.UtilityCalls(self)
        self.aborts = AbortSender(self)
        self._tasks: list[asyncio.Task] = []
        self._rr = itertools.count()
        self.router = Router()  # routing policy, prefix index, sessions (engine/wire/routing.py)
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
        readies = await self._join(addresses, handshake_timeout_s, is_alive, keys or {})
        self.router.block_size = readies[0].block_size
        if tokenizer is not None:
            await asyncio.to_thread(wait_for_xgrammar)
            limits = [r.limits or RequestLimits.defaults() for r in readies]
            self.processor = Processor(tokenizer, self.max_model_len, len(tokenizer),
                                       min(r.max_logprobs for r in readies),
                                       functools.reduce(RequestLimits.tightest, limits))
            self.output_processor = OutputProcessor(tokenizer)
        # the model's sampling defaults, from the first engine (they all serve one model)
        self.sampling_defaults: dict[str, int | float] = dict(readies[0].sampling_defaults)
        # what every engine can do ("generate", "embed")
        self.supported_tasks: list[str] = [t for t in readies[0].supported_tasks
                                           if all(t in r.supported_tasks for r in readies)]
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read_outputs(e), name=f"engine-{e.index}-reader")
                       for e in self.engines]
        self._tasks.append(loop.create_task(self.aborts.run(), name="abort-loop"))
        self._tasks.append(loop.create_task(self._ping_loop(), name="ping-loop"))
        self._tasks.append(loop.create_task(self._monitor_health(), name="health-monitor"))
        self._tasks += [loop.create_task(self._watch_connection(e), name=f"engine-{e.index}-tcp")
                        for e in self.engines]
        return self

    # ---- what the client holds ------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        """User requests still streaming through this client."""
        return len(self._inflight)

    @property
    def healthy(self) -> bool:
        return self.dead_error is None and not self._closed

    @property
    def _engine_of(self) -> Mapping[str, int]:
        """engine request id -> engine index, read-only (where a request runs)."""
        return self._inflight.engine_index

    @property
    def abort_causes(self) -> Counter:
        """Why requests were aborted (metrics, tests)."""
        return self.aborts.causes

    @property
    def abort_messages_sent(self) -> int:
        return self.aborts.messages_sent

    @property
    def abort_send_failures(self) -> int:
        """ABORT sends that raised (each is retried)."""
        return self.aborts.send_failures

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
        if request_id in self._inflight:
            raise EngineRequestError(f"request id {request_id!r} is already running")
        text, ids, requests = await self.prep.run(
            heavy_prompt(prompt, params), self._prepare, request_id, prompt, params,
            priority=priority, data_parallel_rank=data_parallel_rank,
            pooling_params=pooling_params, lora_request=lora_request)
        if self._closed:  # shut down while it was prepared
            raise EngineDeadError("the client was shut down")
        if request_id in self._inflight:  # the same id came in while it was prepared
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
                engine: EngineLink) -> InFlightRequest:
        """Register a request's record and engine before its ADDs go out."""
        record = self._inflight.add(request_id, tuple(r.request_id for r in requests),
                                    engine.index)
        self.requests_submitted += 1
        self.output_processor.add_request(request_id, text, requests, kind)
        engine.in_flight += len(requests)
        return record

    # ---- where it goes (engine/wire/placement.py) ------------------------------------------
    def _others_than(self, engine: EngineLink) -> bool:
        return placement.others_than(self, engine)

    def _route(self, rank: int | None, lora_id: int | None, num_tokens: int,
               hashes: list[int], session_id: str | None) -> tuple[EngineLink, int]:
        return placement.route(self, self.router, self._rr, rank, lora_id, num_tokens,
                               hashes, session_id)

    def _pick(self, rank: int | None, lora_id: int | None = None, num_tokens: int = 0,
              hashes: list[int] = ()) -> tuple[EngineLink, int]:
        return placement.pick(self, self.router, self._rr, rank, lora_id, num_tokens, hashes)

    def _forget(self, request_id: str, requests) -> None:
        record = self._inflight.remove(request_id)
        for r in requests:
            self.router.forget(r.request_id)
        if record is not None:
            self.engines[record.engine].in_flight -= len(record.engine_ids)

    def _queue_abort(self, engine_id: str, cause: str) -> None:
        """Hand an id to the abort loop (which coalesces bursts into one ABORT per engine)."""
        self.aborts.queue(engine_id, self._inflight.engine_of(engine_id), cause)

    async def abort(self, request_ids: list[str]) -> None:
        """Abort user requests now: one ABORT message per engine."""
        if self.output_processor is None:  # a utilities-only client has no requests
            return
        engine_ids = self.output_processor.abort_requests(request_ids)
        for request_id in request_ids:
            record = self._inflight.get(request_id)
            if record is not None:
                record.fail(EngineRequestError(f"request {request_id} was aborted"))
        unsent = await self.aborts.send([(i, self._inflight.engine_of(i), "explicit")
                                         for i in engine_ids])
        for engine_id, index in unsent:  # the abort loop retries them
            self.aborts.queue(engine_id, index, None)

    # ---- utilities (engine/wire/utilities.py) -----------------------------------------------
    async def call_utility(self, method: str, *args: Any, timeout: float = 60.0,
                           **kwargs: Any) -> list[Any]:
        """Call `method` on every live engine; results in engine order."""
        return await self.utility_calls.call(method, *args, timeout=timeout, **kwargs)

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Load an adapter on every engine (utilities.add_lora)."""
        await utilities.add_lora(self.call_utility, lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter everywhere; False if no engine had it."""
        return await utilities.remove_lora(self, self.call_utility, lora_id)

    async def list_loras(self) -> list[LoRARequest]:
        """The adapters loaded by name on every live engine (utilities.list_loras)."""
        return await utilities.list_loras(self.call_utility)

    async def get_stats(self) -> list[SchedulerStats]:
        """Every live engine's scheduler stats, fresh; kept as each engine's `stats` too."""
        return await utilities.get_stats(self, self.call_utility)

    async def refresh_stats(self, max_age_s: float, timeout_s: float) -> None:
        """Make every live engine's `stats` at most `max_age_s` old: asks the engines
        only when one is older."""
        if utilities.stats_are_fresh(self, max_age_s):
            return
        await asyncio.wait_for(self.get_stats(), timeout_s)

    async def is_sleeping(self) -> bool:
        return await utilities.is_sleeping(self.call_utility)

    async def reset_prefix_cache(self, reset_running_requests: bool = False,
                                 reset_connector: bool = False) -> bool:
        return await utilities.reset_prefix_cache(self.call_utility, reset_running_requests,
                                                  reset_connector)

    # ---- what the engines tell (EngineSet's hooks) ------------------------------------------
    def _engine_message(self, engine: EngineLink, msg: EngineCoreOutputs) -> None:
        if msg.utility_output is not None:
            self.utility_calls.resolve(msg.utility_output)
        if msg.kv_events is not None and not engine.dead:
            self.router.on_kv_events(engine.index, msg.kv_events)
        if msg.outputs:
            for out in msg.outputs:  # its prefill is done: no longer queued there
                self.router.on_output(out.request_id)
            self._dispatch(msg.outputs, msg.timestamp, engine.index)

    def _dispatch(self, outputs, engine_timestamp: float | None = None,
                  engine_index: int | None = None) -> None:
        if self.output_processor is None:  # a utilities-only client has no requests
            return
        self._inflight.deliver(outputs, self.output_processor, engine_timestamp, engine_index,
                               self._queue_abort, self._engine_says_dead)

    def _engine_says_dead(self, index: int, error: EngineDeadError) -> None:
        """An error output says the engine cannot go on."""
        if not self.engines[index].dead:
            self._mark_dead(self.engines[index], str(error))

    def _engine_died(self, engine: EngineLink, error: EngineDeadError) -> None:
        self.router.engine_gone(engine.index)  # its prefix cache died with it
        for record in self._inflight.on_engine(engine.index):
            record.fail(error)
        self.utility_calls.fail_all(error)

    def _engine_revived(self, engine: EngineLink) -> None:
        for engine_id in engine.pending_aborts:
            self.aborts.queue(engine_id, engine.index, None)

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
        for record in self._inflight:
            record.fail(EngineDeadError("the client was shut down"))
        if await self._abort_everything_owned():
            await asyncio.sleep(SHUTDOWN_FLUSH_S)  # ZMQ's io thread sends them meanwhile
        await self._close_sockets()

    async def _abort_everything_owned(self) -> bool:
        """At shutdown: abort at the engines what this client still has there."""
        return await self.aborts.abort_everything([(r.engine, r.engine_ids)
                                                   for r in self._inflight])
