"""Tool calls in generated text: whole-text parsing and streaming, for /v1/chat/completions.

A parser turns what the model generated into content plus OpenAI-style tool calls. Each
parser is a streamer at heart: `parse(text)` is the fold of one streamer fed the whole
text, so a streamed response and a non-streamed one can never disagree. Streaming
holds back exactly the text whose fate is still open (a possible tag, a call whose JSON
is not finished, whitespace that may turn out to border a call) and nothing more.

Formats (pick with `get_tool_parser`):

- "hermes": `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks among
  plain text (Qwen2.5, Qwen3, and our default tool prompt in deployments.tool_prompt).
- "llama3_json": the whole reply is `{"name": ..., "parameters": {...}}`, or several
  joined by `;`, optionally after `<|python_tag|>` (Llama 3.1+ JSON tool calling).
- `NamedToolParser` / `RequiredToolParser`: the reply was forced by the JSON schemas
  of deployments.tool_prompt (tool_choice naming a function, or "required"), so it is
  tool calls by construction and the arguments stream character by character.

A call's `arguments` is the exact text the model wrote for the arguments object (no
re-serialisation: key order, spacing and number spelling reach the client unchanged).

Why free-form calls ("hermes", "llama3_json") are not streamed piecemeal: a block only
counts as a call once its JSON is complete and valid (a truncated or broken one stays
text), and no prefix of a JSON text guarantees that. Any argument chunk sent earlier
could be contradicted later, so a call is sent as one delta, the moment it is decided.
"""
from __future__ import annotations

import abc
import json
from dataclasses import dataclass

_JSON_WS = " \t\n\r"
_SCALAR_END = _JSON_WS + ",:]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments' JSON text exactly as generated


@dataclass(frozen=True)
class ParsedMessage:
    content: str | None  # None when there are tool calls and no other text
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    index: int  # position of the call in this message, from 0
    name: str | None  # on the call's first delta only
    arguments: str  # the next chunk of the arguments text


Delta = ContentDelta | ToolCallDelta


class ToolCallStreamer(abc.ABC):
    """Incremental parser for one choice's generated text."""

    @abc.abstractmethod
    def feed(self, delta: str) -> list[Delta]:
        """New generated text, chunked any way; returns what is now decided."""

    @abc.abstractmethod
    def finish(self) -> list[Delta]:
        """End of generation: decide and return everything still held back."""


class ToolCallParser(abc.ABC):
    """A tool-call format; stateless, so one instance serves any number of requests."""

    @abc.abstractmethod
    def streamer(self) -> ToolCallStreamer:
        """A fresh incremental parser for one choice."""

    def parse(self, text: str) -> ParsedMessage:
        """The whole generated text, parsed exactly as a stream of it would be."""
        streamer = self.streamer()
        deltas = streamer.feed(text) + streamer.finish()
        content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
        names: list[str] = []
        arguments: list[str] = []
        for d in deltas:
            if isinstance(d, ToolCallDelta):
                if d.name is not None:
                    names.append(d.name)
                    arguments.append("")
                arguments[d.index] += d.arguments
        calls = [ToolCall(n, a) for n, a in zip(names, arguments)]
        return ParsedMessage(None if calls and not content.strip() else content, calls)


def _append(out: list[Delta], delta: Delta) -> None:
    """Add a delta, merged into the previous one where it continues it (fewer events)."""
    last = out[-1] if out else None
    if isinstance(delta, ContentDelta):
        if not delta.text:
            return
        if isinstance(last, ContentDelta):
            out[-1] = ContentDelta(last.text + delta.text)
            return
    elif (delta.name is None and isinstance(last, ToolCallDelta)
          and last.index == delta.index):
        if delta.arguments:
            out[-1] = ToolCallDelta(last.index, last.name, last.arguments + delta.arguments)
        return
    out.append(delta)


