"""Scanning generated text for JSON values and tags a piece at a time: where a value
ends, which members an object has, whitespace around calls. Shared by every format."""
from __future__ import annotations

import json

from deployments.apis.common.tool_calls.base import ToolCall

JSON_WS = " \t\n\r"
SCALAR_END = JSON_WS + ",:]}"


class Stripper:
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


class ValueScanner:
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
                if c in SCALAR_END:
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


def value_end(text: str, i: int) -> int | None:
    return ValueScanner().scan(text, i)


def skip_json_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in JSON_WS:
        i += 1
    return i


def member_spans(obj_text: str) -> dict[str, tuple[int, int]]:
    """Where each top-level member's value lies in a valid JSON object's text.

    Later duplicates win, as in json.loads.
    """
    spans: dict[str, tuple[int, int]] = {}
    i = skip_json_ws(obj_text, 0) + 1  # past "{"
    while True:
        i = skip_json_ws(obj_text, i)
        if obj_text[i] == "}":
            return spans
        if obj_text[i] == ",":
            i += 1
            continue
        key_end = value_end(obj_text, i)
        key = json.loads(obj_text[i:key_end])
        start = skip_json_ws(obj_text, skip_json_ws(obj_text, key_end) + 1)  # past ":"
        end = value_end(obj_text, start)
        spans[key] = (start, end)
        i = end


def call_from_json(text: str) -> ToolCall | None:
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
    start, end = member_spans(text)[key]
    return ToolCall(obj["name"], text[start:end])


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of text that could be the start of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def json_object(text: str) -> bool:
    """Whether text is one whole JSON object (a call's arguments must be)."""
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
