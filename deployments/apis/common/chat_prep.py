"""From a conversation to an engine prompt, for every chat-shaped API.

Chat completions, Responses and Anthropic Messages each translate their request into
the same neutral ChatInput (OpenAI-style messages and function tools, a tool choice,
template switches); prepare_chat() then plans the tools, renders the chat template,
tokenizes, and decides how the output is read (OutputPlan: tool parser, reasoning
parser) and constrained: a structured-outputs constraint (a response format, or the one
tool_choice forces) starts after the reasoning's end tag when the prompt leaves the
model thinking, so the grammar shapes the answer, not the thoughts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from deployments.apis.common.reasoning import get_reasoning_parser
from deployments.apis.common.tools import NO_TOOLS, ToolPlan, plan_tools, render_chat_prompt
from deployments.apis.errors import ParamError
from deployments.apis.events import OutputPlan
from deployments.apis.options import IngressOptions
from engine.structured.params import StructuredOutputsParams


@dataclass(frozen=True)
class ChatInput:
    conversation: list[dict[str, Any]]  # OpenAI-style messages (role, content, tool_calls)
    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI function tools
    tool_choice: str = "none"  # "none", "auto", "required", or a function's name
    parallel_tool_calls: bool | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    structured: StructuredOutputsParams | None = None  # a response format's constraint
    structured_param: str = "response_format"  # the field that asked for it (errors)


@dataclass(frozen=True)
class PreparedChat:
    prompt: dict[str, Any]  # {"prompt": text, "prompt_token_ids": ids} for the engine
    plan: OutputPlan
    structured: StructuredOutputsParams | None  # what the engine enforces
    tools: ToolPlan


def prepare_chat(processor: Any, chat: ChatInput, options: IngressOptions) -> PreparedChat:
    """The prompt, how the output is read and what constrains it (runs off the event
    loop for large requests: templating and tokenizing are CPU work)."""
    tools = plan_tools(chat.tools, chat.tool_choice, chat.parallel_tool_calls,
                       options.tool_call_parser) if chat.tools else NO_TOOLS
    structured = chat.structured
    # with tool_choice auto a constraint shapes the whole answer, calls included: the
    # parser reads whatever calls the constraint lets the model write (docs/api.md)
    if tools.forced is not None:
        if structured is not None:
            raise ParamError(chat.structured_param, f"{chat.structured_param} cannot be "
                             "combined with tool_choice (it constrains the output itself)")
        structured = tools.forced
    text = render_chat_prompt(processor, chat.conversation, tools, options.chat_template,
                              chat.add_generation_prompt, chat.template_kwargs)
    ids = processor.tokenizer.encode(text, add_special_tokens=False)
    reasoning = (get_reasoning_parser(options.reasoning_parser)
                 if options.reasoning_parser else None)
    if reasoning is not None and structured is not None and reasoning.expects_reasoning(text):
        end = processor.tokenizer.encode(reasoning.end_tag, add_special_tokens=False)
        structured = msgspec.structs.replace(structured, reasoning_end=end)
    plan = OutputPlan(tools if tools.parser is not None else None, reasoning, text)
    return PreparedChat({"prompt": text, "prompt_token_ids": ids}, plan, structured, tools)
