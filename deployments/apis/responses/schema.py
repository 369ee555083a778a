"""The Responses API's response models, for the OpenAPI document (deployments/apis/openapi.py).

Like the OpenAI models, they describe what the app builds rather than build it;
tests/test_responses_api.py validates real responses against them (and the openai SDK
parses them, which checks the same shapes from the client's side).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"]
    text: str


class MessageItem(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class ReasoningItem(BaseModel):
    id: str
    type: Literal["reasoning"]
    summary: list[Any]
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


class FunctionCallItem(BaseModel):
    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[MessageItem | ReasoningItem | FunctionCallItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, Any]
    store: bool
    temperature: float | None
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float | None
    truncation: Literal["disabled"]
    user: str | None
    metadata: dict[str, str]
    usage: ResponseUsage | None


class ResponseStreamEvent(BaseModel):
    """One event of a streamed response: `event: <type>` then `data:` this object; its
    other fields depend on the type (response.created, response.output_item.added,
    response.output_text.delta, response.function_call_arguments.delta,
    response.reasoning_text.delta, ..., response.completed)."""

    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"]
    deleted: Literal[True]
