"""The OpenAI-compatible HTTP API as a Starlette app over an EngineClient.

Independent of Ray: the Serve ingress deployment wraps this app, tests drive it
in-process. Every error is OpenAI-style JSON with a fitting status, and the app
keeps serving after each one. A streamed request whose client goes away is closed,
which closes its EngineClient stream, which aborts it at its engine.
"""
from __future__ import annotations

import asyncio
import base64
import hmac
import logging
import struct
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

import msgspec
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from deployments.apis.common.tools import (
    ToolDeltaStream,
    ToolPlan,
    plan_tools,
    render_chat_prompt,
    tool_message,
)
from deployments.apis.openai.logprob_format import (
    completion_entries,
    format_logprobs,
    prompt_entries,
    prompt_logprobs_json,
    text_length,
)
from deployments.apis.lora_admin import AdapterDirectory
from deployments.serve.metrics import IngressMetrics
from deployments.serve.metrics_sum import Snapshot
from deployments.apis.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    ParamError,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from deployments.apis.openai.prompt_batch import echo_prompt, merge_prompt_streams
from engine import tracing
from engine.errors import (
    EngineDeadError,
    EngineDrainingError,
    EngineOverloadedError,
    EngineRequestError,
    EngineSleepingError,
    FlotillaError,
    InconsistentUtilityResults,
    InvalidRequestError,
    NoEnginesError,
    RequestAbortedError,
    RequestTimeoutError,
    UtilityCallError,
)
from engine.frontend.prep_offload import INLINE_CHARS
from engine.lora.request import LoRARequest
from engine.outputs import OutputKind, RequestOutput
from engine.pooling import PoolingParams
from engine.request_limits import check_fanout
from engine.sampling_params import SamplingParams
from engine.wire.core_client import EngineClient

logger = logging.getLogger(__name__)
_JSON = msgspec.json.Encoder()  # SSE chunks
HEALTH_WAIT_S = 0.9  # /health answers within a second, connected or not
STATS_WAIT_S = 0.5  # a scrape asks the engines for their stats, waiting this long at most
STATS_MAX_AGE_S = 1.0  # ... when their last (from outputs, heartbeats) are older than this
SUM_WAIT_S = 0.5  # and waits this long for the sum over the replicas (else its last, raised)
SLOW_SCRAPE_S = 1.0  # a scrape slower than this is logged with where its time went
RETRY_AFTER_S = 1  # what a 429 (an engine's waiting queue full) asks the client to wait


@dataclass(frozen=True)
class IngressOptions:
    served_model_name: str
    api_key: str | None = None  # Bearer key for /v1/* and /tokenize (none: open)
    admin_key: str | None = None  # Bearer key for the control endpoints
    dev_mode: bool = False  # control endpoints without a key (never in production)
    max_body_bytes: int = 1 << 20
    metrics_need_api_key: bool = False  # /metrics behind api_key (off: open to scrapers)
    chat_template: str | None = None  # Jinja text; None: the tokenizer's
    tool_call_parser: str = "hermes"  # how tool_choice "auto" reads calls (deployments/apis/common/tool_calls/)
    request_timeout_s: float | None = 600.0  # a request's deadline when it names none