class _Stripper:
    """Streams text with its ends stripped and the whitespace around tool calls removed.

    Whitespace is held until the next other character shows it is inside the text;
    a call (`cut`) or the end drops it, as does whitespace at the start or after a cut.
    """

    def __init__(self) -> None:
        self._held = ""
        self._at_start = True

    def text(self, text: str) -> str:
        if self._at_start:
            text = text.lstrip()
            if not text:
                return ""
            self._at_start = False
        body = text.rstrip()
        if not body:
            self._held += text
            return ""
        out = self._held + body
        self._held = text[len(body):]
        return out

    def cut(self) -> None:
        self._held = ""
        self._at_start = True


class _ValueScanner:
    """Finds where one JSON value ends, a piece of text at a time.

    Bracket matching that understands strings and escapes, not a validator: callers
    either validate the span with json.loads or trust a schema-forced generation.
    The value must start at the first character scanned (no leading whitespace).
    """

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._scalar = False

    def scan(self, text: str, i: int = 0) -> int | None:
        """The index just past the value's end in text, or None if it goes on past it."""
        for j in range(i, len(text)):
            c = text[j]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
                    if self._depth == 0:
                        return j + 1
            elif self._scalar:
                if c in _SCALAR_END:
                    return j
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    return j + 1
            elif self._depth == 0:
                self._scalar = True
        return None


def _value_end(text: str, i: int) -> int | None:
    return _ValueScanner().scan(text, i)


def _skip_json_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _JSON_WS:
        i += 1
    return i


def _member_spans(obj_text: str) -> dict[str, tuple[int, int]]:
    """Where each top-level member's value lies in a valid JSON object's text.

    Later duplicates win, as in json.loads.
    """
    spans: dict[str, tuple[int, int]] = {}
    i = _skip_json_ws(obj_text, 0) + 1  # past "{"
    while True:
        i = _skip_json_ws(obj_text, i)
        if obj_text[i] == "}":
            return spans
        if obj_text[i] == ",":
            i += 1
            continue
        key_end = _value_end(obj_text, i)
        key = json.loads(obj_text[i:key_end])
        start = _skip_json_ws(obj_text, _skip_json_ws(obj_text, key_end) + 1)  # past ":"
        end = _value_end(obj_text, start)
        spans[key] = (start, end)
        i = end


def _call_from_json(text: str) -> ToolCall | None:
    """`{"name": str, "arguments"|"parameters": {...}}` as a call, or None if it is not one."""
    text = text.strip()
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = next((k for k in ("arguments", "parameters") if k in obj), None)
    if key is None:
        return ToolCall(obj["name"], "{}")
    if not isinstance(obj[key], dict):
        return None
    start, end = _member_spans(text)[key]
    return ToolCall(obj["name"], text[start:end])


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of text that could be the start of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# --- hermes ---------------------------------------------------------------------------

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolCallParser):
    """`<tool_call>` JSON `</tool_call>` blocks among text.

    A block ends at the first `</tool_call>` (even one inside a JSON string), or at the
    end of the text. It is a call when its JSON (whitespace around it allowed) is an
    object with a string "name" and an object "arguments" (or "parameters"; missing
    means {}); otherwise the block, tags included, is text like any other. Content is
    the text outside calls with the whitespace bordering each call removed and both
    ends stripped: "a <call> b" gives "ab", "a\\n<call>\\n" gives "a".
    """

    def streamer(self) -> ToolCallStreamer:
        return _HermesStreamer()


