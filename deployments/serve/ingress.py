"""OpenAIIngress: Serve replicas running the OpenAI app; they stream from the engines
directly over ZMQ (EngineClient), not through DeploymentHandle streaming, and send
control calls to the coordinator.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid

from ray import serve

from deployments.config import AppArgs
from deployments.serve.coordinator_calls import (
    CONTROL_TIMEOUT_S,
    COORDINATOR_CALL_TIMEOUT_S,
    CoordinatorView,
    ask,
)
from deployments.serve.heap_trim import IdleHeapTrim
from deployments.apis.errors import HTTPError
from deployments.apis.server import IngressOptions, build_api_app
from deployments.tokenizers import tokenizer_for
from engine.errors import NoEnginesError
from engine.wire.core_client import EngineClient
from engine.wire.curve_auth import client_keys

logger = logging.getLogger(__name__)
ENGINE_WAIT_S = 300.0
MEMBERSHIP_POLL_S = 0.5  # how fast a replica follows engines joining or leaving
# how often a replica reports its request metrics to the coordinator; the sum it gets
# back is what its scrapes serve (raised to its own counts) when the coordinator's answer
# to the scrape itself would keep it waiting (deployments/apis/service_routes.py)
METRICS_PUSH_S = 1.0
METRICS_TIMEOUT_S = 2.0  # how long a report waits for the sum unless told
REPORT_GIVE_UP_S = 30.0  # a report still unanswered is dropped (the next one follows)
RETIRE_WAIT_S = 600.0
# an engine this replica left out as dead while the coordinator still lists it (it went
# quiet: a stopped process, a blip) is tried again this often, with a short handshake
ENGINE_RETRY_S = 5.0
ENGINE_RETRY_HANDSHAKE_S = 3.0
# how long a replica starting beside serving engines waits to connect before it serves
START_CONNECT_S = 30.0
# how long a starting replica keeps asking for the coordinator's first answer before it
# serves without one (each ask bounded by COORDINATOR_CALL_TIMEOUT_S, then
# START_HEAR_RETRY_S apart). Without a membership and an adapter list it can only answer
# 503: in the chaos run a replacement ingress came up while the coordinator was
# SIGSTOPped and answered 13 of 60 probes 503 (issue 62) while the other replica served
START_HEAR_COORDINATOR_S = 120.0
START_HEAR_RETRY_S = 1.0


async def _retire(client: EngineClient) -> None:
    """Close a replaced client once its in-flight streams have ended."""
    deadline = time.monotonic() + RETIRE_WAIT_S
    while client.num_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    await client.shutdown()


class CoordinatorControl:
    """Control endpoints answered by the coordinator (it owns the aggregation rules),
    each call bounded (deployments/serve/coordinator_calls.py); a call that times out
    is a CoordinatorTimeoutError (a 503), and the replica's view records the silence."""

    def __init__(self, coordinator, view: CoordinatorView | None = None) -> None:
        self.coordinator = coordinator
        self.view = view or CoordinatorView()
        # names this replica's share of the metrics: Serve's id for it, so that the
        # coordinator can ask Serve whether it still runs (deployments/serve/metrics_sum.py)
        self.replica_id = _replica_name() or uuid.uuid4().hex

    async def _ask(self, method: str, *args, timeout_s: float | None = None):
        """One call, bounded (CONTROL_TIMEOUT_S unless told), its outcome in the view."""
        timeout_s = CONTROL_TIMEOUT_S if timeout_s is None else timeout_s
        try:
            out = await ask(getattr(self.coordinator, method).remote(*args), method, timeout_s)
        except Exception as exc:
            self.view.failed(exc)
            raise
        self.view.answered()
        return out

    async def _report(self, snapshot) -> list:
        """One report. Awaited in this one task, not under asyncio.wait_for (a task of
        its own): on a loaded replica each task a result passes through costs a pass of
        the event loop, and /metrics waits for this (issue 62: 0.6-0.85 s of a scrape)."""
        try:
            out = await self.coordinator.report_metrics.remote(self.replica_id, snapshot)
        except asyncio.CancelledError:  # given up (REPORT_GIVE_UP_S) or shutting down
            self.view.failed(TimeoutError("a metrics report went unanswered"))
            raise
        except Exception as exc:
            self.view.failed(exc)
            raise
        self.view.answered()
        return out

    async def is_sleeping(self) -> bool:
        return await self._ask("is_sleeping")

    async def sleep(self, level: int) -> None:
        await self._ask("call", "sleep", level)

    async def wake_up(self, tags: list[str] | None) -> None:
        await self._ask("call", "wake_up", tags)

    async def reset_prefix_cache(self, reset_running_requests: bool, reset_external: bool) -> bool:
        return await self._ask("reset_prefix_cache", reset_running_requests, reset_external)

    async def add_lora(self, lora_request) -> None:
        await self._ask("call", "add_lora", lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        return any(await self._ask("call", "remove_lora", lora_id))

    async def list_loras(self) -> list:
        """Fetched in the background by the adapter directory (requests answer from its
        last list meanwhile): a routine call's timeout."""
        return await self._ask("list_loras", timeout_s=COORDINATOR_CALL_TIMEOUT_S)

    def health_details(self) -> dict:
        return {"coordinator": self.view.details()}

    async def sum_metrics(self, snapshot, timeout_s: float = METRICS_TIMEOUT_S) -> list | None:
        """Report this replica's request metrics; the sum over every replica (None if
        the coordinator does not answer within timeout_s: the caller serves its last
        sum raised to this replica's counts). A report that answers late still reaches
        the sum; one unanswered after REPORT_GIVE_UP_S is cancelled (a coordinator gone
        for good must not leave reports pending)."""
        report = asyncio.ensure_future(self._report(snapshot))
        give_up = asyncio.get_running_loop().call_later(REPORT_GIVE_UP_S, report.cancel)
        report.add_done_callback(lambda t: (give_up.cancel(), t.cancelled() or t.exception()))
        done, _ = await asyncio.wait({report}, timeout=timeout_s)
        if not done or report.cancelled() or report.exception() is not None:
            why = "no answer within %gs" % timeout_s if not done else (
                "given up" if report.cancelled() else report.exception())
            logger.warning("ingress: metrics not summed over the replicas: %s", why)
            return None
        return report.result()


def _replica_name() -> str | None:
    """This Serve replica's id (x-flotilla-replica), None outside a replica."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - no replica context (built outside Serve)
        return None


class CoordinatorResponses:
    """Stored Responses in the coordinator, so that every ingress replica reaches them
    (deployments/apis/responses/store.py says why there)."""

    def __init__(self, coordinator) -> None:
        self.coordinator = coordinator

    async def put_response(self, response_id: str, record: dict) -> bool:
        return await ask(self.coordinator.put_response.remote(response_id, record),
                         "put_response", COORDINATOR_CALL_TIMEOUT_S)

    async def get_response(self, response_id: str) -> dict | None:
        return await self._call(self.coordinator.get_response.remote(response_id))

    async def delete_response(self, response_id: str) -> bool:
        return await self._call(self.coordinator.delete_response.remote(response_id))

    @staticmethod
    async def _call(call):
        """A store call; the coordinator restarting or not answering is a 503."""
        try:
            return await ask(call, "the response store", COORDINATOR_CALL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001
            raise HTTPError(503, f"the response store is not answering ({type(exc).__name__}); "
                            "retry", "ServiceUnavailableError") from None


@serve.deployment
@serve.ingress()
class OpenAIIngress:
    async def __init__(self, args: dict, coordinator, engines) -> None:
        self.args = AppArgs.model_validate(args)
        self.coordinator = coordinator
        self._engines = engines  # bound so that Serve deploys the engine replicas
        self._client: EngineClient | None = None
        self._version = -1  # the membership version self._client serves
        # what the coordinator last said: served from while it is silent
        self.view = CoordinatorView()
        self._retried = 0.0  # when an engine left out as dead was last tried again
        self._follower: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self._app = None  # the ASGI app, once Serve built it
        self._control = CoordinatorControl(self.coordinator, self.view)
        # the adapter list heard at start, and when (time.monotonic())
        self._first_adapters: tuple[list, float] | None = None
        self._push: asyncio.Task | None = None  # the metrics report in flight
        self._heap_trim = IdleHeapTrim()  # RSS back to what is live once a burst is over
        # loaded at once, while the engines load: it takes seconds (transformers, torch),
        # and loaded when the first engine registered it kept a new server from
        # answering for ~6 s after Serve called it ready (bench/startup.py)
        self._tokenizer_load: asyncio.Task | None = None
        self._load_tokenizer()
        self._starting = await self._connect_at_start()

    def _load_tokenizer(self) -> asyncio.Task:
        """The one load of the tokenizer, started again only if it failed."""
        task = self._tokenizer_load
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            self._tokenizer_load = task = asyncio.get_running_loop().create_task(
                asyncio.to_thread(tokenizer_for, self.args))
        return task

    async def _tokenizer(self):
        return await asyncio.shield(self._load_tokenizer())

    async def _connect_at_start(self) -> asyncio.Task:
        """Hear the coordinator, then connect to the engines before this replica takes
        traffic when they already serve (a scale-out, a replacement): a new replica used
        to report no engine gauge at all until its first request made its client, so
        scrapes behind the load balancer alternated between full and empty (issue 41).
        At the app's first start the engines are still loading (minutes, for a real
        model): the replica starts at once and connects in the background."""
        addresses = await self._hear_coordinator()
        task = asyncio.get_running_loop().create_task(self._reconnect())
        if addresses:
            await asyncio.wait({task}, timeout=START_CONNECT_S)
            try:  # seeds the adapter directory: /v1/models answers without a call
                self._first_adapters = (await self._control.list_loras(), time.monotonic())
            except Exception as exc:  # noqa: BLE001 - the follower fetches it
                logger.warning("ingress: no adapter list at start: %s", exc)
        return task

    async def _hear_coordinator(self) -> list[str]:
        """The engines of the coordinator's first membership answer, asked again until it
        comes (START_HEAR_COORDINATOR_S at most; Serve does not route to a replica
        still in its constructor): a replica that starts while the coordinator is
        silent (stopped, restarting) would otherwise serve knowing no engine."""
        deadline = time.monotonic() + START_HEAR_COORDINATOR_S
        while True:
            try:
                return (await self._membership())[1]
            except Exception as exc:  # noqa: BLE001 - a timeout, the actor restarting
                if time.monotonic() >= deadline:
                    logger.warning("ingress: no engine membership at start (%s); serving "
                                   "without one (503s until the coordinator answers)", exc)
                    return []
                logger.warning("ingress: no engine membership at start yet (%s); asking "
                               "again", exc)
                await asyncio.sleep(START_HEAR_RETRY_S)

    async def _membership(self) -> tuple[int, list[str], dict[str, dict], bool]:
        """The coordinator's membership, asked now (bounded), and kept in self.view."""
        try:
            membership = await ask(self.coordinator.membership.remote(), "membership",
                                   COORDINATOR_CALL_TIMEOUT_S)
        except Exception as exc:
            self.view.failed(exc)
            raise
        self.view.heard(membership)
        return membership

    def _current_client(self) -> EngineClient | None:
        """What get_client returns without waiting, else None."""
        client = self._client
        return client if client is not None and client.healthy else None

    async def get_client(self) -> EngineClient:
        """The client for the current engines. The first call waits for them; a
        background loop then follows the coordinator's engine set (engines joining,
        leaving, restarted) and reconnects when this client reports a dead engine.
        Once a membership with engines is known, a reconnect takes it from self.view
        (the loop keeps it current): a request never waits on the coordinator."""
        if self._client is not None and self._client.healthy:
            return self._client
        async with self._lock:
            if self._client is not None and self._client.healthy:
                return self._client
            dead = {e.address for e in self._client.engines if e.dead} if self._client else set()
            deadline = time.monotonic() + ENGINE_WAIT_S
            while True:
                if self.view.addresses:  # the last membership heard (the follower's)
                    version, addresses = self.view.version, self.view.addresses
                else:  # none yet (starting): ask; a CoordinatorTimeoutError is a 503
                    version, addresses, _, _ = await self._membership()
                live = [a for a in addresses if a not in dead]
                if live:
                    break
                if self._client is not None:  # every engine we knew is dead: fail fast
                    raise self._client.dead_error or NoEnginesError("no live engine")
                if time.monotonic() > deadline:
                    raise NoEnginesError("the engines did not register in time")
                await asyncio.sleep(0.5)
            # until the coordinator has a replacement, keep serving from the live engines
            await self._switch(version, live)
            if self._follower is None:
                self._follower = asyncio.get_running_loop().create_task(self._follow())
            return self._client

    async def _switch(self, version: int, addresses: list[str],
                      handshake_timeout_s: float = 30.0) -> None:
        """Connect to a new engine set; the old client finishes its streams, then closes."""
        client = await EngineClient.connect(addresses, await self._tokenizer(),
                                            keys=client_keys(self.view.keys),
                                            routing=self.args.routing,
                                            handshake_timeout_s=handshake_timeout_s)
        if self._client is not None:  # sessions stay on their engines when those stay
            client.router.adopt_sessions(self._client.router)
        old, self._client = self._client, client
        self._version = version
        logger.info("ingress: %d engines (membership version %d)", len(addresses), version)
        if old is not None:
            asyncio.get_running_loop().create_task(_retire(old))

    async def _follow(self) -> None:
        pushed = time.monotonic()
        fetched_adapters = False
        while True:
            await asyncio.sleep(MEMBERSHIP_POLL_S)
            if not fetched_adapters and self._app is not None:
                # the replica's first adapter list (unless its constructor heard one),
                # before a request needs it: requests naming a model answer from it if
                # the coordinator goes silent
                if self._first_adapters is None:
                    self._app.state.adapters.refresh_soon()
                fetched_adapters = True
            client = self._client
            self._heap_trim.poll(client.num_in_flight, client.requests_submitted)
            if time.monotonic() - pushed >= METRICS_PUSH_S and self._app is not None and (
                    self._push is None or self._push.done()):
                pushed = time.monotonic()  # keep the coordinator's sum current between scrapes
                self._push = asyncio.get_running_loop().create_task(self._push_metrics())
            try:
                version, addresses, _, stopping = await self._membership()
            except Exception as exc:  # the coordinator restarting or stopped
                logger.warning("ingress: engine membership update failed: %s", exc)
                # the last membership heard still names the engines: one left out as
                # dead is tried again from it (nothing else would bring it back while
                # the coordinator is silent)
                version, addresses = self.view.version, self.view.addresses
                stopping = self.view.stopping
            try:
                if stopping and self._app is not None and not self._app.state.stopping:
                    self._app.state.stopping = True
                    logger.info("ingress: the server is stopping: /health answers 503, "
                                "new requests are refused, streams finish")
                if addresses and version != self._version:
                    async with self._lock:
                        if version != self._version:
                            await self._switch(version, addresses)
                elif addresses and (missing := self._left_out(addresses)):
                    # the same membership, but an engine left out as dead: it may only
                    # have gone quiet, and no membership change would ever bring it back.
                    # Probe it alone first: the live engines are not asked every time.
                    self._retried = time.monotonic()
                    probe = await EngineClient.connect(
                        missing, await self._tokenizer(),
                        keys=client_keys(self.view.keys),
                        handshake_timeout_s=ENGINE_RETRY_HANDSHAKE_S)
                    await probe.shutdown()
                    async with self._lock:
                        await self._switch(version, addresses)
                    logger.info("ingress: an engine left out as dead answers again")
            except Exception as exc:  # an engine not answering
                logger.warning("ingress: engine set update failed: %s", exc)

    async def _push_metrics(self) -> None:
        """Report this replica's request metrics (the coordinator's sum stays current
        between scrapes); the sum it answers is what a scrape serves, raised to this
        replica's counts, when the coordinator does not answer the scrape in time.
        Waits for the answer (at most REPORT_GIVE_UP_S): one report in flight at a time,
        so a silent coordinator is not sent one a second."""
        try:
            await self._app.state.metrics.sum_over_replicas(self._control, REPORT_GIVE_UP_S)
        except Exception:  # noqa: BLE001 - the next report follows
            logger.exception("ingress: the metrics report failed")

    def _left_out(self, addresses: list[str]) -> list[str]:
        """The engines the coordinator lists and this replica's client lacks, when it is
        time to try them again (else none)."""
        if time.monotonic() - self._retried < ENGINE_RETRY_S:
            return []
        have = {e.address for e in self._client.engines}
        return [a for a in addresses if a not in have]

    def __serve_build_asgi_app__(self):
        a = self.args
        api_key, admin_key = a.keys()  # read here, in the replica, not at build time
        options = IngressOptions(a.model_name, api_key=api_key, admin_key=admin_key,
                                 dev_mode=a.dev_mode, max_body_bytes=a.max_body_bytes,
                                 metrics_need_api_key=a.metrics_need_api_key,
                                 chat_template=a.chat_template_text(),
                                 tool_call_parser=a.tool_call_parser,
                                 reasoning_parser=a.reasoning_parser,
                                 request_timeout_s=a.request_timeout_s,
                                 max_request_timeout_s=a.max_request_timeout_s,
                                 stream_interval_s=a.stream_interval_s,
                                 response_store_max=a.response_store_max,
                                 response_store_ttl_s=a.response_store_ttl_s,
                                 response_store_max_bytes=a.response_store_max_bytes,
                                 replica_name=_replica_name())
        self._app = build_api_app(self.get_client, options, self._control,
                                  CoordinatorResponses(self.coordinator),
                                  current_client=self._current_client)
        if self._first_adapters is not None:
            self._app.state.adapters.seed(*self._first_adapters)
        return self._app

    async def check_health(self) -> None:
        """Healthy while the replica runs: a dead engine is its own replica's business
        (Serve replaces that one), and this replica's client moves to the live engines
        at its next request or membership poll. This check used to fail while the
        client held a dead engine, so an engine death while the coordinator restarted
        (no reconnect possible for up to COORDINATOR_CALL_TIMEOUT_S) had Serve kill
        the ingress replicas too, cutting every stream they served on the live
        engines (the chaos run, bench/chaos.py). Here it only starts the reconnect."""
        if self._client is not None and not self._client.healthy and not self._lock.locked():
            asyncio.get_running_loop().create_task(self._reconnect())

    async def _reconnect(self) -> None:
        try:
            await self.get_client()
        except Exception as exc:  # no engine or no coordinator yet: requests say so
            logger.warning("ingress: reconnecting to the engines failed: %s", exc)
