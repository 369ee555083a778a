"""Tools on the prompt side: schemas that force tool calls, and a tool prompt for
chat templates that have no tools section.

tool_choice naming a function or "required" is enforced with structured output: the
reply must match `named_tool_schema` (then deployments.apis.common.tool_calls.NamedToolParser reads
it) or `required_tools_schema` (RequiredToolParser). Models whose chat template knows no
tools get `conversation_with_tools`: our Hermes-style prompt and history, which the
"hermes" parser reads back. Tools are OpenAI tool dicts:
`{"type": "function", "function": {"name", "description"?, "parameters"?}}`.
"""
from __future__ import annotations

import copy
import json
import re
from typing import Any

# Arguments of a function that declares no parameters: still a JSON object, as OpenAI
# clients expect arguments to be.
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    # An empty schema would allow any JSON value; the arguments must be an object.
    return copy.deepcopy(tool["function"].get("parameters") or _ANY_OBJECT)


def named_tool_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """What the reply must be when tool_choice names this function: its arguments."""
    return _parameters(tool)


def required_tools_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """What the reply must be for tool_choice "required": a non-empty array of calls.

    "name" comes before "arguments" in each call's properties so that generation writes
    the name first, letting the arguments stream as they are generated.
    """
    if not tools:
        raise ValueError('tool_choice "required" needs at least one tool')
    calls = [{"type": "object",
              "properties": {"name": {"const": tool["function"]["name"]},
                             "arguments": _parameters(tool)},
              "required": ["name", "arguments"],
              "additionalProperties": False}
             for tool in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


# Jinja statements and expressions ({% %}, {{ }}); comments ({# #}) are not looked at.
_JINJA_CODE = re.compile(r"\{([%{])(.*?)[%}]\}", re.DOTALL)
_STRING_LITERAL = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", re.DOTALL)
_TOOLS_NAME = re.compile(r"(?<![\w.])tools\b")


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether a Jinja chat template reads a `tools` variable, so it renders tools itself.

    A textual check: a name `tools` in template code, outside string literals and
    comments, and not an attribute (`message.tools`). It cannot tell whether the
    template renders the tools well, and it misses a template that only reaches them
    some other way (e.g. a `custom_tools` variable alone): such templates get our prompt.
    """
    if not chat_template:
        return False
    return any(_TOOLS_NAME.search(_STRING_LITERAL.sub("", m.group(2)))
               for m in _JINJA_CODE.finditer(chat_template))


def render_tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """Our default tool prompt, in the Hermes format the "hermes" parser reads.

    Kept short and literal, for small models: the signatures, then the exact reply shape.
    """
    signatures = "\n".join(json.dumps(tool["function"], ensure_ascii=False) for tool in tools)
    return ("# Tools\n\n"
            "You can call the functions below to help with the user's request. "
            "Their signatures, as JSON, are inside <tools></tools>:\n"
            f"<tools>\n{signatures}\n</tools>\n\n"
            "To call a function, reply with this block, one per call:\n"
            "<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n'
            "</tool_call>")


def conversation_with_tools(messages: list[dict[str, Any]],
                            tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """A conversation with tools, tool calls and tool results as plain text messages.

    For templates without a tools section, which read only "role" and "content": every
    returned message is just those two, content a string. The tool prompt opens the
    leading system message (or becomes one); an assistant's tool_calls follow its text
    as <tool_call> blocks, as the model would have written them; tool results are
    wrapped in <tool_response>. The input messages are not modified.
    """
    out = [_plain(message) for message in messages]
    if tools:
        prompt = render_tools_system_prompt(tools)
        if out and out[0]["role"] == "system":
            text = out[0]["content"]
            out[0] = {"role": "system", "content": f"{prompt}\n\n{text}" if text else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    role = message["role"]
    text = _text(message.get("content"))
    if role == "tool":
        return {"role": role, "content": f"<tool_response>\n{text}\n</tool_response>"}
    if role == "assistant" and message.get("tool_calls"):
        blocks = [_tool_call_block(call["function"]) for call in message["tool_calls"]]
        text = "\n".join([text, *blocks] if text else blocks)
    return {"role": role, "content": text}


def _text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if any(part.get("type") != "text" for part in content):
        raise ValueError("only text content parts are supported")
    return "".join(part.get("text", "") for part in content)


def _tool_call_block(function: dict[str, Any]) -> str:
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):  # OpenAI sends the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # not JSON: shown as the string the client sent
    call = json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{call}\n</tool_call>"
