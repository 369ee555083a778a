"""Tool calling (chat completions, Responses, Messages): what a request's tools change in its prompt,
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
from dataclasses import dataclass
from typing import Any

from deployments.apis.common.tool_calls import (
    NamedToolParser,
    RequiredToolParser,
    ToolCallParser,
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


NO_TOOLS = ToolPlan([], None, None)


def plan_tools(tools: list[dict[str, Any]] | None, choice: str, parallel: bool | None,
               tool_call_parser: str) -> ToolPlan:
    """tools: OpenAI function tools ({"type": "function", "function": {...}}); choice:
    "none", "auto", "required", or the name of the function that must be called (each
    API maps its own tool_choice shape to these)."""
    if choice == "none" or not tools:
        return NO_TOOLS
    if choice == "required":
        schema = required_tools_schema(tools, parallel=parallel is not False)
        return ToolPlan(tools, RequiredToolParser(), StructuredOutputsParams(json=schema))
    if choice != "auto":
        tool = next(t for t in tools if t["function"]["name"] == choice)
        return ToolPlan(tools, NamedToolParser(choice),
                        StructuredOutputsParams(json=named_tool_schema(tool)))
    return ToolPlan(tools, get_tool_parser(tool_call_parser), None,
                    1 if parallel is False else None)


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