class HTTPError(Exception):
    """usage: what a request that failed part way used (a timed-out one's tokens)."""

    def __init__(self, status: int, message: str, err_type: str, param: str | None = None,
                 usage: dict | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.err_type, self.param = status, message, err_type, param
        self.usage = usage
        self.headers = headers or {}


def error_response(status: int, message: str, err_type: str, param: str | None = None,
                   extra: dict | None = None, usage: dict | None = None) -> JSONResponse:
    body: dict[str, Any] = {"error": {"message": message, "type": err_type, "param": param,
                                      "code": status}}
    if extra:
        body["error"].update(extra)
    if usage is not None:
        body["usage"] = usage
    return JSONResponse(body, status_code=status)


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


TIMEOUT_MESSAGE = ("the request passed its deadline (timeout, or the server's "
                   "request_timeout_s) and was aborted; usage counts what it used")


async def _read_capped(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it passes `limit` bytes: a chunked upload
    (no content-length) is not buffered whole before the check."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPError(413, f"request body over {limit} bytes", "RequestTooLargeError")
        chunks.append(chunk)
    return b"".join(chunks)


def _cause(exc: BaseException) -> BaseException:
    """The original error of one that crossed a Ray call (Ray keeps it as .cause)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def _inconsistent_values(exc: BaseException) -> dict | None:
    exc = _cause(exc)
    if isinstance(exc, InconsistentUtilityResults):
        return {"values": exc.values}
    return None


def _map_error(exc: BaseException) -> HTTPError:
    exc = _cause(exc)
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, ParamError):
        return HTTPError(400, str(exc), "BadRequestError", exc.param)
    if isinstance(exc, (InvalidRequestError, ValueError)):
        return HTTPError(400, str(exc), "BadRequestError")
    if isinstance(exc, EngineOverloadedError):
        return HTTPError(429, str(exc), "RateLimitError",
                         headers={"retry-after": str(RETRY_AFTER_S)})
    if isinstance(exc, (EngineSleepingError, EngineDrainingError, RequestAbortedError)):
        return HTTPError(503, str(exc), "ServiceUnavailableError")
    if isinstance(exc, (EngineDeadError, NoEnginesError)):
        return HTTPError(503, str(exc), "ServiceUnavailableError")
    if isinstance(exc, RequestTimeoutError):  # before any token: only the prompt was used
        return HTTPError(408, TIMEOUT_MESSAGE, "TimeoutError",
                         usage=_usage(exc.prompt_tokens, 0))
    if isinstance(exc, FlotillaError):
        return HTTPError(500, str(exc), "InternalServerError")
    return HTTPError(500, f"internal error: {type(exc).__name__}", "InternalServerError")


@dataclass(frozen=True)
class _Shape:
    """How one generation response is shaped: chat or completion, how many top
    logprobs, tool parsing, prompt logprobs shown (vLLM's extension) or put in front of
    the choice's logprobs (completions' echo with logprobs)."""

    chat: bool
    top_k: int
    tools: Any
    show_prompt_logprobs: bool
    echo_logprobs: bool
    decode: Callable[[list[int]], str]

    def prompt_entries(self, out: RequestOutput) -> list[dict]:
        return prompt_entries(out.prompt_logprobs, out.prompt_token_ids, self.top_k,
                              self.decode)

    @staticmethod
    def prompt_json(prompt_logprobs) -> list | None:
        return None if prompt_logprobs is None else prompt_logprobs_json(prompt_logprobs)


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
    request.state.trace_span = span  # _scheduling sends its context to the engine
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
    response.body_iterator = ending()


def build_openai_app(get_client: Callable[[], Awaitable[EngineClient]],
                     options: IngressOptions, control=None) -> Starlette:
    """Routes of the OpenAI API (+ tokenize, health, control) over the engines.

    control: what answers the control endpoints (the coordinator in Serve);
    by default the ingress's own client, with the same aggregation rules.
    """
    model = options.served_model_name
    seen: dict[str, EngineClient] = {}
    raw_get_client = get_client

    async def get_client() -> EngineClient:
        seen["client"] = client = await raw_get_client()
        return client

    control = control or ClientControl(get_client)
    adapters = AdapterDirectory(control)
    metrics = IngressMetrics(model, lambda: seen.get("client"))
    traced = tracing.enabled()  # read once: off costs one check per request

    async def _body(request: Request, schema):
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > options.max_body_bytes:
            raise HTTPError(413, f"request body over {options.max_body_bytes} bytes",
                            "RequestTooLargeError")
        raw = await _read_capped(request, options.max_body_bytes)
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
        await _adapter(body)  # an unknown model is a 404 before anything else
        return body

    async def _adapter(body) -> LoRARequest | None:
        """The LoRA adapter the request's `model` names; None for the base model."""
        name = getattr(body, "model", None)
        if name in (None, model):
            return None
        lora = await adapters.resolve(name)
        if lora is None:
            raise HTTPError(404, f"The model `{name}` does not exist.", "NotFoundError",
                            "model")
        return lora

    def _check_key(request: Request, key: str | None) -> None:
        if key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise HTTPError(401, "invalid or missing API key", "AuthenticationError")

    def _check_admin(request: Request) -> None:
        if options.admin_key is not None:
            _check_key(request, options.admin_key)
        elif not options.dev_mode:
            raise HTTPError(404, "control endpoints are disabled (set an admin key or dev mode)",
                            "NotFoundError")

    def endpoint(handler, *, auth: bool = True, admin: bool = False):
        async def wrapped(request: Request) -> Response:
            rid = request.headers.get("x-request-id") or uuid.uuid4().hex
            span = _http_span(request, rid) if traced else None
            try:
                if admin:
                    _check_admin(request)
                elif auth:
                    _check_key(request, options.api_key)
                if request.method == "POST" and request.app.state.stopping:
                    raise HTTPError(503, "the server is stopping; retry on another replica",
                                    "ServiceUnavailableError")
                response = await handler(request, rid)
            except Exception as exc:  # noqa: BLE001 - every error becomes OpenAI JSON
                err = _map_error(exc)
                extra = _inconsistent_values(exc)
                response = error_response(err.status, err.message, err.err_type, err.param, extra,
                                          err.usage)
                response.headers.update(err.headers)
            except BaseException:  # cancelled (the client left): the span ends here
                if span is not None:
                    span.end()
                raise
            response.headers["x-request-id"] = rid
            if span is not None:
                _end_with(span, response)
            return response
        return wrapped

    # ---- generation ---------------------------------------------------------------------------
    async def completions(request: Request, rid: str) -> Response:
        body = await _body(request, CompletionRequest)
        scheduling = _scheduling(body, request)
        scheduling["session_id"] = request.headers.get("x-session-id")  # same engine
        client = await get_client()
        params = body.sampling_params(body.max_tokens, body.logprobs,
                                      body.structured_outputs_params(),
                                      client.sampling_defaults, body.engine_prompt_logprobs())
        request_id = f"cmpl-{rid}-{uuid.uuid4().hex[:8]}"
        prompts = body.prompts()
        check_fanout(len(prompts), params.n, client.processor.limits)
        lora = await _adapter(body)
        if len(prompts) == 1 and not body.echo:
            return await _generate(request_id, prompts[0], params, body, chat=False, lora=lora,
                                   scheduling=scheduling)
        streams = []
        for i, prompt in enumerate(prompts):
            stream = client.generate(f"{request_id}-{i}", prompt, params, lora_request=lora,
                                     **scheduling)
            if body.echo:
                text = prompt if isinstance(prompt, str) else \
                    client.processor.tokenizer.decode(prompt)
                stream = echo_prompt(stream, text)
            streams.append(stream)
        merged = streams[0] if len(streams) == 1 else merge_prompt_streams(streams, params.n)
        return await _respond(merged, request_id, params, body, False, None,
                              len(prompts) * params.n, client.processor.tokenizer.decode)

    async def chat_completions(request: Request, rid: str) -> Response:
        body = await _body(request, ChatCompletionRequest)
        scheduling = _scheduling(body, request)
        scheduling["session_id"] = request.headers.get("x-session-id")  # same engine
        plan = plan_tools(body, options.tool_call_parser)
        structured = body.structured_outputs_params(plan.forced, "tool_choice")
        client = await get_client()
        params = body.sampling_params(body.token_limit(), body.logprob_count(), structured,
                                      client.sampling_defaults, body.prompt_logprobs)
        check_fanout(1, params.n, client.processor.limits)
        heavy = request.state.body_bytes > INLINE_CHARS or bool(plan.tools)
        text, ids = await client.prep.run(heavy, _chat_prompt, client.processor, body, plan)
        return await _generate(f"chatcmpl-{rid}-{uuid.uuid4().hex[:8]}",
                               {"prompt": text, "prompt_token_ids": ids}, params, body, chat=True,
                               tools=plan if plan.parser is not None else None,
                               lora=await _adapter(body), scheduling=scheduling)

    def _chat_prompt(processor, body, plan) -> tuple[str, list[int]]:
        """The conversation rendered through the chat template, and its token ids."""
        text = render_chat_prompt(processor, body.conversation(), plan, options.chat_template,
                                  body.add_generation_prompt, body.chat_template_kwargs or {})
        return text, processor.tokenizer.encode(text, add_special_tokens=False)

    async def _generate(request_id: str, prompt, params, body, chat: bool,
                        tools=None, lora=None, scheduling: dict[str, Any] | None = None
                        ) -> Response:
        client = await get_client()
        stream = client.generate(request_id, prompt, params, lora_request=lora,
                                 **(scheduling or {}))
        return await _respond(stream, request_id, params, body, chat, tools, params.n,
                              client.processor.tokenizer.decode)

    def _scheduling(body, request: Request) -> dict[str, Any]:
        """The request's priority and deadline, counted from now (call it as soon as
        the body is read: tokenizing and templating count against the deadline), and
        its trace context when traced."""
        timeout = body.timeout or options.request_timeout_s
        out = {"priority": body.priority,
               "deadline": None if timeout is None else time.monotonic() + timeout}
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

    async def _respond(stream, request_id: str, params, body, chat: bool, tools,
                       choices: int, decode) -> Response:
        """choices: how many the response has (n per prompt, prompts x n in all)."""
        shape = _Shape(chat, params.logprobs or 0, tools, body.prompt_logprobs is not None,
                       not chat and bool(body.echo) and body.logprobs is not None, decode)
        created = int(time.time())
        if body.stream:
            first = await _first(stream)  # errors before the first token stay HTTP errors
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _sse(stream, first, request_id, created, include_usage, shape),
                media_type="text/event-stream")
        return JSONResponse(await _full(stream, request_id, created, choices, shape))

    async def _first(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
        try:
            return await stream.__anext__()
        except BaseException:
            await stream.aclose()
            raise

    def _record(out: RequestOutput | None) -> None:
        if out is not None:
            metrics.record(out.metrics, len(out.prompt_token_ids),
                           [c.finish_reason for c in out.outputs])

    async def _full(stream, request_id, created, n, shape: _Shape) -> dict:
        chat, tools = shape.chat, shape.tools
        texts = [""] * n
        tokens = [0] * n
        logprobs: list[list] = [[] for _ in range(n)]
        prompt_lps: list[list | None] = [None] * n  # each choice's prompt's prompt logprobs
        finish: list[str | None] = [None] * n
        prompt_tokens: dict[str, int] = {}  # per prompt's request: usage sums them
        try:
            async for out in stream:
                prompt_tokens[out.request_id] = len(out.prompt_token_ids)
                if out.finished:
                    _record(out)
                for c in out.outputs:
                    if out.prompt_logprobs is not None:
                        prompt_lps[c.index] = out.prompt_logprobs
                        if shape.echo_logprobs:
                            logprobs[c.index][:0] = shape.prompt_entries(out)
                    texts[c.index] += c.text
                    tokens[c.index] += len(c.token_ids)
                    if c.logprobs:
                        logprobs[c.index] += completion_entries(c, shape.top_k)
                    finish[c.index] = c.finish_reason or finish[c.index]
        except RequestTimeoutError as exc:
            prompt_tokens.setdefault(exc.request_id, exc.prompt_tokens)
            raise HTTPError(408, TIMEOUT_MESSAGE, "TimeoutError",
                            usage=_usage(sum(prompt_tokens.values()), sum(tokens))) from None
        finally:
            await stream.aclose()
        choices = []
        for i in range(n):
            lp = format_logprobs(logprobs[i], chat) if logprobs[i] else None
            if chat:
                message: dict[str, Any] = {"role": "assistant", "content": texts[i]}
                if tools is not None:
                    message["content"], calls = tool_message(texts[i], tools)
                    if calls:
                        message["tool_calls"] = calls
                        finish[i] = "tool_calls" if finish[i] == "stop" else finish[i]
                choices.append({"index": i, "message": message, "logprobs": lp,
                                "finish_reason": finish[i]})
            else:
                choices.append({"index": i, "text": texts[i], "logprobs": lp,
                                "finish_reason": finish[i]})
                if shape.show_prompt_logprobs:  # vLLM: per choice in completions
                    choices[-1]["prompt_logprobs"] = shape.prompt_json(prompt_lps[i])
        completion, prompt = sum(tokens), sum(prompt_tokens.values())
        response = {"id": request_id, "object": "chat.completion" if chat else "text_completion",
                    "created": created, "model": model, "choices": choices,
                    "usage": _usage(prompt, completion)}
        if chat and shape.show_prompt_logprobs:  # vLLM: once per chat response
            response["prompt_logprobs"] = shape.prompt_json(prompt_lps[0])
        return response

    async def _sse(stream, first, request_id, created, include_usage, shape: _Shape):
        chat, tools = shape.chat, shape.tools
        obj = "chat.completion.chunk" if chat else "text_completion"
        started: set[int] = set()
        tool_streams: dict[int, ToolDeltaStream] = {}
        offsets: dict[int, int] = {}  # each choice's text_offset so far
        completion = 0
        prompt_tokens: dict[str, int] = {}  # per prompt's request: usage sums them

        def event(payload: dict) -> bytes:  # msgspec: 1.0 us a chunk, json.dumps 10 us
            return b"data: " + _JSON.encode(payload) + b"\n\n"

        try:
            out: RequestOutput | None = first
            while out is not None:
                prompt_tokens[out.request_id] = len(out.prompt_token_ids)
                if out.finished:
                    _record(out)
                echoed = (shape.prompt_entries(out) if shape.echo_logprobs
                          and out.prompt_logprobs is not None else [])
                for c in out.outputs:
                    completion += len(c.token_ids)
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue
                    lp = None
                    if c.logprobs or echoed:
                        entries = echoed + completion_entries(c, shape.top_k)
                        lp = format_logprobs(entries, chat, offsets.get(c.index, 0))
                        offsets[c.index] = offsets.get(c.index, 0) + text_length(entries)
                    if chat and tools is not None:
                        ts = tool_streams.setdefault(c.index, ToolDeltaStream(tools))
                        deltas = [ts.feed(c.text)]
                        if c.finish_reason is not None:
                            deltas.append(ts.finish())
                        deltas = [d for d in deltas if d is not None] or [{}]
                        finish_reason = c.finish_reason
                        if ts.made_calls and finish_reason == "stop":
                            finish_reason = "tool_calls"
                        for k, delta in enumerate(deltas):
                            if c.index not in started:
                                delta["role"] = "assistant"
                                started.add(c.index)
                            last_one = k == len(deltas) - 1
                            yield event({"id": request_id, "object": obj, "created": created,
                                         "model": model, "choices": [{
                                             "index": c.index, "delta": delta,
                                             "logprobs": lp if last_one else None,
                                             "finish_reason": finish_reason if last_one
                                             else None}]})
                        continue
                    if chat:
                        delta: dict[str, Any] = {"content": c.text}
                        if c.index not in started:
                            delta["role"] = "assistant"
                            started.add(c.index)
                        choice = {"index": c.index, "delta": delta, "logprobs": lp,
                                  "finish_reason": c.finish_reason}
                    else:
                        choice = {"index": c.index, "text": c.text, "logprobs": lp,
                                  "finish_reason": c.finish_reason}
                    yield event({"id": request_id, "object": obj, "created": created,
                                 "model": model, "choices": [choice]})
                out = await anext(stream, None)
            if include_usage:
                yield event({"id": request_id, "object": obj, "created": created, "model": model,
                             "choices": [], "usage": {
                                 "prompt_tokens": sum(prompt_tokens.values()),
                                 "completion_tokens": completion,
                                 "total_tokens": sum(prompt_tokens.values()) + completion}})
        except Exception as exc:  # noqa: BLE001 - reported in-band: the status is already sent
            err = _map_error(exc)
            payload: dict[str, Any] = {"error": {"message": err.message, "type": err.err_type,
                                                 "code": err.status}}
            if isinstance(exc, RequestTimeoutError):
                prompt_tokens.setdefault(exc.request_id, exc.prompt_tokens)
                payload["usage"] = _usage(sum(prompt_tokens.values()), completion)
            yield event(payload)
        finally:
            await stream.aclose()
        yield b"data: [DONE]\n\n"

    async def embeddings(request: Request, rid: str) -> Response:
        body = await _body(request, EmbeddingRequest)
        scheduling = _scheduling(body, request)  # one deadline for every input
        client = await get_client()
        pooling = PoolingParams(dimensions=body.dimensions)
        lora = await _adapter(body)
        request_id = f"embd-{rid}-{uuid.uuid4().hex[:8]}"

        async def one(i: int, prompt) -> RequestOutput:
            stream = client.generate(f"{request_id}-{i}", prompt, SamplingParams(),
                                     kind=OutputKind.FINAL_ONLY, pooling_params=pooling,
                                     lora_request=lora, **scheduling)
            try:
                async for out in stream:
                    if out.finished:
                        return out
            finally:
                await stream.aclose()
            raise EngineRequestError("the engine ended an embedding request without a vector")

        # each input is its own engine request: they spread over the data-parallel engines
        tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(body.inputs())]
        try:
            outs = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()  # one failed, or the client left: abort the rest
        data = []
        for i, out in enumerate(outs):
            vector = out.outputs[0].embedding
            if body.encoding_format == "base64":
                vector = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"object": "embedding", "index": i, "embedding": vector})
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        return JSONResponse({"object": "list", "data": data, "model": model,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    # ---- other routes -------------------------------------------------------------------------
    async def model_card() -> dict[str, Any]:
        client = await get_client()
        return {"id": model, "object": "model", "created": 0, "owned_by": "flotilla",
                "max_model_len": client.max_model_len}

    def adapter_card(lora: LoRARequest, base: dict[str, Any]) -> dict[str, Any]:
        # root names the adapter, not its folder: paths are the server's business
        return {**base, "id": lora.lora_name, "root": lora.lora_name, "parent": model}

    async def models(request: Request, rid: str) -> Response:
        base = await model_card()
        cards = [base] + [adapter_card(a, base) for a in await adapters.refresh()]
        return JSONResponse({"object": "list", "data": cards})

    async def retrieve_model(request: Request, rid: str) -> Response:
        name = request.path_params["model_id"]
        if name == model:
            return JSONResponse(await model_card())
        lora = await adapters.resolve(name)
        if lora is None:
            raise HTTPError(404, f"The model `{name}` does not exist.", "NotFoundError", "model")
        return JSONResponse(adapter_card(lora, await model_card()))

    async def load_lora_adapter(request: Request, rid: str) -> Response:
        body = await _body(request, LoadLoRAAdapterRequest)
        try:
            await adapters.load(body.lora_name, body.lora_path)
        except Exception as exc:  # a name taken, or an engine refused it (it says why)
            cause = _cause(exc)
            if isinstance(cause, (ValueError, UtilityCallError)):
                raise HTTPError(400, str(cause), "BadRequestError", "lora_path") from None
            raise
        return JSONResponse({"success": True,
                             "message": f"LoRA adapter {body.lora_name!r} loaded"})

    async def unload_lora_adapter(request: Request, rid: str) -> Response:
        body = await _body(request, UnloadLoRAAdapterRequest)
        if not await adapters.unload(body.lora_name):
            raise HTTPError(404, f"The LoRA adapter `{body.lora_name}` is not loaded.",
                            "NotFoundError", "lora_name")
        return JSONResponse({"success": True,
                             "message": f"LoRA adapter {body.lora_name!r} unloaded"})

    async def version(request: Request, rid: str) -> Response:
        from engine import __version__
        return JSONResponse({"version": __version__})

    async def openapi(request: Request, rid: str) -> Response:
        from deployments.apis.openai.schema import openapi_document
        from engine import __version__
        return JSONResponse(openapi_document(__version__))

    async def metrics_endpoint(request: Request, rid: str) -> Response:
        # the replica's current client: it may have moved to another engine set since its
        # last request (the gauges were those of the retired client, the chaos run found)
        began = time.monotonic()
        try:
            client = await asyncio.wait_for(asyncio.shield(get_client()), STATS_WAIT_S)
        except Exception:  # noqa: BLE001 - no engines yet: serve what there is
            client = seen.get("client")
        connected = time.monotonic()
        if client is not None:  # the engines' values at most a stats interval old
            try:
                await client.refresh_stats(STATS_MAX_AGE_S, STATS_WAIT_S)
            except Exception as exc:  # noqa: BLE001 - serve what the outputs last brought
                logger.debug("metrics: engine stats not refreshed: %s", exc)
        refreshed = time.monotonic()
        summed = await control.sum_metrics(metrics.snapshot(), SUM_WAIT_S)
        body = metrics.exposition(summed)
        took = time.monotonic() - began
        if took > SLOW_SCRAPE_S:
            logger.warning("metrics: a scrape took %.2f s (client %.2f s, engine stats "
                           "%.2f s, the replicas' sum %.2f s)", took, connected - began,
                           refreshed - connected, time.monotonic() - refreshed)
        return Response(body, media_type="text/plain; version=0.0.4")

    connecting: dict[str, asyncio.Task] = {}

    async def health(request: Request, rid: str) -> Response:
        """Readiness: 200 once the engines are connected and healthy, else 503 within
        HEALTH_WAIT_S. It never waits for engines to register (that can take minutes
        while a cluster scales up): the connection attempt goes on in the background
        and the next probe sees how it went."""
        if request.app.state.stopping:  # load balancers take this replica out
            raise HTTPError(503, "the server is stopping", "ServiceUnavailableError")
        task = connecting.get("task")
        if task is None or task.done():
            task = connecting["task"] = asyncio.ensure_future(get_client())
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # seen here
        done, _ = await asyncio.wait({task}, timeout=HEALTH_WAIT_S)
        if not done:
            raise HTTPError(503, "the engines are not connected yet", "ServiceUnavailableError")
        client = task.result()  # a failed connection is its own (mapped) error
        if not client.healthy:
            raise HTTPError(503, str(client.dead_error or "unhealthy"), "ServiceUnavailableError")
        return Response(status_code=200)

    async def tokenize(request: Request, rid: str) -> Response:
        body = await _body(request, TokenizeRequest)
        client = await get_client()
        processor = client.processor
        if body.messages is not None:  # the prompt /v1/chat/completions would build
            conversation = ChatCompletionRequest(messages=body.messages).conversation()
            text = render_chat_prompt(processor, conversation, ToolPlan([], None, None),
                                      options.chat_template, body.add_generation_prompt, {})
            special = ("add_special_tokens" in body.model_fields_set
                       and body.add_special_tokens)
            ids = processor.tokenizer.encode(text, add_special_tokens=special)
        elif body.prompt is not None:
            ids = processor.tokenizer.encode(body.prompt,
                                             add_special_tokens=body.add_special_tokens)
        else:
            raise HTTPError(400, "give a prompt or messages", "BadRequestError")
        return JSONResponse({"tokens": ids, "count": len(ids),
                             "max_model_len": client.max_model_len})

    async def detokenize(request: Request, rid: str) -> Response:
        body = await _body(request, DetokenizeRequest)
        client = await get_client()
        vocab = client.processor.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise HTTPError(400, f"token ids must be in [0, {vocab})", "BadRequestError", "tokens")
        return JSONResponse({"prompt": client.processor.tokenizer.decode(body.tokens)})

    # ---- control (admin) ------------------------------------------------------------------------
    async def is_sleeping(request: Request, rid: str) -> Response:
        return JSONResponse({"is_sleeping": await control.is_sleeping()})

    async def sleep(request: Request, rid: str) -> Response:
        level = request.query_params.get("level", "1")
        if level not in ("1", "2"):
            raise HTTPError(400, "level must be 1 or 2", "BadRequestError", "level")
        await control.sleep(int(level))
        return Response(status_code=200)

    async def wake_up(request: Request, rid: str) -> Response:
        tags = request.query_params.getlist("tags") or None
        await control.wake_up(tags)
        return Response(status_code=200)

    async def reset_prefix_cache(request: Request, rid: str) -> Response:
        flag = lambda name: request.query_params.get(name, "false").lower() in ("1", "true")
        ok = await control.reset_prefix_cache(flag("reset_running_requests"),
                                              flag("reset_external"))
        return JSONResponse({"success": ok}, status_code=200)

    routes = [
        Route("/v1/completions", endpoint(completions), methods=["POST"]),
        Route("/v1/chat/completions", endpoint(chat_completions), methods=["POST"]),
        Route("/v1/embeddings", endpoint(embeddings), methods=["POST"]),
        Route("/v1/models", endpoint(models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", endpoint(retrieve_model), methods=["GET"]),
        Route("/v1/load_lora_adapter", endpoint(load_lora_adapter, admin=True),
              methods=["POST"]),
        Route("/v1/unload_lora_adapter", endpoint(unload_lora_adapter, admin=True),
              methods=["POST"]),
        Route("/version", endpoint(version, auth=False), methods=["GET"]),
        Route("/openapi.json", endpoint(openapi, auth=False), methods=["GET"]),
        Route("/tokenize", endpoint(tokenize), methods=["POST"]),
        Route("/detokenize", endpoint(detokenize), methods=["POST"]),
        Route("/health", endpoint(health, auth=False), methods=["GET"]),
        Route("/metrics", endpoint(metrics_endpoint, auth=options.metrics_need_api_key),
              methods=["GET"]),
        Route("/is_sleeping", endpoint(is_sleeping, admin=True), methods=["GET"]),
        Route("/sleep", endpoint(sleep, admin=True), methods=["POST"]),
        Route("/wake_up", endpoint(wake_up, admin=True), methods=["POST"]),
        Route("/reset_prefix_cache", endpoint(reset_prefix_cache, admin=True), methods=["POST"]),
    ]
    app = Starlette(routes=routes)
    app.state.metrics = metrics  # the ingress reports its snapshot from here too
    app.state.stopping = False  # set when the server stops: /health and new requests 503
    return app
