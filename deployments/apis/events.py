"""The generation path as neutral events, which each API renders in its own shape.

An engine request's outputs (RequestOutput, one per engine step that produced
something) become, per choice: reasoning text (a reasoning parser splits thinking
from the answer), answer text, tool-call deltas (the request's tool parser reads
calls out of the answer), and the choice's end; then the usage. The OpenAI chat and
completions renderers, the Responses renderer and the Anthropic Messages renderer all
consume these, so the three APIs cannot disagree on what the model said.

Streamed and non-streamed responses fold the same events (a parser's whole-text result
is the fold of its streamer), so they cannot disagree either.
"""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from deployments.apis.common.reasoning import ReasoningDelta as ParsedReasoning
from deployments.apis.common.reasoning import ReasoningParser
from deployments.apis.common.tool_calls import ContentDelta, ToolCallDelta as ParsedCall
from deployments.apis.common.tools import ToolPlan
from engine.errors import RequestTimeoutError
from engine.outputs import RequestOutput


@dataclass(frozen=True, slots=True)
class TextDelta:
    choice: int
    text: str


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    choice: int
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A tool call's first delta has its id and name; later ones add argument text."""

    choice: int
    call: int  # the call's position in the choice, from 0
    id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True, slots=True)
class ChoiceEnd:
    choice: int
    finish_reason: str | None  # "tool_calls" when the model called tools and stopped
    stop_reason: int | str | None  # the stop string or token that ended it, if one did


Event = TextDelta | ReasoningDelta | ToolCallDelta | ChoiceEnd


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0


@dataclass(frozen=True)
class OutputPlan:
    """How a request's text is read: its tool plan (None: no tool parsing), its
    reasoning parser (None: no reasoning split) and the prompt the parser needs (a
    template may open or close the thinking block itself)."""

    tools: ToolPlan | None = None
    reasoning: ReasoningParser | None = None
    prompt_text: str = ""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChoiceSplitter:
    """One choice's text in, its events out: reasoning first, then tool calls in the
    answer (each call numbered and given an id on its first delta)."""

    def __init__(self, choice: int, plan: OutputPlan) -> None:
        self.choice = choice
        self._reasoning = (plan.reasoning.streamer(plan.prompt_text)
                           if plan.reasoning is not None else None)
        parser = plan.tools.parser if plan.tools is not None else None
        self._tools = parser.streamer() if parser is not None else None
        self._max_calls = plan.tools.max_calls if plan.tools is not None else None
        self.calls = 0  # tool calls made so far

    def feed(self, text: str) -> list[Event]:
        return self._split(self._reasoning.feed(text) if self._reasoning else
                           [ContentDelta(text)] if text else [], final=False)

    def finish(self) -> list[Event]:
        return self._split(self._reasoning.finish() if self._reasoning else [], final=True)

    def _split(self, pieces: list, final: bool) -> list[Event]:
        events: list[Event] = []
        for piece in pieces:
            if isinstance(piece, ParsedReasoning):
                if piece.text:
                    events.append(ReasoningDelta(self.choice, piece.text))
                continue
            events += self._answer(piece.text)
        if final and self._tools is not None:
            events += self._tool_events(self._tools.finish())
        return events

    def _answer(self, text: str) -> list[Event]:
        if not text:
            return []
        if self._tools is None:
            return [TextDelta(self.choice, text)]
        return self._tool_events(self._tools.feed(text))

    def _tool_events(self, pieces: list) -> list[Event]:
        events: list[Event] = []
        for p in pieces:
            if isinstance(p, ContentDelta):
                if p.text:
                    events.append(TextDelta(self.choice, p.text))
                continue
            assert isinstance(p, ParsedCall)
            if self._max_calls is not None and p.index >= self._max_calls:
                continue  # parallel_tool_calls=false: later calls dropped
            if p.name is not None:
                self.calls = max(self.calls, p.index + 1)
                events.append(ToolCallDelta(self.choice, p.index, new_call_id(), p.name,
                                            p.arguments))
            elif p.arguments:
                events.append(ToolCallDelta(self.choice, p.index, None, None, p.arguments))
        return events


