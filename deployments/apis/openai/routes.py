"""OpenAI's generation endpoints: /v1/completions, /v1/chat/completions, /v1/embeddings.

Each handler validates its body (deployments.apis.openai.protocol), builds the engine
request(s), and renders the neutral events (deployments.apis.events) in OpenAI's shapes
(deployments.apis.openai.render).
"""
from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from deployments.apis.common.chat_prep import ChatInput
from deployments.apis.context import ApiContext
from deployments.apis.errors import CONSTRAINT_FIELDS
from deployments.apis.events import Generation, OutputPlan
from deployments.apis.openai.prompt_batch import echo_prompt, merge_prompt_streams
from deployments.apis.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    NamedToolChoice,
)
from deployments.apis.openai.render import Shape, full_response, sse_chunks
from deployments.apis.streaming import ClosingStreamingResponse
from engine.errors import EngineRequestError
from engine.outputs import OutputKind, RequestOutput
from engine.pooling import PoolingParams
from engine.request_limits import check_fanout
from engine.sampling_params import SamplingParams


def chat_input(body: ChatCompletionRequest) -> ChatInput:
    """A chat completions request as the neutral chat input."""
    choice = body.effective_tool_choice
    if isinstance(choice, NamedToolChoice):
        choice = choice.function.name
    return ChatInput(
        conversation=body.conversation(),
        tools=[t.model_dump(exclude_none=True) for t in body.tools or ()],
        tool_choice=choice, parallel_tool_calls=body.parallel_tool_calls,
        template_kwargs=body.chat_template_kwargs or {},
        add_generation_prompt=body.add_generation_prompt,
        structured=body.structured_outputs_params(), structured_param=_constraint_field(body))


def _constraint_field(body: ChatCompletionRequest) -> str:
    for name in CONSTRAINT_FIELDS:
        if getattr(body, name) is not None:
            return name
    return "response_format"


def openai_routes(ctx: ApiContext) -> list[Route]:
    model = ctx.model

    async def completions(request: Request, rid: str) -> Response:
        body = await ctx.body(request, CompletionRequest)
        scheduling = ctx.scheduling(body, request)
        client = await ctx.get_client()
        params = body.sampling_params(body.max_tokens, body.logprobs,
                                      body.structured_outputs_params(),
                                      client.sampling_defaults, body.engine_prompt_logprobs())
        request_id = f"cmpl-{rid}-{uuid.uuid4().hex[:8]}"
        prompts = body.prompts()
        check_fanout(len(prompts), params.n, client.processor.limits)
        lora = await ctx.adapter(body)
        streams = []
        for i, prompt in enumerate(prompts):
            rid_i = request_id if len(prompts) == 1 and not body.echo else f"{request_id}-{i}"
            stream = client.generate(rid_i, prompt, params, lora_request=lora, **scheduling)
            if body.echo:
                text = prompt if isinstance(prompt, str) else \
                    client.processor.tokenizer.decode(prompt)
                stream = echo_prompt(stream, text)
            streams.append(stream)
        merged = streams[0] if len(streams) == 1 else merge_prompt_streams(streams, params.n)
        shape = Shape(False, params.logprobs or 0, body.prompt_logprobs is not None,
                      bool(body.echo) and body.logprobs is not None,
                      client.processor.tokenizer.decode)
        return await respond(merged, request_id, body, len(prompts) * params.n, shape,
                             OutputPlan())

    async def chat_completions(request: Request, rid: str) -> Response:
        body = await ctx.body(request, ChatCompletionRequest)
        scheduling = ctx.scheduling(body, request)
        client = await ctx.get_client()
        chat = chat_input(body)
        prepared = await ctx.prepare_chat(request, chat)
        params = body.sampling_params(body.token_limit(), body.logprob_count(),
                                      prepared.structured, client.sampling_defaults,
                                      body.prompt_logprobs)
        check_fanout(1, params.n, client.processor.limits)
        request_id = f"chatcmpl-{rid}-{uuid.uuid4().hex[:8]}"
        stream = client.generate(request_id, prepared.prompt, params,
                                 lora_request=await ctx.adapter(body), **scheduling)
        shape = Shape(True, params.logprobs or 0, body.prompt_logprobs is not None, False,
                      client.processor.tokenizer.decode,
                      reasoning=prepared.plan.reasoning is not None)
        return await respond(stream, request_id, body, params.n, shape, prepared.plan)

    async def respond(stream, request_id: str, body, choices: int, shape: Shape,
                      plan: OutputPlan) -> Response:
        """choices: how many the response has (n per prompt, prompts x n in all)."""
        gen = Generation(stream, plan, ctx.record)
        created = int(time.time())
        if body.stream:
            first = await ctx.first(stream)  # errors before the first token: HTTP errors
            gen.interval_s = ctx.options.stream_interval_s
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return ClosingStreamingResponse(
                sse_chunks(gen, first, request_id, created, model, include_usage, shape),
                gen.aclose, media_type="text/event-stream")
        return JSONResponse(await full_response(gen, request_id, created, model, choices,
                                                shape))

    async def embeddings(request: Request, rid: str) -> Response:
        body = await ctx.body(request, EmbeddingRequest)
        scheduling = ctx.scheduling(body, request)  # one deadline for every input
        scheduling.pop("session_id", None)
        client = await ctx.get_client()
        pooling = PoolingParams(dimensions=body.dimensions)
        lora = await ctx.adapter(body)
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
        data: list[dict[str, Any]] = []
        for i, out in enumerate(outs):
            vector = out.outputs[0].embedding
            if body.encoding_format == "base64":
                vector = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"object": "embedding", "index": i, "embedding": vector})
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        return JSONResponse({"object": "list", "data": data, "model": model,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    return [
        Route("/v1/completions", ctx.endpoint(completions), methods=["POST"]),
        Route("/v1/chat/completions", ctx.endpoint(chat_completions), methods=["POST"]),
        Route("/v1/embeddings", ctx.endpoint(embeddings), methods=["POST"]),
    ]
