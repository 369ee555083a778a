"""Anthropic's Messages endpoints: POST /v1/messages and /v1/messages/count_tokens.

The flow is chat completions' (deployments.apis.openai.routes): validate the body,
translate it to the neutral ChatInput, prepare the prompt (off the event loop when
heavy), generate, and render the neutral events, here in Anthropic's shapes. Errors
are Anthropic's JSON, and the API key may come as `x-api-key` (what Anthropic's
clients send) as well as a Bearer token. The `anthropic-version` and
`anthropic-beta` headers are protocol negotiation and are not read.
"""
from __future__ import annotations

import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from deployments.apis.anthropic.protocol import CountTokensRequest, MessagesRequest
from deployments.apis.anthropic.render import (
    MessageShape,
    anthropic_error_response,
    full_message,
    new_message_id,
    sse_events,
)
from deployments.apis.context import ApiContext
from deployments.apis.streaming import ClosingStreamingResponse
from deployments.apis.events import Generation


def anthropic_routes(ctx: ApiContext) -> list[Route]:
    """The Messages routes over the app's shared context."""

    async def messages(request: Request, rid: str) -> Response:
        body = await ctx.body(request, MessagesRequest)
        scheduling = ctx.scheduling(body, request)
        client = await ctx.get_client()
        prepared = await ctx.prepare_chat(request, body.chat_input())
        params = body.sampling_params(prepared.structured, client.sampling_defaults)
        stream = client.generate(f"msg-{rid}-{uuid.uuid4().hex[:8]}", prepared.prompt,
                                 params, lora_request=await ctx.adapter(body), **scheduling)
        gen = Generation(stream, prepared.plan, ctx.record)
        shape = MessageShape(new_message_id(), body.model or ctx.model,
                             tuple(body.stop_sequences or ()), body.omit_thinking)
        if body.stream:
            first = await ctx.first(stream)  # errors before the first token: HTTP errors
            gen.interval_s = ctx.options.stream_interval_s
            return ClosingStreamingResponse(sse_events(gen, first, shape), gen.aclose,
                                            media_type="text/event-stream")
        return JSONResponse(await full_message(gen, shape))

    async def count_tokens(request: Request, rid: str) -> Response:
        body = await ctx.body(request, CountTokensRequest)
        prepared = await ctx.prepare_chat(request, body.chat_input())
        return JSONResponse({"input_tokens": len(prepared.prompt["prompt_token_ids"])})

    def endpoint(handler):
        return ctx.endpoint(handler, errors=anthropic_error_response, x_api_key=True)

    return [
        Route("/v1/messages", endpoint(messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", endpoint(count_tokens), methods=["POST"]),
    ]
