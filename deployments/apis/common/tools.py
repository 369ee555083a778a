"""Tool calling on /v1/chat/completions: what a request's tools change in its prompt,
its output constraint, and its response.

plan_tools() decides, per request: the tools rendered into the prompt (none with
tool_choice "none"), the structured-outputs constraint that enforces tool_choice
"required" or a named function (the arguments then always parse and match the
function's parameters schema), and the parser that reads calls back out of the
generated text ("auto" uses the server's tool_call_parser, as vLLM's
--tool-call-parser). render_chat_prompt() uses the chat template's own tools section
when it has one, else Flotilla's default tool prompt (deployments.apis.common.tool_prompt).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from deployments.apis.openai.protocol import ChatCompletionRequest, NamedToolChoice
from deployments.apis.common.tool_calls import (
    ContentDelta,
    NamedToolParser,
    RequiredToolParser,
    ToolCallDelta,
    ToolCallParser,
    ToolCallStreamer,
    get_tool_parser,
)
from deployments.apis.common.tool_prompt import (
    conversation_with_tools,
    named_tool_schema,
    required_tools_schema,
    template_supports_tools,
)
from engine.structured.params import StructuredOutputsParams


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict[str, Any]]  # OpenAI tool dicts rendered into the prompt
    parser: ToolCallParser | None  # None: the reply is plain content
    forced: StructuredOutputsParams | None  # the constraint tool_choice imposes
    max_calls: int | None = None  # parallel_tool_calls=false with auto: later calls dropped


def plan_tools(body: ChatCompletionRequest, tool_call_parser: str) -> ToolPlan:
    choice = body.effective_tool_choice
    if choice == "none" or not body.tools:
        return ToolPlan([], None, None)
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    if choice == "required":
        schema = required_tools_schema(tools, parallel=body.parallel_tool_calls is not False)
        return ToolPlan(tools, RequiredToolParser(), StructuredOutputsParams(json=schema))
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        tool = next(t for t in tools if t["function"]["name"] == name)
        return ToolPlan(tools, NamedToolParser(name),
                        StructuredOutputsParams(json=named_tool_schema(tool)))
    return ToolPlan(tools, get_tool_parser(tool_call_parser), None,
                    1 if body.parallel_tool_calls is False else None)


def render_chat_prompt(processor: Any, conversation: list[dict[str, Any]], plan: ToolPlan,
                       chat_template: str | None, add_generation_prompt: bool,
                       template_kwargs: dict[str, Any]) -> str:
    """The prompt text: tools through the template's own tools section when it has one;
    otherwise the default tool prompt, with earlier tool calls and results rendered as
    text (so a template without tool support still sees the whole exchange)."""
    template = chat_template or getattr(processor.tokenizer, "chat_template", None)
    has_tool_messages = any(m.get("tool_calls") or m["role"] == "tool" for m in conversation)
    if template_supports_tools(template if isinstance(template, str) else None):
        conversation = [_arguments_as_objects(m) for m in conversation]
        kwargs = dict(template_kwargs)
        if plan.tools:
            kwargs["tools"] = plan.tools
        return processor.apply_chat_template(conversation, add_generation_prompt,
                                             chat_template, **kwargs)
    if plan.tools or has_tool_messages:
        conversation = conversation_with_tools(conversation, plan.tools or None)
    return processor.apply_chat_template(conversation, add_generation_prompt, chat_template,
                                         **template_kwargs)


def _arguments_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    """Earlier calls' arguments as objects: OpenAI sends them as JSON text, and templates
    with a tools section serialize them themselves (`| tojson`), which would quote the
    text a second time."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        function = dict(call["function"])
        try:
            function["arguments"] = json.loads(function["arguments"])
        except (TypeError, ValueError):
            pass  # not JSON: the template gets the text as it came
        calls.append({**call, "function": function})
    return {**message, "tool_calls": calls}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_message(text: str, plan: ToolPlan) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls in OpenAI's shape) of one finished choice."""
    parsed = plan.parser.parse(text)
    calls = [{"id": new_call_id(), "type": "function",
              "function": {"name": c.name, "arguments": c.arguments}}
             for c in parsed.tool_calls[:plan.max_calls]]
    return parsed.content, calls


class ToolDeltaStream:
    """One streamed choice: generated text in, chat `delta` dicts out."""

    def __init__(self, plan: ToolPlan) -> None:
        self._streamer: ToolCallStreamer = plan.parser.streamer()
        self._max_calls = plan.max_calls
        self._ids: dict[int, str] = {}

    @property
    def made_calls(self) -> bool:
        return bool(self._ids)

    def feed(self, text: str) -> dict[str, Any] | None:
        return self._delta(self._streamer.feed(text) if text else [])

    def finish(self) -> dict[str, Any] | None:
        return self._delta(self._streamer.finish())

    def _delta(self, pieces: list[ContentDelta | ToolCallDelta]) -> dict[str, Any] | None:
        content = "".join(p.text for p in pieces if isinstance(p, ContentDelta))
        calls: list[dict[str, Any]] = []
        for p in pieces:
            if not isinstance(p, ToolCallDelta):
                continue
            if self._max_calls is not None and p.index >= self._max_calls:
                continue
            if calls and calls[-1]["index"] == p.index and p.name is None:
                calls[-1]["function"]["arguments"] += p.arguments  # merge one call's chunks
                continue
            call: dict[str, Any] = {"index": p.index, "function": {"arguments": p.arguments}}
            if p.name is not None:
                self._ids[p.index] = call["id"] = new_call_id()
                call["type"] = "function"
                call["function"]["name"] = p.name
            calls.append(call)
        if not content and not calls:
            return None
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta
