"""Replies forced by the tool schemas of deployments.apis.common.tool_prompt (tool_choice naming a
function, or "required"): tool calls by construction, each sent once it is whole."""
from __future__ import annotations

import json

from deployments.apis.common.tool_calls.base import Delta, ToolCallDelta, ToolCallParser, ToolCallStreamer
from deployments.apis.common.tool_calls.text_scan import JSON_WS, ValueScanner, json_object


class NamedToolParser(ToolCallParser):
    """The reply is the arguments object of one function (tool_choice named it).

    The schema forced it, so the object is the call's arguments, sent whole the moment
    its closing brace is generated. A reply cut short by max_tokens before that is no
    call at all (finish_reason "length" says why): a client never receives arguments
    that are not JSON, which it could neither parse nor retract once streamed.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def streamer(self) -> ToolCallStreamer:
        return _NamedStreamer(self.name)


class _NamedStreamer(ToolCallStreamer):
    def __init__(self, name: str) -> None:
        self._name = name
        self._text = ""  # the arguments so far, from their first non-space character
        self._scanner = ValueScanner()
        self._done = False

    def feed(self, delta: str) -> list[Delta]:
        if self._done:
            return []
        if not self._text:
            delta = delta.lstrip(JSON_WS)
        start = len(self._text)
        self._text += delta
        end = self._scanner.scan(self._text, start) if delta else None
        if end is None:
            return []
        self._done = True
        arguments = self._text[:end]
        return [ToolCallDelta(0, self._name, arguments)] if json_object(arguments) else []

    def finish(self) -> list[Delta]:
        self._done = True
        return []


class RequiredToolParser(ToolCallParser):
    """The reply is `[{"name": ..., "arguments": {...}}, ...]` (tool_choice "required").

    The schema forced it, so its shape is trusted: an element is a call once it has a
    complete string "name" and either a complete arguments object or its closing brace
    ("{}" then). Each call is sent whole at that moment. Anything after a departure
    from the array's shape is ignored, and a reply cut short keeps the calls completed
    before the cut: the cut one is dropped, so every call's arguments are JSON.
    """

    def streamer(self) -> ToolCallStreamer:
        return _RequiredStreamer()


class _RequiredStreamer(ToolCallStreamer):
    # States: "array" (before "["), "element" (between elements), "member" (in an
    # element, before a key or "}"), "key", "colon", "value_start", "value", "done".

    def __init__(self) -> None:
        self._state = "array"
        self._scanner = ValueScanner()
        self._raw = ""  # the key or value being read
        self._key = ""
        self._calls = 0
        self._start_element()

    def _start_element(self) -> None:
        self._name: str | None = None
        self._arguments: str | None = None  # complete arguments object text
        self._sent = False

    def feed(self, delta: str) -> list[Delta]:
        out: list[Delta] = []
        i = 0
        while i < len(delta):
            c = delta[i]
            state = self._state
            if state in ("array", "element", "member", "colon", "value_start"):
                if c in JSON_WS or (c == "," and state in ("element", "member")):
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
                    self._send(out, "{}")
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
                self._raw += delta[i:end]
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
        self._state = "done"  # an element still open was cut short: no call
        return []

    def _begin_value(self, state: str) -> None:
        self._state = state
        self._scanner = ValueScanner()
        self._raw = ""

    def _value_done(self, out: list[Delta]) -> None:
        if self._state == "key":
            try:
                self._key = json.loads(self._raw)
            except ValueError:
                self._key = ""
            self._state = "colon"
            return
        self._state = "member"
        if self._key == "name" and self._name is None:
            try:
                name = json.loads(self._raw)
            except ValueError:
                name = None
            if isinstance(name, str):
                self._name = name
        elif self._key == "arguments" and self._arguments is None:
            if not json_object(self._raw):
                self._state = "done"
                return
            self._arguments = self._raw
        if self._arguments is not None:
            self._send(out, self._arguments)

    def _send(self, out: list[Delta], arguments: str) -> None:
        """The element's call, once, when its name is known."""
        if self._name is None or self._sent:
            return
        self._sent = True
        out.append(ToolCallDelta(self._calls, self._name, arguments))
        self._calls += 1
