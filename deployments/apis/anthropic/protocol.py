"""Anthropic Messages request bodies (pydantic) and their translation to the neutral
ChatInput and SamplingParams.

Why strict: a field this server would silently drop (an image, a server tool, an MCP
server) changes what the model is asked, so every model forbids undeclared fields (a
400 naming the field) and content blocks or tools of a kind the server cannot honour
are refused by name, never skipped. What is accepted and ignored is listed in
docs/api.md ("Anthropic Messages") with the reason: `cache_control` (prefix caching is
automatic), `metadata.user_id`, thinking blocks sent back in assistant turns (chat
templates drop earlier reasoning anyway).
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deployments.apis.common.chat_prep import ChatInput
from deployments.apis.common.sampling import build_sampling_params, documented_range
from deployments.apis.errors import ParamError
from engine.sampling_params import SamplingParams

# block types a turn may hold; everything else (image, document, search_result, server
# tool blocks, ...) is refused by name
_USER_BLOCKS = ("text", "tool_result")
_ASSISTANT_BLOCKS = ("text", "tool_use", "thinking", "redacted_thinking")
_KNOWN_BLOCKS = frozenset(_USER_BLOCKS + _ASSISTANT_BLOCKS)
TEXT_JOIN = "\n\n"  # between the text blocks of one turn, or of the system prompt
ERROR_PREFIX = "Error: "  # a tool_result with is_error: true, as the model reads it
MIN_THINKING_BUDGET = 1024  # Anthropic's floor for thinking.budget_tokens


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _text_blocks(value: Any) -> Any:
    """A string where Anthropic allows one in place of text blocks, as one text block."""
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


def _refuse_unknown_blocks(value: Any, allowed: frozenset[str] | tuple[str, ...]) -> Any:
    if isinstance(value, list):
        for i, block in enumerate(value):
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in allowed:
                raise ValueError(f"block {i}: {kind!r} content blocks are not supported by "
                                 f"this server (it takes {', '.join(sorted(allowed))})")
    return value


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # prefix caching is automatic
    citations: list[Any] | None = None  # a returned answer's citations: not model input


class DirectCaller(_Strict):
    type: Literal["direct"]


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    # what the SDK sends back with a block it received: the model called the tool itself
    # (programmatic tool calling, the other caller, is refused), no toolset
    caller: DirectCaller | None = None
    toolset_name: None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: list[TextBlock] = []
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> Any:
        value = [] if value is None else _text_blocks(value)
        return _refuse_unknown_blocks(value, ("text",))

    def text(self) -> str:
        text = TEXT_JOIN.join(b.text for b in self.content)
        return ERROR_PREFIX + text if self.is_error else text


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock,
                        RedactedThinkingBlock], Field(discriminator="type")]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> Any:
        return _refuse_unknown_blocks(_text_blocks(value), _KNOWN_BLOCKS)


class CustomTool(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None

    def as_function(self) -> dict[str, Any]:
        """The OpenAI function tool the chat templates and tool parsers take."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class _Choice(_Strict):
    disable_parallel_tool_use: bool | None = None


class AutoChoice(_Choice):
    type: Literal["auto"]


class AnyChoice(_Choice):
    type: Literal["any"]


class ToolChoice(_Choice):
    type: Literal["tool"]
    name: str


class NoneChoice(_Strict):
    type: Literal["none"]


class ThinkingEnabled(_Strict):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=MIN_THINKING_BUDGET, lt=1 << 63)
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(_Strict):
    type: Literal["disabled"]


class ThinkingAdaptive(_Strict):
    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


class Metadata(_Strict):
    user_id: str | None = None  # informational: no per-user tracking here


# Anthropic fields this server cannot honour: declared so that setting one is a 400
# saying so, not "unknown field"
_UNSUPPORTED = ("container", "mcp_servers")


