"""POST /v1/responses, GET and DELETE /v1/responses/{id}: the OpenAI Responses API.

A request becomes the neutral chat input (deployments.apis.responses.protocol), runs
like a chat completion (the same template, tool plan, reasoning split and structured
outputs), and its events are folded into output items (ResponseBuilder). With `store`
(the default, as OpenAI's), the response and the conversation that led to it are kept
in the app's response store, which every ingress replica reaches, so a follow-up
naming it as `previous_response_id` may land anywhere.
"""
from __future__ import annotations

import logging
from typing import Any, AsyncIterator

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from deployments.apis.common.chat_prep import ChatInput
from deployments.apis.context import ApiContext
from deployments.apis.streaming import ClosingStreamingResponse
from deployments.apis.errors import HTTPError, map_error
from deployments.apis.events import Generation
from deployments.apis.responses.protocol import ResponsesRequest, input_messages
from deployments.apis.responses.render import ResponseBuilder, new_id
from engine.errors import RequestTimeoutError

_JSON = msgspec.json.Encoder()
logger = logging.getLogger(__name__)


def _sse(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + _JSON.encode(event) + b"\n\n"


def responses_routes(ctx: ApiContext) -> list[Route]:

    async def conversation_of(body: ResponsesRequest) -> list[dict[str, Any]]:
        """The previous response's conversation (when named), then this input."""
        earlier: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            record = await ctx.store.get_response(body.previous_response_id)
            if record is None:
                raise HTTPError(404, f"Previous response with id "
                                f"'{body.previous_response_id}' not found.",
                                "NotFoundError", "previous_response_id")
            earlier = list(record["conversation"])
        return earlier + input_messages(body.input)

    async def create(request: Request, rid: str) -> Response:
        body = await ctx.body(request, ResponsesRequest)
        scheduling = ctx.scheduling(body, request)
        if body.prompt_cache_key is not None and scheduling["session_id"] is None:
            scheduling["session_id"] = body.prompt_cache_key  # one engine: its prefix cache
        conversation = await conversation_of(body)
        system = ([{"role": "system", "content": body.instructions}]
                  if body.instructions is not None else [])
        chat = ChatInput(conversation=system + conversation, tools=body.function_tools(),
                         tool_choice=body.effective_tool_choice(),
                         parallel_tool_calls=body.parallel_tool_calls,
                         template_kwargs=body.chat_template_kwargs or {},
                         structured=body.structured(), structured_param="text.format")
        prepared = await ctx.prepare_chat(request, chat)
        client = await ctx.get_client()
        params = body.sampling_params(client.sampling_defaults, prepared.structured)
        response_id = new_id("resp")
        stream = client.generate(f"{response_id}-{rid}", prepared.prompt, params,
                                 lora_request=await ctx.adapter(body), **scheduling)
        gen = Generation(stream, prepared.plan, ctx.record, _counter(client))
        builder = ResponseBuilder(body, ctx.model, response_id)

        async def finish() -> dict[str, Any]:
            final = builder.response(builder.status(), gen.usage)
            if body.store is not False:
                final["store"] = await _put(ctx, response_id, {
                    "response": final,
                    "conversation": conversation + builder.assistant_messages()})
            return final

        if not body.stream:
            try:
                async for step in gen.steps():
                    builder.feed(step.events)
                builder.close()
            except RequestTimeoutError:
                u = gen.usage
                raise HTTPError(408, "the request passed its deadline and was aborted",
                                "TimeoutError", usage={"input_tokens": u.prompt_tokens,
                                                       "output_tokens": u.completion_tokens})
            return JSONResponse(await finish())
        first = await ctx.first(stream)  # errors before the first token stay HTTP errors

        async def events() -> AsyncIterator[bytes]:
            for e in builder.start():
                yield _sse(e)
            try:
                async for step in gen.steps(first):
                    for e in builder.feed(step.events):
                        yield _sse(e)
                for e in builder.close():
                    yield _sse(e)
                final = await finish()
                kind = ("response.completed" if final["status"] == "completed" else
                        "response.incomplete")
                yield _sse(builder.event(kind, response=final))
            except Exception as exc:  # noqa: BLE001 - in-band: the status is already sent
                err = map_error(exc)
                yield _sse(builder.event("error", code=err.err_type, message=err.message,
                                         param=err.param))
                failed = builder.response("failed", gen.usage, {"code": "server_error",
                                                                "message": err.message})
                yield _sse(builder.event("response.failed", response=failed))
            finally:
                await gen.aclose()
        gen.interval_s = ctx.options.stream_interval_s
        return ClosingStreamingResponse(events(), gen.aclose, media_type="text/event-stream")

    async def retrieve(request: Request, rid: str) -> Response:
        record = await ctx.store.get_response(request.path_params["response_id"])
        if record is None:
            raise _not_found(request.path_params["response_id"])
        return JSONResponse(record["response"])

    async def delete(request: Request, rid: str) -> Response:
        response_id = request.path_params["response_id"]
        if not await ctx.store.delete_response(response_id):
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    return [
        Route("/v1/responses", ctx.endpoint(create), methods=["POST"]),
        Route("/v1/responses/{response_id}", ctx.endpoint(retrieve), methods=["GET"]),
        Route("/v1/responses/{response_id}", ctx.endpoint(delete), methods=["DELETE"]),
    ]


async def _put(ctx: ApiContext, response_id: str, record: dict[str, Any]) -> bool:
    """Store a finished response; False (and the response says `store: false`) when the
    store could not keep it: the generation is not failed for it."""
    try:
        if await ctx.store.put_response(response_id, record):
            return True
        logger.warning("response %s not stored: larger than the response store", response_id)
    except Exception as exc:  # noqa: BLE001 - the coordinator restarting or not answering
        logger.warning("response %s not stored: %s", response_id, exc)
    return False


def _not_found(response_id: str) -> HTTPError:
    return HTTPError(404, f"Response with id '{response_id}' not found.", "NotFoundError")


def _counter(client) -> Any:
    tokenizer = client.processor.tokenizer
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))
