"""ApiContext: what every HTTP API's handlers share over the engines.

One object per app: the engine client (through the replica's get_client), the
options, the control plane (coordinator in Serve, else the client itself), LoRA
adapter names, the ingress metrics and the response store. Its `endpoint` wrapper
gives every route the same request id, tracing, auth, stopping check and error
mapping; each API passes its own error renderer (OpenAI's JSON, Anthropic's), so a
bad request is answered in the shape its client parses, and the app keeps serving.
"""
from __future__ import annotations

import hmac
import logging
import math
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from deployments.apis.common.chat_prep import ChatInput, PreparedChat, prepare_chat
from deployments.apis.errors import HTTPError, constraint_param, map_error, openai_error_response
from deployments.apis.lora_admin import AdapterDirectory
from deployments.apis.options import IngressOptions
from deployments.serve.metrics import IngressMetrics
from deployments.serve.metrics_sum import Snapshot
from engine import tracing
from engine.frontend.prep_offload import INLINE_CHARS
from engine.structured import check_limit
from engine.lora.request import LoRARequest
from engine.outputs import RequestOutput
from engine.wire.core_client import EngineClient
from engine.wire.routing import MAX_SESSION_ID_CHARS

logger = logging.getLogger(__name__)

# A client's x-request-id becomes part of its engine request ids, log lines and trace
# attributes: a longer one is refused with 400 (an 8,000-character one was a 500).
MAX_REQUEST_ID_CHARS = 256


def _session_id(request: Request) -> str | None:
    """x-session-id, which the router remembers (a bounded table: MAX_SESSION_ID_CHARS)."""
    session = request.headers.get("x-session-id")
    if session is not None and len(session) > MAX_SESSION_ID_CHARS:
        raise HTTPError(400, f"x-session-id is {len(session)} characters; at most "
                        f"{MAX_SESSION_ID_CHARS}", "BadRequestError", "x-session-id")
    return session

ErrorRenderer = Callable[[HTTPError], Response]
Handler = Callable[[Request, str], Awaitable[Response]]


