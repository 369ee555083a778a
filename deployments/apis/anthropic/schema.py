"""The Messages API's response models, for the OpenAPI document (deployments/apis/openapi.py).

They describe what deployments/apis/anthropic/render.py builds; tests/test_anthropic_api.py
checks real responses against them, and the anthropic SDK parses the same shapes.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class AnthropicErrorDetail(BaseModel):
    type: str  # invalid_request_error, authentication_error, not_found_error, ...
    message: str


class AnthropicError(BaseModel):
    """Every error of /v1/messages*: Anthropic's shape."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None


class MessageObject(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]  # text, thinking and tool_use blocks, in order
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: MessageUsage


class MessageStreamEvent(BaseModel):
    """One event of a streamed message (`event: <type>` then `data:` this object):
    message_start, content_block_start / _delta / _stop, message_delta, message_stop."""

    model_config = ConfigDict(extra="allow")
    type: str


class TokenCount(BaseModel):
    input_tokens: int
