"""The "hermes" format: <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks
among plain text (Qwen2.5, Qwen3, and our default tool prompt)."""
from __future__ import annotations

from deployments.apis.common.tool_calls.base import (
    ContentDelta,
    Delta,
    ToolCallDelta,
    ToolCallParser,
    ToolCallStreamer,
    append_delta,
)
from deployments.apis.common.tool_calls.text_scan import Stripper, call_from_json, partial_suffix

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
        self._content = Stripper()
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
                    keep = len(self._buf) - partial_suffix(self._buf, _OPEN)
                    append_delta(out, ContentDelta(self._content.text(self._buf[:keep])))
                    self._buf = self._buf[keep:]
                    return out
                append_delta(out, ContentDelta(self._content.text(self._buf[:start])))
                self._buf = self._buf[start + len(_OPEN):]
                self._in_block, self._searched = True, 0

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        if self._in_block:
            self._end_block(out, self._buf, "")
        else:
            append_delta(out, ContentDelta(self._content.text(self._buf)))
        self._buf, self._in_block = "", False
        return out

    def _end_block(self, out: list[Delta], body: str, close: str) -> None:
        call = call_from_json(body)
        if call is None:
            append_delta(out, ContentDelta(self._content.text(_OPEN + body + close)))
            return
        self._content.cut()
        append_delta(out, ToolCallDelta(self._calls, call.name, call.arguments))
        self._calls += 1
