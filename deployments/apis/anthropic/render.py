"""Anthropic's response shapes from the neutral generation events
(deployments.apis.events): the Message object, its SSE stream, and errors.

One path builds both responses: `Blocks` turns events into the stream's content-block
events (a block starts when the kind of output changes: reasoning, text, tool call n),
and the whole Message is the fold of those events (`fold`), as the SDK folds a stream.
So a streamed and a non-streamed answer cannot disagree.
"""
from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

import msgspec
from starlette.responses import JSONResponse

from deployments.apis.errors import TIMEOUT_MESSAGE, HTTPError, map_error, usage_dict
from deployments.apis.events import (
    ChoiceEnd,
    Event,
    Generation,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
)
from engine.errors import RequestTimeoutError
from engine.outputs import RequestOutput

logger = logging.getLogger(__name__)
_JSON = msgspec.json.Encoder()

# Thinking blocks carry a signature that Anthropic verifies when they are sent back.
# This server verifies nothing (thinking blocks sent back are dropped from the prompt);
# the value only fills the field clients expect to be a non-empty string.
SIGNATURE = "flotilla-unsigned"

# Anthropic's error types by HTTP status; Flotilla keeps its own statuses (503 for
# overloaded, where Anthropic uses 529; 408 for a request past its deadline).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                402: "billing_error", 403: "permission_error", 404: "not_found_error",
                408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                500: "api_error", 503: "overloaded_error", 504: "timeout_error",
                529: "overloaded_error"}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_error_body(err: HTTPError) -> dict[str, Any]:
    """{"type": "error", "error": {"type", "message"}}; a request that failed part way
    also reports its `usage` (Flotilla's addition, as on the OpenAI endpoints)."""
    message = err.message
    if err.param and err.param not in message:
        message = f"{err.param}: {message}"
    body: dict[str, Any] = {"type": "error",
                            "error": {"type": error_type(err.status), "message": message}}
    if err.usage is not None:
        body["usage"] = {"input_tokens": err.usage.get("prompt_tokens", 0),
                         "output_tokens": err.usage.get("completion_tokens", 0)}
    return body


def anthropic_error_response(err: HTTPError) -> JSONResponse:
    """The endpoint wrapper's error renderer for the Messages routes (keeps headers
    such as retry-after)."""
    response = JSONResponse(anthropic_error_body(err), status_code=err.status)
    response.headers.update(err.headers)
    return response


@dataclass(frozen=True)
class MessageShape:
    """What the response says besides the model's output."""

    id: str
    model: str
    stop_sequences: tuple[str, ...] = ()
    omit_thinking: bool = False  # thinking.display "omitted": blocks without their text


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def _tool_use_id(call_id: str | None) -> str:
    return "toolu_" + (call_id or uuid.uuid4().hex[:24]).removeprefix("call_")


def usage(prompt: int, cached: int, output: int) -> dict[str, int]:
    """Anthropic counts cache reads apart: input_tokens are the prompt's other tokens."""
    return {"input_tokens": prompt - cached, "output_tokens": output,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def stop_fields(end: ChoiceEnd | None, shape: MessageShape) -> tuple[str, str | None]:
    """stop_reason and stop_sequence for how the choice ended."""
    reason = end.finish_reason if end is not None else None
    if reason == "tool_calls":
        return "tool_use", None
    if reason == "length":
        return "max_tokens", None
    if end is not None and isinstance(end.stop_reason, str) \
            and end.stop_reason in shape.stop_sequences:
        return "stop_sequence", end.stop_reason
    return "end_turn", None


class Blocks:
    """One message's events as content-block stream events (dicts, each with its
    "type"); `close()` ends the open block."""

    def __init__(self, omit_thinking: bool = False) -> None:
        self.omit_thinking = omit_thinking
        self.index = -1  # the open block's index
        self.open: tuple | None = None  # ("thinking",), ("text",) or ("tool", call)

    def feed(self, event: Event) -> list[dict[str, Any]]:
        if isinstance(event, ReasoningDelta):
            out = self._switch(("thinking",), {"type": "thinking", "thinking": "",
                                               "signature": ""})
            if not self.omit_thinking:
                out.append(self._delta({"type": "thinking_delta", "thinking": event.text}))
            return out
        if isinstance(event, TextDelta):
            out = self._switch(("text",), {"type": "text", "text": ""})
            return out + [self._delta({"type": "text_delta", "text": event.text})]
        if isinstance(event, ToolCallDelta):
            out = []
            if event.name is not None:
                out = self._switch(("tool", event.call), {
                    "type": "tool_use", "id": _tool_use_id(event.id), "name": event.name,
                    "input": {}}, new=True)
            elif self.open != ("tool", event.call):
                logger.warning("tool call %d: arguments after its block closed, dropped",
                               event.call)
                return []
            if event.arguments:
                out.append(self._delta({"type": "input_json_delta",
                                        "partial_json": event.arguments}))
            return out
        return []

    def close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        out = []
        if self.open == ("thinking",):
            out.append(self._delta({"type": "signature_delta", "signature": SIGNATURE}))
        out.append({"type": "content_block_stop", "index": self.index})
        self.open = None
        return out

    def _switch(self, key: tuple, block: dict[str, Any], new: bool = False) -> list[dict]:
        if self.open == key and not new:
            return []
        out = self.close()
        self.index += 1
        self.open = key
        out.append({"type": "content_block_start", "index": self.index,
                    "content_block": block})
        return out

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}


