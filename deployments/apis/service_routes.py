"""The service endpoints beside the generation APIs: models, LoRA adapters, tokenize,
health, metrics, version, the OpenAPI document, and the control (admin) endpoints.

The control endpoints act on every engine through `ctx.control` (the coordinator in
Serve, which owns the aggregation rules; ClientControl elsewhere).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from deployments.apis.common.tools import NO_TOOLS, render_chat_prompt
from deployments.apis.context import ApiContext
from deployments.apis.errors import HTTPError, cause
from deployments.apis.openai.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from engine.errors import UtilityCallError
from engine.frontend.prep_offload import INLINE_CHARS
from engine.lora.request import LoRARequest

logger = logging.getLogger(__name__)
HEALTH_WAIT_S = 0.9  # /health answers within a second, connected or not
STATS_WAIT_S = 0.5  # a scrape asks the engines for their stats, waiting this long at most
STATS_MAX_AGE_S = 1.0  # ... when their last (from outputs, heartbeats) are older than this
SUM_WAIT_S = 0.5  # and waits this long for the sum over the replicas (else its last, raised)
# ... unless the replica's last sum (its reports bring one every second) is this recent:
# then it serves that without waiting (an await costs a loaded loop's pass, 0.1-0.2 s)
SUM_FRESH_S = 3.0
SUM_ANSWER_S = 30.0  # a scrape's report keeps its answer this long at most
SLOW_SCRAPE_S = 1.0  # a scrape slower than this is logged with where its time went



def service_routes(ctx: ApiContext) -> list[Route]:
    # ---- other routes -------------------------------------------------------------------------
    async def model_card() -> dict[str, Any]:
        client = await ctx.get_client()
        return {"id": ctx.model, "object": "model", "created": 0, "owned_by": "flotilla",
                "max_model_len": client.max_model_len}

    def adapter_card(lora: LoRARequest, base: dict[str, Any]) -> dict[str, Any]:
        # root names the adapter, not its folder: paths are the server's business
        return {**base, "id": lora.lora_name, "root": lora.lora_name, "parent": ctx.model}

    async def models(request: Request, rid: str) -> Response:
        base = await model_card()
        cards = [base] + [adapter_card(a, base) for a in await ctx.adapters.listing()]
        return JSONResponse({"object": "list", "data": cards})

    async def retrieve_model(request: Request, rid: str) -> Response:
        name = request.path_params["model_id"]
        if name == ctx.model:
            return JSONResponse(await model_card())
        lora = await ctx.adapters.resolve(name)
        if lora is None:
            raise HTTPError(404, f"The model `{name}` does not exist.", "NotFoundError", "model")
        return JSONResponse(adapter_card(lora, await model_card()))

    async def load_lora_adapter(request: Request, rid: str) -> Response:
        body = await ctx.body(request, LoadLoRAAdapterRequest)
        try:
            await ctx.adapters.load(body.lora_name, body.lora_path)
        except Exception as exc:  # a name taken, or an engine refused it (it says why)
            inner = cause(exc)
            if isinstance(inner, (ValueError, UtilityCallError)):
                raise HTTPError(400, str(inner), "BadRequestError", "lora_path") from None
            raise
        return JSONResponse({"success": True,
                             "message": f"LoRA adapter {body.lora_name!r} loaded"})

    async def unload_lora_adapter(request: Request, rid: str) -> Response:
        body = await ctx.body(request, UnloadLoRAAdapterRequest)
        if not await ctx.adapters.unload(body.lora_name):
            raise HTTPError(404, f"The LoRA adapter `{body.lora_name}` is not loaded.",
                            "NotFoundError", "lora_name")
        return JSONResponse({"success": True,
                             "message": f"LoRA adapter {body.lora_name!r} unloaded"})

    async def version(request: Request, rid: str) -> Response:
        from engine import __version__
        return JSONResponse({"version": __version__})

    async def openapi(request: Request, rid: str) -> Response:
        from deployments.apis.openapi import openapi_document
        from engine import __version__
        return JSONResponse(openapi_document(__version__))

    async def metrics_endpoint(request: Request, rid: str) -> Response:
        # Under load every await that yields costs the scrape a pass of the event loop
        # (0.2-0.4 s with 128 streams a replica on 2 cores) and the coordinator's answer
        # takes several (0.5-0.8 s, issue 62): the replicas' sum is asked first, a
        # healthy client is taken without a task, and a recent sum is served (raised to
        # this replica's counts) rather than waited for. The scrape's report still
        # reaches the sum, so another replica's scrape a second later counts it.
        began = time.monotonic()
        # the answer is kept however late (SUM_ANSWER_S at most): the next scrape's sum
        summing = asyncio.ensure_future(ctx.metrics.sum_over_replicas(ctx.control,
                                                                      SUM_ANSWER_S))
        summing.add_done_callback(lambda t: t.cancelled() or t.exception())  # seen here
        # the replica's current client: it may have moved to another engine set since its
        # last request (the gauges were those of the retired client, the chaos run found)
        client = ctx.current_client()
        if client is None:
            try:
                client = await asyncio.wait_for(asyncio.shield(ctx.get_client()), STATS_WAIT_S)
            except Exception:  # noqa: BLE001 - no engines yet: serve what there is
                client = ctx.seen.get("client")
        connected = time.monotonic()
        if client is not None:  # the engines' values at most a stats interval old
            try:
                await client.refresh_stats(STATS_MAX_AGE_S, STATS_WAIT_S)
            except Exception as exc:  # noqa: BLE001 - serve what the outputs last brought
                logger.debug("metrics: engine stats not refreshed: %s", exc)
        refreshed = time.monotonic()
        if ctx.metrics.sum_age() > SUM_FRESH_S:
            await asyncio.wait({summing}, timeout=SUM_WAIT_S)
        body = ctx.metrics.exposition()
        took = time.monotonic() - began
        if took > SLOW_SCRAPE_S:
            logger.warning("metrics: a scrape took %.2f s (client %.2f s, engine stats "
                           "%.2f s, then the replicas' sum %.2f s)", took, connected - began,
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
            task = connecting["task"] = asyncio.ensure_future(ctx.get_client())
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # seen here
        done, _ = await asyncio.wait({task}, timeout=HEALTH_WAIT_S)
        if not done:
            raise HTTPError(503, "the engines are not connected yet", "ServiceUnavailableError")
        client = task.result()  # a failed connection is its own (mapped) error
        if not client.healthy:
            raise HTTPError(503, str(client.dead_error or "unhealthy"), "ServiceUnavailableError")
        # in Serve (a control with health_details: the coordinator's): whether it
        # answers, and what this replica serves from while it does not (its last
        # membership and adapter list): still a 200. Elsewhere an empty 200, as vLLM's
        details = getattr(ctx.control, "health_details", lambda: None)()
        if details is None:
            return Response(status_code=200)
        return JSONResponse({"status": "ok", **details, "adapters": ctx.adapters.details()})

    def encode(processor, body: TokenizeRequest) -> list[int]:
        if body.messages is not None:  # the prompt /v1/chat/completions would build
            conversation = ChatCompletionRequest(messages=body.messages).conversation()
            text = render_chat_prompt(processor, conversation, NO_TOOLS,
                                      ctx.options.chat_template, body.add_generation_prompt, {})
            special = ("add_special_tokens" in body.model_fields_set
                       and body.add_special_tokens)
            return processor.tokenizer.encode(text, add_special_tokens=special)
        return processor.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)

    async def tokenize(request: Request, rid: str) -> Response:
        """The ids a prompt or chat would be; rendering and tokenizing a large body run off
        the event loop, as a completion's do (the body is under the same max_body_bytes)."""
        body = await ctx.body(request, TokenizeRequest)
        if body.messages is None and body.prompt is None:
            raise HTTPError(400, "give a prompt or messages", "BadRequestError")
        client = await ctx.get_client()
        ids = await client.prep.run(request.state.body_bytes > INLINE_CHARS, encode,
                                    client.processor, body)
        return JSONResponse({"tokens": ids, "count": len(ids),
                             "max_model_len": client.max_model_len})

    async def detokenize(request: Request, rid: str) -> Response:
        body = await ctx.body(request, DetokenizeRequest)
        client = await ctx.get_client()
        vocab = client.processor.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise HTTPError(400, f"token ids must be in [0, {vocab})", "BadRequestError", "tokens")
        text = await client.prep.run(request.state.body_bytes > INLINE_CHARS,
                                     client.processor.tokenizer.decode, body.tokens)
        return JSONResponse({"prompt": text})

    # ---- control (admin) ------------------------------------------------------------------------
    async def is_sleeping(request: Request, rid: str) -> Response:
        return JSONResponse({"is_sleeping": await ctx.control.is_sleeping()})

    async def sleep(request: Request, rid: str) -> Response:
        level = request.query_params.get("level", "1")
        if level not in ("1", "2"):
            raise HTTPError(400, "level must be 1 or 2", "BadRequestError", "level")
        await ctx.control.sleep(int(level))
        return Response(status_code=200)

    async def wake_up(request: Request, rid: str) -> Response:
        tags = request.query_params.getlist("tags") or None
        await ctx.control.wake_up(tags)
        return Response(status_code=200)

    async def reset_prefix_cache(request: Request, rid: str) -> Response:
        flag = lambda name: request.query_params.get(name, "false").lower() in ("1", "true")
        ok = await ctx.control.reset_prefix_cache(flag("reset_running_requests"),
                                              flag("reset_external"))
        return JSONResponse({"success": ok}, status_code=200)

    endpoint = ctx.endpoint
    return [
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
        Route("/metrics", endpoint(metrics_endpoint, auth=ctx.options.metrics_need_api_key),
              methods=["GET"]),
        Route("/is_sleeping", endpoint(is_sleeping, admin=True), methods=["GET"]),
        Route("/sleep", endpoint(sleep, admin=True), methods=["POST"]),
        Route("/wake_up", endpoint(wake_up, admin=True), methods=["POST"]),
        Route("/reset_prefix_cache", endpoint(reset_prefix_cache, admin=True), methods=["POST"]),
    ]