async def read_capped(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it passes `limit` bytes: a chunked upload
    (no content-length) is not buffered whole before the check."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPError(413, f"request body over {limit} bytes", "RequestTooLargeError")
        chunks.append(chunk)
    return b"".join(chunks)


def _http_span(request: Request, rid: str):
    """A traced POST's SERVER span (the caller's child); None for other methods, or
    if it cannot be made (tracing never fails a request)."""
    if request.method != "POST":
        return None
    try:
        span = tracing.start_http_span(f"POST {request.url.path}", request.headers, {
            "http.request.method": "POST", "url.path": request.url.path,
            "http.request.header.x_request_id": rid})
    except Exception:  # noqa: BLE001
        logger.exception("tracing: no span for this request")
        return None
    request.state.trace_span = span  # scheduling() sends its context to the engine
    return span


def _end_with(span, response: Response) -> None:
    """End the HTTP span with the response: a stream's when its last event is sent."""
    span.set_attribute("http.response.status_code", response.status_code)
    if not isinstance(response, StreamingResponse):
        span.end()
        return
    events = response.body_iterator

    async def ending():
        try:
            async for event in events:
                yield event
        finally:
            span.end()
            closing = getattr(events, "aclose", None)
            if closing is not None:
                await closing()
    response.body_iterator = ending()


class ClientControl:
    """Control calls answered by the ingress's own EngineClient (no coordinator)."""

    def __init__(self, get_client: Callable[[], Awaitable[EngineClient]]) -> None:
        self.get_client = get_client

    async def is_sleeping(self) -> bool:
        return await (await self.get_client()).is_sleeping()

    async def sleep(self, level: int) -> None:
        await (await self.get_client()).call_utility("sleep", level)

    async def wake_up(self, tags: list[str] | None) -> None:
        await (await self.get_client()).call_utility("wake_up", tags)

    async def reset_prefix_cache(self, reset_running_requests: bool, reset_external: bool) -> bool:
        return await (await self.get_client()).reset_prefix_cache(reset_running_requests,
                                                                  reset_external)

    async def add_lora(self, lora_request: LoRARequest) -> None:
        await (await self.get_client()).add_lora(lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        return await (await self.get_client()).remove_lora(lora_id)

    async def list_loras(self) -> list[LoRARequest]:
        return await (await self.get_client()).list_loras()

    async def sum_metrics(self, snapshot: Snapshot, timeout_s: float) -> Snapshot | None:
        """The request metrics over every ingress replica: this one is the only one."""
        return None


class ApiContext:
    """Shared by the routes of every API in one app (see the module docstring)."""

    def __init__(self, get_client: Callable[[], Awaitable[EngineClient]],
                 options: IngressOptions, control: Any, store: Any,
                 current_client: Callable[[], EngineClient | None] | None = None) -> None:
        self.options = options
        self.model = options.served_model_name
        self._raw_get_client = get_client
        self._current_client = current_client
        self.seen: dict[str, EngineClient] = {}
        # the coordinator in Serve; by default the client itself, with the same rules
        self.control = control or ClientControl(self.get_client)
        self.store = store  # stored Responses (deployments.apis.responses.store)
        self.adapters = AdapterDirectory(self.control)
        self.metrics = IngressMetrics(self.model, lambda: self.seen.get("client"))
        self.traced = tracing.enabled()  # read once: off costs one check per request

    async def get_client(self) -> EngineClient:
        self.seen["client"] = client = await self._raw_get_client()
        return client

    def current_client(self) -> EngineClient | None:
        """The client get_client would return at once (healthy, current), or None when
        it would have to wait or nobody said: read without awaiting."""
        client = self._current_client() if self._current_client is not None else None
        if client is not None:
            self.seen["client"] = client
        return client

    # ---- request bodies ---------------------------------------------------------------------
    async def body(self, request: Request, schema):
        """The body validated against `schema` (pydantic): a 400 naming the first bad
        field, unsupported fields refused, an unknown model a 404."""
        limit = self.options.max_body_bytes
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > limit:
            raise HTTPError(413, f"request body over {limit} bytes", "RequestTooLargeError")
        raw = await read_capped(request, limit)
        request.state.body_bytes = len(raw)  # a large one is prepared off the event loop
        try:
            body = schema.model_validate_json(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            param = ".".join(str(p) for p in first.get("loc", ()))
            message = first.get("msg", "invalid request").removeprefix("Value error, ")
            if first.get("type") == "extra_forbidden":
                message = "unknown field (not part of this API; docs/api.md lists the fields)"
            raise HTTPError(400, f"{param}: {message}" if param else message,
                            "BadRequestError", param or None) from None
        unsupported = getattr(body, "unsupported_param", None)
        if unsupported is not None and (err := unsupported()) is not None:
            raise err
        await self.adapter(body)  # an unknown model is a 404 before anything else
        return body

    async def adapter(self, body) -> LoRARequest | None:
        """The LoRA adapter the request's `model` names; None for the base model."""
        name = getattr(body, "model", None)
        if name in (None, self.model):
            return None
        lora = await self.adapters.resolve(name)
        if lora is None:
            raise HTTPError(404, f"The model `{name}` does not exist.", "NotFoundError",
                            "model")
        return lora

    def scheduling(self, body, request: Request) -> dict[str, Any]:
        """The request's priority and deadline, counted from now (call it as soon as
        the body is read: tokenizing and templating count against the deadline), its
        trace context when traced, and its engine affinity headers."""
        timeout = getattr(body, "timeout", None)
        ceiling = self.options.max_request_timeout_s
        if timeout is None:
            timeout = self.options.request_timeout_s
        elif not math.isfinite(timeout) or timeout > ceiling:  # a deadline is never off
            raise HTTPError(400, f"timeout must be a finite number of seconds up to {ceiling:g}"
                            f" (the server's max_request_timeout_s), got {timeout!r}",
                            "BadRequestError", "timeout")
        out: dict[str, Any] = {
            "priority": getattr(body, "priority", 0),
            "deadline": None if timeout is None else time.monotonic() + timeout,
            "session_id": _session_id(request)}  # the same engine
        # its grammar check ends within the deadline too (engine/structured/check_limit.py)
        check_limit.scope(out["deadline"], lambda: constraint_param(body))
        span = getattr(request.state, "trace_span", None)
        if span is not None:
            out["trace_headers"] = tracing.headers_of(span)
        rank = request.headers.get("x-data-parallel-rank")
        if rank is not None:  # vLLM's header: this engine, or an error (none other)
            if not rank.strip().isdigit():
                raise HTTPError(400, f"x-data-parallel-rank: {rank!r} is not a rank "
                                "(0, 1, ...)", "BadRequestError", "x-data-parallel-rank")
            out["data_parallel_rank"] = int(rank)
        return out

    async def prepare_chat(self, request: Request, chat: ChatInput) -> PreparedChat:
        """The chat prompt (deployments.apis.common.chat_prep), off the event loop when
        the request is large or has tools (templating and tokenizing are CPU work), or
        its conversation is (a short follow-up of a long stored one)."""
        client = await self.get_client()
        heavy = (request.state.body_bytes > INLINE_CHARS or bool(chat.tools)
                 or len(chat.conversation) > 8
                 or sum(len(str(m.get("content") or "")) for m in chat.conversation)
                 > INLINE_CHARS)
        return await client.prep.run(heavy, prepare_chat, client.processor, chat, self.options)

    # ---- outputs ----------------------------------------------------------------------------
    def record(self, out: RequestOutput | None) -> None:
        """A finished request in the ingress metrics."""
        if out is not None:
            self.metrics.record(out.metrics, len(out.prompt_token_ids),
                                [c.finish_reason for c in out.outputs])

    @staticmethod
    async def first(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
        """The first output: errors before it stay HTTP errors (no stream sent yet)."""
        try:
            return await stream.__anext__()
        except BaseException:
            await stream.aclose()
            raise

    # ---- auth and the endpoint wrapper ------------------------------------------------------
    def check_key(self, request: Request, key: str | None, x_api_key: bool = False) -> None:
        """Bearer `key` in Authorization (or, for Anthropic's clients, in x-api-key)."""
        if key is None:
            return
        given = request.headers.get("authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return
        if x_api_key and hmac.compare_digest(request.headers.get("x-api-key", "").encode(),
                                             key.encode()):
            return
        raise HTTPError(401, "invalid or missing API key", "AuthenticationError")

    def check_admin(self, request: Request) -> None:
        if self.options.admin_key is not None:
            self.check_key(request, self.options.admin_key)
        elif not self.options.dev_mode:
            raise HTTPError(404, "control endpoints are disabled (set an admin key or dev mode)",
                            "NotFoundError")

    def endpoint(self, handler: Handler, *, auth: bool = True, admin: bool = False,
                 errors: ErrorRenderer = openai_error_response, x_api_key: bool = False):
        """The route's handler with the shared request handling around it."""
        async def wrapped(request: Request) -> Response:
            given = request.headers.get("x-request-id")
            rid = given if given and len(given) <= MAX_REQUEST_ID_CHARS else uuid.uuid4().hex
            span = _http_span(request, rid) if self.traced else None
            try:
                if given is not None and len(given) > MAX_REQUEST_ID_CHARS:
                    raise HTTPError(400, f"x-request-id is {len(given)} characters; at most "
                                    f"{MAX_REQUEST_ID_CHARS}", "BadRequestError",
                                    "x-request-id")
                if admin:
                    self.check_admin(request)
                elif auth:
                    self.check_key(request, self.options.api_key, x_api_key)
                if request.method == "POST" and request.app.state.stopping:
                    raise HTTPError(503, "the server is stopping; retry on another replica",
                                    "ServiceUnavailableError")
                response = await handler(request, rid)
            except Exception as exc:  # noqa: BLE001 - every error becomes the API's JSON
                response = errors(map_error(exc))
            except BaseException:  # cancelled (the client left): the span ends here
                if span is not None:
                    span.end()
                raise
            response.headers["x-request-id"] = rid
            if self.options.replica_name is not None:
                response.headers["x-flotilla-replica"] = self.options.replica_name
            if span is not None:
                _end_with(span, response)
            return response
        return wrapped