class _HermesStreamer(ToolCallStreamer):
    def __init__(self) -> None:
        self._content = _Stripper()
        self._buf = ""  # text not yet decided: outside text, or the open block's body
        self._in_block = False
        self._searched = 0  # in a block: how much of the body holds no "</tool_call>"
        self._calls = 0

    def feed(self, delta: str) -> list[Delta]:
        self._buf += delta
        out: list[Delta] = []
        while True:
            if self._in_block:
                end = self._buf.find(_CLOSE, self._searched)
                if end < 0:
                    self._searched = max(0, len(self._buf) - len(_CLOSE) + 1)
                    return out
                self._end_block(out, self._buf[:end], _CLOSE)
                self._buf = self._buf[end + len(_CLOSE):]
                self._in_block = False
            else:
                start = self._buf.find(_OPEN)
                if start < 0:
                    keep = len(self._buf) - _partial_suffix(self._buf, _OPEN)
                    _append(out, ContentDelta(self._content.text(self._buf[:keep])))
                    self._buf = self._buf[keep:]
                    return out
                _append(out, ContentDelta(self._content.text(self._buf[:start])))
                self._buf = self._buf[start + len(_OPEN):]
                self._in_block, self._searched = True, 0

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        if self._in_block:
            self._end_block(out, self._buf, "")
        else:
            _append(out, ContentDelta(self._content.text(self._buf)))
        self._buf, self._in_block = "", False
        return out

    def _end_block(self, out: list[Delta], body: str, close: str) -> None:
        call = _call_from_json(body)
        if call is None:
            _append(out, ContentDelta(self._content.text(_OPEN + body + close)))
            return
        self._content.cut()
        _append(out, ToolCallDelta(self._calls, call.name, call.arguments))
        self._calls += 1


# --- llama3_json ----------------------------------------------------------------------

_PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolCallParser):
    """The whole reply as `{"name": ..., "parameters": {...}}` objects joined by `;`.

    Leading whitespace and a `<|python_tag|>` may come first. A reply that then starts
    with anything but `{` is plain content, streamed. One that starts with `{` is held
    whole until finish(): it is calls only if it is entirely valid call objects (any
    later text, or a broken or truncated object, makes it content), so nothing earlier
    can be sent safely. Content is the reply stripped.
    """

    def streamer(self) -> ToolCallStreamer:
        return _Llama3Streamer()


def _llama3_calls(text: str) -> list[ToolCall] | None:
    """The calls in a `;`-joined sequence of call objects (text starts at "{"), or None."""
    calls = []
    i = 0
    while True:
        end = _value_end(text, i)
        call = None if end is None else _call_from_json(text[i:end])
        if call is None:
            return None
        calls.append(call)
        rest = text[end:].lstrip()
        if not rest:
            return calls
        if not rest.startswith(";") or not rest[1:].lstrip().startswith("{"):
            return None
        i = len(text) - len(rest[1:].lstrip())


class _Llama3Streamer(ToolCallStreamer):
    def __init__(self) -> None:
        self._content = _Stripper()
        self._buf = ""
        # None until the first characters decide: "content" (streamed as it comes) or
        # "calls" (held: calls or content, decided at the end)
        self._mode: str | None = None

    def feed(self, delta: str) -> list[Delta]:
        out: list[Delta] = []
        if self._mode == "content":
            _append(out, ContentDelta(self._content.text(delta)))
            return out
        self._buf += delta
        if self._mode is None:
            self._mode = self._decide(self._buf)
            if self._mode == "content":
                _append(out, ContentDelta(self._content.text(self._buf)))
                self._buf = ""
        return out

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        body = self._body(self._buf)
        calls = _llama3_calls(body) if body.startswith("{") else None
        if calls is None:
            _append(out, ContentDelta(self._content.text(self._buf)))
        else:
            for i, call in enumerate(calls):
                _append(out, ToolCallDelta(i, call.name, call.arguments))
        self._buf = ""
        return out

    @staticmethod
    def _body(text: str) -> str:
        text = text.lstrip()
        if text.startswith(_PYTHON_TAG):
            text = text[len(_PYTHON_TAG):].lstrip()
        return text

    @classmethod
    def _decide(cls, text: str) -> str | None:
        body = cls._body(text)
        if not body or (_PYTHON_TAG.startswith(body) and body == text.lstrip()):
            return None  # nothing yet, or possibly the start of the tag
        return "calls" if body.startswith("{") else "content"


# --- schema-forced output -------------------------------------------------------------