class CountTokensRequest(_Strict):
    """POST /v1/messages/count_tokens: what the prompt of such a request would be."""

    model: str | None = None  # the served model (default) or a LoRA adapter's name
    messages: list[Message] = Field(min_length=1)
    system: list[TextBlock] | None = None
    tools: list[CustomTool] | None = None
    tool_choice: Annotated[Union[AutoChoice, AnyChoice, ToolChoice, NoneChoice],
                           Field(discriminator="type")] | None = None
    thinking: Annotated[Union[ThinkingEnabled, ThinkingDisabled, ThinkingAdaptive],
                        Field(discriminator="type")] | None = None
    container: Any = None
    mcp_servers: Any = None

    @field_validator("system", mode="before")
    @classmethod
    def _system(cls, value: Any) -> Any:
        return _refuse_unknown_blocks(_text_blocks(value), ("text",))

    @field_validator("tools", mode="before")
    @classmethod
    def _server_tools(cls, value: Any) -> Any:
        for i, tool in enumerate(value if isinstance(value, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind not in (None, "custom"):
                raise ValueError(f"tool {i}: server tool {kind!r} is not supported by this "
                                 "server (only custom tools: name, description, input_schema)")
        return value

    @model_validator(mode="after")
    def _choice_needs_tools(self) -> "CountTokensRequest":
        names = {t.name for t in self.tools or ()}
        choice = self.tool_choice
        if isinstance(choice, (AnyChoice, ToolChoice)) and not names:
            raise ValueError(f"tool_choice {choice.type!r} needs tools")
        if isinstance(choice, ToolChoice) and choice.name not in names:
            raise ValueError(f"tool_choice names {choice.name!r}, which is not in tools")
        return self

    def unsupported_param(self) -> ParamError | None:
        for name in _UNSUPPORTED:
            if getattr(self, name) is not None:
                return ParamError(name, f"{name} is not supported by this server")
        return None

    @property
    def omit_thinking(self) -> bool:
        """thinking.display "omitted": thinking blocks carry no text (only a signature)."""
        return getattr(self.thinking, "display", None) == "omitted"

    def chat_input(self) -> ChatInput:
        """The request as the neutral chat input (see docs/api.md for the mapping)."""
        conversation = self.conversation()
        last = conversation[-1]
        # a final assistant turn is a prefill: the answer continues it
        prefill = last["role"] == "assistant" and bool(last["content"]) \
            and "tool_calls" not in last
        kwargs: dict[str, Any] = {}
        if isinstance(self.thinking, ThinkingEnabled):
            kwargs["enable_thinking"] = True
        elif isinstance(self.thinking, ThinkingDisabled):
            kwargs["enable_thinking"] = False
        if prefill:
            kwargs["continue_final_message"] = True
        choice = self.tool_choice
        tools = [t.as_function() for t in self.tools or ()]
        if choice is None:
            name = "auto" if tools else "none"
        else:
            name = {"auto": "auto", "any": "required", "none": "none"}.get(
                choice.type, getattr(choice, "name", ""))
        parallel = (False if getattr(choice, "disable_parallel_tool_use", None) else None)
        return ChatInput(conversation=conversation, tools=tools, tool_choice=name,
                         parallel_tool_calls=parallel if tools else None,
                         template_kwargs=kwargs, add_generation_prompt=not prefill)

    def conversation(self) -> list[dict[str, Any]]:
        """OpenAI-style messages: a user turn's tool_result blocks become tool messages
        (before the turn's text), an assistant turn's tool_use blocks its tool_calls;
        thinking blocks are dropped."""
        out: list[dict[str, Any]] = []
        if self.system:
            out.append({"role": "system",
                        "content": TEXT_JOIN.join(b.text for b in self.system)})
        for i, message in enumerate(self.messages):
            allowed = _USER_BLOCKS if message.role == "user" else _ASSISTANT_BLOCKS
            texts: list[str] = []
            calls: list[dict[str, Any]] = []
            for j, block in enumerate(message.content):
                if block.type not in allowed:
                    raise ParamError(f"messages.{i}.content.{j}", f"a {message.role} turn "
                                     f"cannot hold {block.type} blocks")
                if isinstance(block, TextBlock):
                    texts.append(block.text)
                elif isinstance(block, ToolResultBlock):
                    out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                "content": block.text()})
                elif isinstance(block, ToolUseBlock):
                    calls.append({"id": block.id, "type": "function", "function": {
                        "name": block.name,
                        "arguments": json.dumps(block.input, ensure_ascii=False)}})
            if message.role == "user" and not texts and message.content:
                continue  # only tool results: no user message of its own
            turn: dict[str, Any] = {"role": message.role, "content": TEXT_JOIN.join(texts)}
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
        return out


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1, lt=1 << 63)
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    # documented_range: SamplingParams checks that range (deployments/apis/common/sampling.py);
    # temperature's maximum 1 and top_k's minimum 0 (no -1) are Anthropic's own
    temperature: float | None = documented_range(None, minimum=0.0, le=1.0)
    top_p: float | None = documented_range(None, exclusive_minimum=0.0, maximum=1.0)
    top_k: int | None = Field(None, ge=0, lt=1 << 63)  # 0: off
    stream: bool = False
    metadata: Metadata | None = None
    # one tier here: "standard_only" is what every request gets anyway
    service_tier: Literal["auto", "standard_only"] | None = None
    cache_control: dict[str, Any] | None = None  # prefix caching is automatic

    @model_validator(mode="after")
    def _budget(self) -> "MessagesRequest":
        if isinstance(self.thinking, ThinkingEnabled) \
                and self.thinking.budget_tokens >= self.max_tokens:
            raise ValueError("thinking.budget_tokens must be less than max_tokens")
        return self

    def sampling_params(self, structured: Any,
                        defaults: dict[str, int | float] | None) -> SamplingParams:
        """defaults: the model's sampling defaults, for the fields the request leaves
        unset (as on the OpenAI endpoints)."""
        given = {name: getattr(self, name) for name in ("temperature", "top_p", "top_k")}
        return build_sampling_params(defaults, given, max_tokens=self.max_tokens,
                                     stop=list(self.stop_sequences or ()),
                                     structured_outputs=structured)
