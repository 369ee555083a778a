"""What a tool-call parser takes and gives: calls, deltas, and the two interfaces every
format implements (a stateless parser, a per-choice streamer)."""
from __future__ import annotations

import abc
from dataclasses import dataclass



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


def append_delta(out: list[Delta], delta: Delta) -> None:
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
