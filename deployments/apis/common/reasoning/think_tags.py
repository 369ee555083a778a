"""The streamer behind the `<think>` ... `</think>` formats: where the reasoning starts
and ends in text that arrives a piece at a time, holding back only what may be a tag."""
from __future__ import annotations

from deployments.apis.common.reasoning.base import (
    ReasoningDelta,
    ReasoningStreamer,
    SplitDelta,
)
from deployments.apis.common.tool_calls.base import ContentDelta
from deployments.apis.common.tool_calls.text_scan import partial_suffix

_OPENING, _REASONING, _AFTER_END, _CONTENT = range(4)


class TagStreamer(ReasoningStreamer):
    """Splits output into reasoning and content at `start_tag` and `end_tag`.

    may_open: a start tag at the very beginning (after whitespace) opens the reasoning;
    it and the whitespace before it are dropped. in_reasoning: where output that does
    not begin with one starts (inside the reasoning, or in the content; with neither
    flag, everything is content). The reasoning ends at the first `end_tag`, which is
    dropped with the whitespace after it; the rest is content, tags and all. Reasoning
    that never ends is all reasoning.
    """

    def __init__(self, start_tag: str, end_tag: str, *, may_open: bool,
                 in_reasoning: bool) -> None:
        self._start, self._end = start_tag, end_tag
        self._default = _REASONING if in_reasoning else _CONTENT
        self._mode = _OPENING if may_open else self._default
        self._buf = ""  # text not yet decided

    def feed(self, delta: str) -> list[SplitDelta]:
        self._buf += delta
        out: list[SplitDelta] = []
        while True:
            buf = self._buf
            if self._mode == _OPENING:
                rest = buf.lstrip()
                if rest.startswith(self._start):
                    self._buf, self._mode = rest[len(self._start):], _REASONING
                elif not rest or self._start.startswith(rest):
                    return out  # whitespace, or a start tag still arriving
                else:
                    self._mode = self._default  # buf goes on to that mode, unchanged
            elif self._mode == _REASONING:
                end = buf.find(self._end)
                if end < 0:
                    keep = len(buf) - partial_suffix(buf, self._end)
                    _append(out, ReasoningDelta(buf[:keep]))
                    self._buf = buf[keep:]
                    return out
                _append(out, ReasoningDelta(buf[:end]))
                self._buf, self._mode = buf[end + len(self._end):], _AFTER_END
            elif self._mode == _AFTER_END:
                self._buf = buf.lstrip()
                if not self._buf:
                    return out
                self._mode = _CONTENT
            else:
                _append(out, ContentDelta(buf))
                self._buf = ""
                return out

    def finish(self) -> list[SplitDelta]:
        out: list[SplitDelta] = []
        mode = self._default if self._mode == _OPENING else self._mode
        if mode == _REASONING:  # no end tag in what is held: a part of one is reasoning
            _append(out, ReasoningDelta(self._buf))
        elif mode == _CONTENT:
            _append(out, ContentDelta(self._buf))
        self._buf = ""  # after the end tag only whitespace is held, and it is dropped
        return out


def _append(out: list[SplitDelta], delta: SplitDelta) -> None:
    """Add a delta, merged into the previous one of its kind (fewer events)."""
    if not delta.text:
        return
    if out and type(out[-1]) is type(delta):
        out[-1] = type(delta)(out[-1].text + delta.text)
    else:
        out.append(delta)
