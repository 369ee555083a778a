"""The OpenAI API's response models, for the OpenAPI document (deployments/apis/openapi.py).

The app builds its JSON bodies directly (pydantic on every SSE chunk would cost more
than the chunk), so these models describe the responses rather than build them;
tests/test_openapi.py validates real responses against them, which keeps the two
honest.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel



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
    reasoning_content: str | None = None  # with a reasoning parser: the thinking
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
    reasoning_content: str | None = None  # with a reasoning parser: the thinking
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
