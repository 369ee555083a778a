"""The app's OpenAPI document (/openapi.json), generated from the pydantic models of
every API: each route's request model (the APIs' protocol modules), its response model
(their schema modules), its stream event model, and its error shape. Nothing in the
document is written by hand; tests/test_openapi.py checks it names every route served.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from deployments.apis.anthropic.protocol import CountTokensRequest, MessagesRequest
from deployments.apis.anthropic.schema import (
    AnthropicError,
    MessageObject,
    MessageStreamEvent,
    TokenCount,
)
from deployments.apis.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from deployments.apis.openai.schema import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    EmbeddingResponse,
    ErrorResponse,
    IsSleepingResponse,
    LoRAAdapterResponse,
    ModelCard,
    ModelList,
    ResetPrefixCacheResponse,
    TokenizeResponse,
    VersionResponse,
)
from deployments.apis.responses.protocol import ResponsesRequest
from deployments.apis.responses.schema import (
    DeletedResponse,
    ResponseObject,
    ResponseStreamEvent,
)


@dataclass(frozen=True)
class RouteDoc:
    path: str
    method: str
    summary: str
    request: type[BaseModel] | None = None
    response: type[BaseModel] | None = None  # None: an empty 200
    stream: type[BaseModel] | None = None  # the SSE event model, for streaming routes
    auth: Literal["api", "admin", "none"] = "api"
    query: tuple[str, ...] = ()  # query parameters (strings)
    error: type[BaseModel] = ErrorResponse  # the error body's shape


ROUTES: tuple[RouteDoc, ...] = (
    RouteDoc("/v1/completions", "post", "Create a completion", CompletionRequest,
             CompletionResponse, CompletionResponse),
    RouteDoc("/v1/chat/completions", "post", "Create a chat completion",
             ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk),
    RouteDoc("/v1/embeddings", "post", "Create embeddings", EmbeddingRequest,
             EmbeddingResponse),
    RouteDoc("/v1/responses", "post", "Create a response (OpenAI Responses API)",
             ResponsesRequest, ResponseObject, ResponseStreamEvent),
    RouteDoc("/v1/responses/{response_id}", "get", "Retrieve a stored response", None,
             ResponseObject),
    RouteDoc("/v1/responses/{response_id}", "delete", "Delete a stored response", None,
             DeletedResponse),
    RouteDoc("/v1/messages", "post", "Create a message (Anthropic Messages API; the key "
             "as x-api-key or Bearer)", MessagesRequest, MessageObject, MessageStreamEvent,
             error=AnthropicError),
    RouteDoc("/v1/messages/count_tokens", "post", "Count a message request's input tokens",
             CountTokensRequest, TokenCount, error=AnthropicError),
    RouteDoc("/v1/models", "get", "List the served model and its LoRA adapters", None,
             ModelList),
    RouteDoc("/v1/models/{model_id}", "get", "Retrieve the served model or an adapter", None,
             ModelCard),
    RouteDoc("/v1/load_lora_adapter", "post", "Load a LoRA adapter on every engine",
             LoadLoRAAdapterRequest, LoRAAdapterResponse, auth="admin"),
    RouteDoc("/v1/unload_lora_adapter", "post", "Unload a LoRA adapter (requests running "
             "with it finish)", UnloadLoRAAdapterRequest, LoRAAdapterResponse, auth="admin"),
    RouteDoc("/tokenize", "post", "Tokenize a prompt or chat messages", TokenizeRequest,
             TokenizeResponse),
    RouteDoc("/detokenize", "post", "Token ids to text", DetokenizeRequest,
             DetokenizeResponse),
    RouteDoc("/version", "get", "Flotilla's version", None, VersionResponse, auth="none"),
    RouteDoc("/health", "get", "200 while the engines are healthy, else 503", auth="none"),
    RouteDoc("/metrics", "get", "Prometheus metrics (vLLM's names)", auth="none"),
    RouteDoc("/openapi.json", "get", "This document", auth="none"),
    RouteDoc("/is_sleeping", "get", "Whether the engines sleep", None, IsSleepingResponse,
             auth="admin"),
    RouteDoc("/sleep", "post", "Put the engines to sleep", auth="admin", query=("level",)),
    RouteDoc("/wake_up", "post", "Wake the engines up", auth="admin", query=("tags",)),
    RouteDoc("/reset_prefix_cache", "post", "Drop the engines' prefix caches", None,
             ResetPrefixCacheResponse, auth="admin",
             query=("reset_running_requests", "reset_external")),
)

_ERRORS = {"400": "invalid request", "401": "missing or wrong API key",
           "404": "unknown model or route", "413": "request body too large",
           "500": "internal error", "503": "engines unavailable, asleep or draining"}


def openapi_document(version: str) -> dict[str, Any]:
    """OpenAPI 3.1 for ROUTES, schemas generated from the pydantic models."""
    models: list[type[BaseModel]] = []
    for route in ROUTES:
        models += [m for m in (route.request, route.response, route.stream, route.error)
                   if m is not None]
    unique = list(dict.fromkeys(models))
    keys = [(m, "validation" if m in {r.request for r in ROUTES} else "serialization")
            for m in unique]
    refs, defs = models_json_schema(keys, ref_template="#/components/schemas/{model}")

    def ref(model: type[BaseModel]) -> dict[str, Any]:
        mode = "validation" if model in {r.request for r in ROUTES} else "serialization"
        return refs[(model, mode)]

    paths: dict[str, Any] = {}
    for route in ROUTES:
        ok: dict[str, Any] = {"description": "OK"}
        content: dict[str, Any] = {}
        if route.response is not None:
            content["application/json"] = {"schema": ref(route.response)}
        if route.stream is not None:
            content["text/event-stream"] = {"schema": ref(route.stream)}
            ok["description"] = ("OK. With stream=true, text/event-stream: one "
                                 "`data: <event>` line per event, then `data: [DONE]`")
        if content:
            ok["content"] = content
        op: dict[str, Any] = {"summary": route.summary, "responses": {"200": ok, **{
            code: {"description": why, "content": {"application/json": {
                "schema": ref(route.error)}}} for code, why in _ERRORS.items()}}}
        if route.request is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": ref(route.request)}}}
        params = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                  for name in re.findall(r"\{(\w+)\}", route.path)]
        params += [{"name": q, "in": "query", "required": False,
                    "schema": {"type": "string"}} for q in route.query]
        if params:
            op["parameters"] = params
        if route.auth != "none":
            op["security"] = [{"bearer": []}]
        paths.setdefault(route.path, {})[route.method] = op
    return {"openapi": "3.1.0",
            "info": {"title": "Flotilla: OpenAI-compatible (chat, completions, "
                     "Responses) and Anthropic Messages APIs", "version": version},
            "paths": paths,
            "components": {"schemas": defs.get("$defs", {}), "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"}}}}
