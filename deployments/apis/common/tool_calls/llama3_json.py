"""The "llama3_json" format: the whole reply is one or more `{"name", "parameters"}`
objects joined by `;`, optionally after <|python_tag|> (Llama 3.1+ JSON tool calling)."""
from __future__ import annotations

from deployments.apis.common.tool_calls.base import (
    ContentDelta,
    Delta,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    ToolCallStreamer,
    append_delta,
)
from deployments.apis.common.tool_calls.text_scan import Stripper, call_from_json, value_end

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
        end = value_end(text, i)
        call = None if end is None else call_from_json(text[i:end])
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
        self._content = Stripper()
        self._buf = ""
        # None until the first characters decide: "content" (streamed as it comes) or
        # "calls" (held: calls or content, decided at the end)
        self._mode: str | None = None

    def feed(self, delta: str) -> list[Delta]:
        out: list[Delta] = []
        if self._mode == "content":
            append_delta(out, ContentDelta(self._content.text(delta)))
            return out
        self._buf += delta
        if self._mode is None:
            self._mode = self._decide(self._buf)
            if self._mode == "content":
                append_delta(out, ContentDelta(self._content.text(self._buf)))
                self._buf = ""
        return out

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        body = self._body(self._buf)
        calls = _llama3_calls(body) if body.startswith("{") else None
        if calls is None:
            append_delta(out, ContentDelta(self._content.text(self._buf)))
        else:
            for i, call in enumerate(calls):
                append_delta(out, ToolCallDelta(i, call.name, call.arguments))
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
