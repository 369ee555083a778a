"""The OpenAI Responses API's request body (POST /v1/responses) and its translation to
the neutral chat input.

`input` is a string or a list of items: messages (EasyInputMessage or typed message
items, text parts only), earlier outputs (assistant messages, function_call items,
reasoning items, which the prompt leaves out as chat templates do), and
function_call_output items (tool results). A previous response's conversation, when
`previous_response_id` names one, comes first; `instructions` are the system message
of this turn only (as OpenAI does: they are not carried over).

Every field of the API is declared: what Flotilla does not implement (built-in tools,
background mode, conversations, prompt templates, ...) is refused with a 400 naming it
(`unsupported_param`), never accepted and ignored.
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deployments.apis.common.sampling import build_sampling_params, documented_range
from deployments.apis.errors import ParamError, first_unsupported
from deployments.apis.openai.protocol import Int64, check_template_kwargs
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.structured.params import StructuredOutputsParams

BUILT_IN_TOOLS = ("web_search", "web_search_preview", "file_search", "computer_use_preview",
                  "computer", "code_interpreter", "image_generation", "mcp", "local_shell",
                  "shell", "apply_patch", "custom", "tool_search")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class _Open(BaseModel):
    """Items whose extra fields (ids, statuses, annotations) are echoes of our own output:
    accepted as sent back, not used."""

    model_config = ConfigDict(extra="allow")


class TextFormat(_Strict):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced exactly

    @model_validator(mode="after")
    def _check(self) -> "TextFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("schema is required with type json_schema, and only then")
        if self.type == "json_schema" and not self.name:
            raise ValueError("name is required with type json_schema")
        return self


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # only the default: there is no other


class FunctionTool(_Open):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class ReasoningConfig(_Strict):
    effort: None = None  # no effort levels: the model thinks as its template says
    summary: None = None
    generate_summary: None = None


# Fields of the API Flotilla does not implement: anything but the value(s) here is a 400.
_UNSUPPORTED: dict[str, Any] = {
    "background": (None, False), "conversation": None, "prompt": None, "include": (None, []),
    "max_tool_calls": None, "service_tier": (None, "auto", "default"),
    "truncation": (None, "disabled"), "top_logprobs": (None, 0), "stream_options": None,
    "context_management": None, "moderation": None, "prompt_cache_retention": None,
    "access_programs": None, "background_options": None, "image": None,
    "prompt_cache_options": None}


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, lt=1 << 63)
    # documented_range: SamplingParams checks that range (deployments/apis/common/sampling.py)
    temperature: float | None = documented_range(None, minimum=0.0, le=2.0)
    top_p: float | None = documented_range(None, exclusive_minimum=0.0, maximum=1.0)
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = True  # null: the default (stored)
    previous_response_id: str | None = None
    stream: bool | None = False
    metadata: dict[str, str] | None = None
    user: str | None = None  # accepted and not used, as on the other endpoints
    safety_identifier: str | None = None  # the same
    # requests sharing it go to the same engine (a session id: at most 256 characters)
    prompt_cache_key: str | None = Field(None, max_length=256)
    reasoning: ReasoningConfig | None = None
    # vLLM / Flotilla extensions
    seed: Int64 | None = None
    top_k: Int64 | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}
    priority: int = Field(0, ge=-(1 << 31), lt=1 << 31)
    timeout: float | None = Field(None, gt=0)
    # declared only to be refused when set (see unsupported_param)
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    include: Any = None
    max_tool_calls: Any = None
    service_tier: Any = None
    truncation: Any = None
    top_logprobs: Any = None
    stream_options: Any = None
    context_management: Any = None
    moderation: Any = None
    prompt_cache_retention: Any = None
    access_programs: Any = None
    background_options: Any = None
    image: Any = None
    prompt_cache_options: Any = None

    UNSUPPORTED: ClassVar[dict[str, Any]] = _UNSUPPORTED

    @model_validator(mode="after")
    def _check(self) -> "ResponsesRequest":
        if isinstance(self.input, list) and not self.input:
            raise ValueError("input: give a string or at least one item")
        check_template_kwargs(self.chat_template_kwargs)
        if isinstance(self.tool_choice, NamedFunction):
            if self.tool_choice.name not in {t.name for t in self.tools or ()}:
                raise ValueError(f"tool_choice names {self.tool_choice.name!r}, which is "
                                 "not in tools")
        elif self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if self.metadata is not None and len(self.metadata) > 16:
            raise ValueError("metadata: at most 16 keys")
        return self

    def unsupported_param(self) -> ParamError | None:
        refused = first_unsupported(self, self.UNSUPPORTED)
        if refused is not None:
            return refused
        for i, tool in enumerate(self.tools or ()):
            if tool.type != "function":
                what = ("built-in" if tool.type in BUILT_IN_TOOLS else "unknown")
                return ParamError(f"tools.{i}.type", f"{what} tool type {tool.type!r} is not "
                                  "supported (function tools are)")
            if not tool.name:
                return ParamError(f"tools.{i}.name", "a function tool needs a name")
            extra = sorted(set(tool.model_extra or ()) - {"defer_loading"})
            if extra or (tool.model_extra or {}).get("defer_loading"):
                return ParamError(f"tools.{i}", f"unsupported function tool field(s): "
                                  f"{', '.join(extra) or 'defer_loading'}")
        return None

    # ---- translation ----------------------------------------------------------------------
    def function_tools(self) -> list[dict[str, Any]]:
        """The tools as OpenAI chat function tools (what templates and parsers take)."""
        out = []
        for t in self.tools or ():
            function = {"name": t.name, "parameters": t.parameters or {"type": "object",
                                                                      "properties": {}}}
            if t.description is not None:
                function["description"] = t.description
            out.append({"type": "function", "function": function})
        return out

    def effective_tool_choice(self) -> str:
        if isinstance(self.tool_choice, NamedFunction):
            return self.tool_choice.name
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def structured(self) -> StructuredOutputsParams | None:
        fmt = self.text.format if self.text is not None else None
        try:
            if fmt is None or fmt.type == "text":
                return None
            if fmt.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            return StructuredOutputsParams(json=fmt.json_schema)
        except InvalidRequestError as exc:
            raise ParamError("text.format", str(exc)) from None

    def sampling_params(self, defaults: dict[str, int | float] | None,
                        structured: StructuredOutputsParams | None) -> SamplingParams:
        given = {name: getattr(self, name) for name in ("temperature", "top_p", "top_k")}
        return build_sampling_params(defaults, given, seed=self.seed,
                                     max_tokens=self.max_output_tokens,
                                     structured_outputs=structured)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as OpenAI chat messages: the prompt's part of this turn."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input.{i}"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ParamError(f"{where}.role", f"unknown role {role!r}")
            # OpenAI's developer role is the system role of chat templates
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", where), "type": "function", "function": {
                "name": _field(item, "name", where),
                "arguments": _field(item, "arguments", where)}}
            if out and out[-1]["role"] == "assistant":  # the turn that made the call
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, where)
            out.append({"role": "tool", "tool_call_id": _field(item, "call_id", where),
                        "content": text})
        elif kind == "reasoning":
            continue  # earlier thinking: templates leave it out of the prompt
        else:
            raise ParamError(f"{where}.type", f"input items of type {kind!r} are not "
                             "supported (messages, function_call, function_call_output and "
                             "reasoning items are)")
    return out


def _field(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise ParamError(f"{where}.{name}", f"{name} is required (a string)")
    return value


def _text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, or text parts (input_text, output_text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ParamError(f"{where}.content", "content must be a string or a list of parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal":
            texts.append(part.get("refusal", ""))
        else:
            raise ParamError(f"{where}.content.{j}", f"content parts of type {kind!r} are not "
                             "supported (text only)")
    return "".join(texts)