class NamedToolParser(ToolCallParser):
    """The reply is the arguments object of one function (tool_choice named it).

    The schema forced it, so it is a call whatever it holds (a reply cut short by
    max_tokens gives truncated arguments, which finish_reason "length" explains); its
    arguments are the text stripped, or "{}" when empty.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def streamer(self) -> ToolCallStreamer:
        return _NamedStreamer(self.name)


class _NamedStreamer(ToolCallStreamer):
    def __init__(self, name: str) -> None:
        self._name = name
        self._named = False
        self._empty = True
        self._args = _Stripper()

    def feed(self, delta: str) -> list[Delta]:
        chunk = self._args.text(delta)
        self._empty = self._empty and not chunk
        return self._delta(chunk)

    def finish(self) -> list[Delta]:
        return self._delta("{}" if self._empty else "")

    def _delta(self, chunk: str) -> list[Delta]:
        if not self._named:
            self._named = True
            return [ToolCallDelta(0, self._name, chunk)]
        return [ToolCallDelta(0, None, chunk)] if chunk else []


class RequiredToolParser(ToolCallParser):
    """The reply is `[{"name": ..., "arguments": {...}}, ...]` (tool_choice "required").

    The schema forced it, so the text is trusted rather than validated: each element
    with a complete string "name" is a call, its arguments streamed as generated (held
    back only if they come before the name), "{}" if it has none. Anything after a
    departure from the array's shape is ignored; a reply cut short keeps what it has.
    """

    def streamer(self) -> ToolCallStreamer:
        return _RequiredStreamer()


class _RequiredStreamer(ToolCallStreamer):
    # States: "array" (before "["), "element" (between elements), "member" (in an
    # element, before a key or "}"), "key", "colon", "value_start", "value", "done".

    def __init__(self) -> None:
        self._state = "array"
        self._scanner = _ValueScanner()
        self._raw = ""  # the key, or the "name" value, being read
        self._key = ""
        self._calls = 0
        self._start_element()

    def _start_element(self) -> None:
        self._name: str | None = None
        self._held_args = ""  # arguments seen before the name
        self._has_args = False

    def feed(self, delta: str) -> list[Delta]:
        out: list[Delta] = []
        i = 0
        while i < len(delta):
            c = delta[i]
            state = self._state
            if state in ("array", "element", "member", "colon", "value_start"):
                if c in _JSON_WS or (c == "," and state in ("element", "member")):
                    i += 1
                    continue
            if state == "array":
                self._state = "element" if c == "[" else "done"
            elif state == "element":
                if c == "{":
                    self._start_element()
                    self._state = "member"
                else:
                    self._state = "done"
            elif state == "member":
                if c == '"':
                    self._begin_value("key")
                    continue
                if c == "}":
                    self._end_element(out)
                    self._state = "element"
                else:
                    self._state = "done"
            elif state == "colon":
                self._state = "value_start" if c == ":" else "done"
            elif state == "value_start":
                self._begin_value("value")
                continue
            elif state in ("key", "value"):
                end = self._scanner.scan(delta, i)
                self._value_text(out, delta[i:end])
                if end is None:
                    return out
                self._value_done(out)
                i = end
                continue
            else:  # "done"
                return out
            i += 1
        return out

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        if self._state in ("member", "key", "colon", "value_start", "value"):
            self._end_element(out)
        self._state = "done"
        return out

    def _begin_value(self, state: str) -> None:
        self._state = state
        self._scanner = _ValueScanner()
        self._raw = ""

    def _value_text(self, out: list[Delta], text: str) -> None:
        if self._state == "key" or (self._key == "name" and self._name is None):
            self._raw += text
        elif self._key == "arguments" and text:
            self._has_args = True
            if self._name is None:
                self._held_args += text
            else:
                _append(out, ToolCallDelta(self._calls, None, text))

    def _value_done(self, out: list[Delta]) -> None:
        if self._state == "key":
            try:
                self._key = json.loads(self._raw)
            except ValueError:
                self._key = ""
            self._state = "colon"
            return
        if self._key == "name" and self._name is None:
            try:
                name = json.loads(self._raw)
            except ValueError:
                name = None
            if isinstance(name, str):
                self._name = name
                _append(out, ToolCallDelta(self._calls, name, self._held_args))
        self._state = "member"

    def _end_element(self, out: list[Delta]) -> None:
        if self._name is None:
            return
        if not self._has_args:
            _append(out, ToolCallDelta(self._calls, None, "{}"))
        self._calls += 1
        self._name = None


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