def _tool_input(text: str) -> dict[str, Any]:
    """A tool call's arguments as the `input` object (the tool parsers only make calls
    whose arguments are a JSON object)."""
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError:
        value = None
    if not isinstance(value, dict):
        logger.warning("tool call arguments are not a JSON object: %.200r", text)
        return {}
    return value


def fold(events: list[dict[str, Any]], content: list[dict[str, Any]],
         partial_json: dict[int, str]) -> None:
    """Apply content-block stream events to a message's content, as a client would."""
    for e in events:
        kind = e["type"]
        if kind == "content_block_start":
            content.append(dict(e["content_block"]))
        elif kind == "content_block_delta":
            block, delta = content[e["index"]], e["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            elif delta["type"] == "input_json_delta":
                partial_json[e["index"]] = partial_json.get(e["index"], "") \
                    + delta["partial_json"]
        elif kind == "content_block_stop" and content[e["index"]]["type"] == "tool_use":
            content[e["index"]]["input"] = _tool_input(partial_json.get(e["index"], ""))


def _timeout(gen: Generation) -> HTTPError:
    u = gen.usage
    return HTTPError(408, TIMEOUT_MESSAGE, "TimeoutError",
                     usage=usage_dict(u.prompt_tokens, u.completion_tokens))


async def full_message(gen: Generation, shape: MessageShape) -> dict[str, Any]:
    """The whole Message (non-streamed)."""
    blocks = Blocks(shape.omit_thinking)
    content: list[dict[str, Any]] = []
    partial: dict[int, str] = {}
    end: ChoiceEnd | None = None
    try:
        async for step in gen.steps():
            for event in step.events:
                if isinstance(event, ChoiceEnd):
                    end = event
                else:
                    fold(blocks.feed(event), content, partial)
    except RequestTimeoutError:
        raise _timeout(gen) from None
    fold(blocks.close(), content, partial)
    stop_reason, stop_sequence = stop_fields(end, shape)
    u = gen.usage
    return {"id": shape.id, "type": "message", "role": "assistant", "model": shape.model,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": usage(u.prompt_tokens, u.cached_tokens, u.completion_tokens)}


def _sse(payload: dict[str, Any]) -> bytes:
    return b"event: " + payload["type"].encode() + b"\ndata: " + _JSON.encode(payload) \
        + b"\n\n"


async def sse_events(gen: Generation, first: RequestOutput,
                     shape: MessageShape) -> AsyncIterator[bytes]:
    """The Message as Anthropic's SSE stream: message_start, the content blocks'
    start/delta/stop events, message_delta (stop reason, output tokens), message_stop.
    An error once streaming is an `error` event, and the stream ends."""
    prompt = len(first.prompt_token_ids)
    yield _sse({"type": "message_start", "message": {
        "id": shape.id, "type": "message", "role": "assistant", "model": shape.model,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": usage(prompt, first.num_cached_tokens or 0, 0)}})
    blocks = Blocks(shape.omit_thinking)
    end: ChoiceEnd | None = None
    try:
        async for step in gen.steps(first):
            for event in step.events:
                if isinstance(event, ChoiceEnd):
                    end = event
                    continue
                for payload in blocks.feed(event):
                    yield _sse(payload)
        for payload in blocks.close():
            yield _sse(payload)
        stop_reason, stop_sequence = stop_fields(end, shape)
        yield _sse({"type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": {"output_tokens": gen.usage.completion_tokens}})
        yield _sse({"type": "message_stop"})
    except Exception as exc:  # noqa: BLE001 - reported in-band: the status is already sent
        err = _timeout(gen) if isinstance(exc, RequestTimeoutError) else map_error(exc)
        yield _sse(anthropic_error_body(err))
    finally:
        await gen.aclose()