@dataclass
class Step:
    """What one engine output brought: the output itself (for logprobs) and its events."""

    out: RequestOutput
    events: list[Event] = field(default_factory=list)


class Generation:
    """An engine stream read as Steps; `usage` is what was used so far (also after an
    error, for the error's report). record: called with each finished output (the
    ingress metrics)."""

    def __init__(self, stream: AsyncIterator[RequestOutput], plan: OutputPlan,
                 record: Callable[[RequestOutput], Any],
                 count_tokens: Callable[[str], int] | None = None) -> None:
        """count_tokens: how many tokens a text is (the reasoning's count in usage:
        an engine output may hold both thinking and answer tokens)."""
        self.stream = stream
        self.interval_s = 0.0  # a streamed response's pace (IngressOptions.stream_interval_s)
        self._count_tokens = count_tokens
        self._reasoning_chars: list[str] = []
        self.plan = plan
        self._record = record
        self._splitters: dict[int, ChoiceSplitter] = {}
        self._prompt_tokens: dict[str, int] = {}  # per prompt's request: usage sums them
        self._cached_tokens: dict[str, int] = {}
        self._usage = Usage()

    def splitter(self, choice: int) -> ChoiceSplitter:
        s = self._splitters.get(choice)
        if s is None:
            s = self._splitters[choice] = ChoiceSplitter(choice, self.plan)
        return s

    async def steps(self, first: RequestOutput | None = None) -> AsyncIterator[Step]:
        """The outputs as Steps; the stream is closed (its requests aborted) on exit."""
        try:
            out = first if first is not None else await anext(self.stream, None)
            while out is not None:
                yield self._step(out)
                if self.interval_s and not out.finished:
                    # what comes meanwhile is merged into the next output (the client
                    # holds a stream's new tokens until they are taken)
                    await asyncio.sleep(self.interval_s)
                out = await anext(self.stream, None)
        except RequestTimeoutError as exc:
            self._prompt_tokens.setdefault(exc.request_id, exc.prompt_tokens)
            self._sum()
            raise
        finally:
            await self.stream.aclose()

    async def aclose(self) -> None:
        """Close the engine stream now (its requests aborted at the engines): a renderer
        calls it when its client goes away mid-stream, rather than leaving it to the
        garbage collector's finalizing of steps()."""
        await self.stream.aclose()

    def _step(self, out: RequestOutput) -> Step:
        self._prompt_tokens[out.request_id] = len(out.prompt_token_ids)
        self._cached_tokens[out.request_id] = out.num_cached_tokens or 0
        if out.finished:
            self._record(out)
        step = Step(out)
        for c in out.outputs:
            s = self.splitter(c.index)
            self._usage.completion_tokens += len(c.token_ids)
            step.events += s.feed(c.text)
            if c.finish_reason is not None:
                step.events += s.finish()
                reason = c.finish_reason
                if s.calls and reason == "stop":
                    reason = "tool_calls"
                step.events.append(ChoiceEnd(c.index, reason, c.stop_reason))
        self._reasoning_chars += [e.text for e in step.events if isinstance(e, ReasoningDelta)]
        self._sum()
        return step

    def _sum(self) -> None:
        self._usage.prompt_tokens = sum(self._prompt_tokens.values())
        self._usage.cached_tokens = sum(self._cached_tokens.values())

    @property
    def usage(self) -> Usage:
        """What was used so far (the reasoning's tokens counted from its text, on
        demand: renderers read usage once, at the end)."""
        u = self._usage
        if self._count_tokens is not None and self._reasoning_chars:
            u.reasoning_tokens = min(self._count_tokens("".join(self._reasoning_chars)),
                                     u.completion_tokens)
        return u
