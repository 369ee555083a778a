"""Tool calls in generated text: whole-text parsing and streaming, for /v1/chat/completions.

A parser turns what the model generated into content plus OpenAI-style tool calls. Each
parser is a streamer at heart: `parse(text)` is the fold of one streamer fed the whole
text, so a streamed response and a non-streamed one can never disagree. Streaming
holds back exactly the text whose fate is still open (a possible tag, a call whose JSON
is not finished, whitespace that may turn out to border a call) and nothing more.

Formats (pick with `get_tool_parser`):

- "hermes": `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks among
  plain text (Qwen2.5, Qwen3, and our default tool prompt in deployments.apis.common.tool_prompt).
- "llama3_json": the whole reply is `{"name": ..., "parameters": {...}}`, or several
  joined by `;`, optionally after `<|python_tag|>` (Llama 3.1+ JSON tool calling).
- `NamedToolParser` / `RequiredToolParser`: the reply was forced by the JSON schemas
  of deployments.apis.common.tool_prompt (tool_choice naming a function, or "required"), so it is
  tool calls by construction; each call is sent when its arguments object is complete,
  and one cut short by max_tokens is dropped.

A call's `arguments` is the exact text the model wrote for the arguments object (no
re-serialisation: key order, spacing and number spelling reach the client unchanged).

Why calls are not streamed piecemeal: a block only
counts as a call once its JSON is complete and valid (a truncated or broken one stays
text), and no prefix of a JSON text guarantees that. Any argument chunk sent earlier
could be contradicted later, so a call is sent as one delta, the moment it is decided.
Even a schema-forced call can be cut by max_tokens mid-arguments; an argument chunk
already streamed then leaves the client holding text that is not JSON.
"""
from deployments.apis.common.tool_calls.base import (
    ContentDelta,
    Delta,
    ParsedMessage,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    ToolCallStreamer,
)
from deployments.apis.common.tool_calls.forced import NamedToolParser, RequiredToolParser
from deployments.apis.common.tool_calls.hermes import HermesToolParser
from deployments.apis.common.tool_calls.llama3_json import Llama3JsonToolParser

__all__ = ["TOOL_PARSERS", "ContentDelta", "Delta", "HermesToolParser", "Llama3JsonToolParser",
           "NamedToolParser", "ParsedMessage", "RequiredToolParser", "ToolCall",
           "ToolCallDelta", "ToolCallParser", "ToolCallStreamer", "get_tool_parser"]

_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}
TOOL_PARSERS: tuple[str, ...] = tuple(_PARSERS)


def get_tool_parser(name: str) -> ToolCallParser:
    """The parser for a tool-call format, by the name users pick it with."""
    try:
        return _PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; known: "
                         f"{', '.join(TOOL_PARSERS)}") from None
