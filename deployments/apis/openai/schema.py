"""The API's response models and its OpenAPI document, generated from the models.

The app builds its JSON bodies directly (pydantic on every SSE chunk would cost more
than the chunk), so these models describe the responses rather than build them;
tests/test_openapi.py validates real responses against them, which keeps the two
honest. openapi_document() assembles /openapi.json from ROUTES: each route's request
model (deployments/apis/openai/protocol.py), its response model here, and the error shape
every route shares. Nothing in the document is written by hand.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from deployments.apis.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """Every error, any route: OpenAI's shape."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """None entries: an echoed prompt's first token, which nothing predicts."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptTokenLogprob(BaseModel):
    logprob: float
    rank: int | None
    decoded_token: str | None


# vLLM's prompt_logprobs: per prompt token (null first), {token id: its logprob}
PromptLogprobs = list[dict[str, PromptTokenLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # with prompt_logprobs: this choice's prompt


class CompletionResponse(BaseModel):
    """A completion; streamed, each SSE `data:` event is one of these (choices hold the
    new text; the last may carry only usage)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # with prompt_logprobs


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    """One SSE `data:` event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32 (encoding_format)


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"]
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class ModelCard(BaseModel):
    """The base model, or a LoRA adapter on it (root: its path, parent: the base)."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    root: str | None = None
    parent: str | None = None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class IsSleepingResponse(BaseModel):
    is_sleeping: bool


class ResetPrefixCacheResponse(BaseModel):
    success: bool


class LoRAAdapterResponse(BaseModel):
    success: bool
    message: str


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


ROUTES: tuple[RouteDoc, ...] = (
    RouteDoc("/v1/completions", "post", "Create a completion", CompletionRequest,
             CompletionResponse, CompletionResponse),
    RouteDoc("/v1/chat/completions", "post", "Create a chat completion",
             ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk),
    RouteDoc("/v1/embeddings", "post", "Create embeddings", EmbeddingRequest,
             EmbeddingResponse),
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
    models: list[type[BaseModel]] = [ErrorResponse]
    for route in ROUTES:
        models += [m for m in (route.request, route.response, route.stream) if m is not None]
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
                "schema": ref(ErrorResponse)}}} for code, why in _ERRORS.items()}}}
        if route.request is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": ref(route.request)}}}
        params = [{"name": "model_id", "in": "path", "required": True,
                   "schema": {"type": "string"}}] if "{model_id}" in route.path else []
        params += [{"name": q, "in": "query", "required": False,
                    "schema": {"type": "string"}} for q in route.query]
        if params:
            op["parameters"] = params
        if route.auth != "none":
            op["security"] = [{"bearer": []}]
        paths.setdefault(route.path, {})[route.method] = op
    return {"openapi": "3.1.0",
            "info": {"title": "Flotilla OpenAI-compatible API", "version": version},
            "paths": paths,
            "components": {"schemas": defs.get("$defs", {}), "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"}}}}
