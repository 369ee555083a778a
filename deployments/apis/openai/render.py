"""OpenAI's response shapes for chat completions and completions, from the neutral
events (deployments.apis.events): the whole response, or its SSE chunks.

Per engine output, each choice gets at most one chunk: its delta (`reasoning_content`
when a reasoning parser is on, `content`, `tool_calls`), its logprobs and, on the last,
its finish_reason. Logprobs, echo and prompt logprobs (vLLM's extension) are read from
the engine output the events came with.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import msgspec

from deployments.apis.errors import TIMEOUT_MESSAGE, HTTPError, map_error, usage_dict
from deployments.apis.events import (
    ChoiceEnd,
    Generation,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
)
from deployments.apis.openai.logprob_format import (
    completion_entries,
    format_logprobs,
    prompt_entries,
    prompt_logprobs_json,
    text_length,
)
from engine.errors import RequestTimeoutError
from engine.outputs import RequestOutput

_JSON = msgspec.json.Encoder()  # SSE chunks: 1.0 us each, json.dumps 10 us


@dataclass(frozen=True)
class Shape:
    """How one generation response is shaped: chat or completion, how many top
    logprobs, prompt logprobs shown (vLLM's extension) or put in front of the choice's
    logprobs (completions' echo with logprobs), reasoning shown apart."""

    chat: bool
    top_k: int
    show_prompt_logprobs: bool
    echo_logprobs: bool
    decode: Callable[[list[int]], str]
    reasoning: bool = False  # a reasoning parser is on: messages carry reasoning_content

    def prompt_entries(self, out: RequestOutput) -> list[dict]:
        return prompt_entries(out.prompt_logprobs, out.prompt_token_ids, self.top_k,
                              self.decode)


def _timeout(gen: Generation) -> HTTPError:
    u = gen.usage
    return HTTPError(408, TIMEOUT_MESSAGE, "TimeoutError",
                     usage=usage_dict(u.prompt_tokens, u.completion_tokens))


class _Choice:
    """One choice folded for the whole response."""

    def __init__(self) -> None:
        self.text = self.reasoning = ""
        self.calls: list[dict[str, Any]] = []
        self.logprobs: list[dict] = []
        self.prompt_logprobs = None
        self.finish: str | None = None

    def add(self, event) -> None:
        if isinstance(event, TextDelta):
            self.text += event.text
        elif isinstance(event, ReasoningDelta):
            self.reasoning += event.text
        elif isinstance(event, ToolCallDelta):
            if event.name is not None:
                self.calls.append({"id": event.id, "type": "function", "function": {
                    "name": event.name, "arguments": event.arguments}})
            else:
                self.calls[event.call]["function"]["arguments"] += event.arguments
        elif isinstance(event, ChoiceEnd):
            self.finish = event.finish_reason


async def full_response(gen: Generation, request_id: str, created: int, model: str,
                        n: int, shape: Shape) -> dict[str, Any]:
    choices = [_Choice() for _ in range(n)]
    try:
        async for step in gen.steps():
            out = step.out
            for c in out.outputs:
                ch = choices[c.index]
                if out.prompt_logprobs is not None:
                    ch.prompt_logprobs = out.prompt_logprobs
                    if shape.echo_logprobs:
                        ch.logprobs[:0] = shape.prompt_entries(out)
                if c.logprobs:
                    ch.logprobs += completion_entries(c, shape.top_k)
            for event in step.events:
                choices[event.choice].add(event)
    except RequestTimeoutError:
        raise _timeout(gen) from None
    rendered = []
    for i, ch in enumerate(choices):
        lp = format_logprobs(ch.logprobs, shape.chat) if ch.logprobs else None
        if shape.chat:
            content = ch.text
            if ch.calls and not content.strip():
                content = None
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if shape.reasoning:
                message["reasoning_content"] = ch.reasoning or None
            if ch.calls:
                message["tool_calls"] = ch.calls
            rendered.append({"index": i, "message": message, "logprobs": lp,
                             "finish_reason": ch.finish})
        else:
            rendered.append({"index": i, "text": ch.text, "logprobs": lp,
                             "finish_reason": ch.finish})
            if shape.show_prompt_logprobs:  # vLLM: per choice in completions
                rendered[-1]["prompt_logprobs"] = _prompt_json(ch.prompt_logprobs)
    u = gen.usage
    response = {"id": request_id, "object": "chat.completion" if shape.chat else
                "text_completion", "created": created, "model": model, "choices": rendered,
                "usage": usage_dict(u.prompt_tokens, u.completion_tokens)}
    if shape.chat and shape.show_prompt_logprobs:  # vLLM: once per chat response
        response["prompt_logprobs"] = _prompt_json(choices[0].prompt_logprobs)
    return response


def _prompt_json(prompt_logprobs) -> list | None:
    return None if prompt_logprobs is None else prompt_logprobs_json(prompt_logprobs)


def _event(payload: dict) -> bytes:
    return b"data: " + _JSON.encode(payload) + b"\n\n"


async def sse_chunks(gen: Generation, first: RequestOutput, request_id: str, created: int,
                     model: str, include_usage: bool, shape: Shape) -> AsyncIterator[bytes]:
    obj = "chat.completion.chunk" if shape.chat else "text_completion"
    started: set[int] = set()
    offsets: dict[int, int] = {}  # each choice's text_offset so far
    head = {"id": request_id, "object": obj, "created": created, "model": model}
    try:
        async for step in gen.steps(first):
            out = step.out
            echoed = (shape.prompt_entries(out) if shape.echo_logprobs
                      and out.prompt_logprobs is not None else [])
            by_choice: dict[int, list] = {}
            for event in step.events:
                by_choice.setdefault(event.choice, []).append(event)
            for c in out.outputs:
                events = by_choice.get(c.index, [])
                if not c.text and not c.token_ids and c.finish_reason is None and not events:
                    continue
                lp = None
                if c.logprobs or echoed:
                    entries = echoed + completion_entries(c, shape.top_k)
                    lp = format_logprobs(entries, shape.chat, offsets.get(c.index, 0))
                    offsets[c.index] = offsets.get(c.index, 0) + text_length(entries)
                finish = next((e.finish_reason for e in events if isinstance(e, ChoiceEnd)),
                              None)
                if not shape.chat:
                    choice = {"index": c.index, "text": "".join(
                        e.text for e in events if isinstance(e, TextDelta)),
                        "logprobs": lp, "finish_reason": finish}
                else:
                    delta = _chat_delta(events, plain=not shape.reasoning
                                        and gen.plan.tools is None)
                    if c.index not in started:
                        delta = {"role": "assistant", **delta}
                        started.add(c.index)
                    choice = {"index": c.index, "delta": delta, "logprobs": lp,
                              "finish_reason": finish}
                yield _event({**head, "choices": [choice]})
        if include_usage:
            u = gen.usage
            yield _event({**head, "choices": [],
                          "usage": usage_dict(u.prompt_tokens, u.completion_tokens)})
    except Exception as exc:  # noqa: BLE001 - reported in-band: the status is already sent
        err = _timeout(gen) if isinstance(exc, RequestTimeoutError) else map_error(exc)
        payload: dict[str, Any] = {"error": {"message": err.message, "type": err.err_type,
                                             "code": err.status}}
        if err.usage is not None:
            payload["usage"] = err.usage
        yield _event(payload)
    finally:
        await gen.aclose()
    yield b"data: [DONE]\n\n"


def _chat_delta(events: list, plain: bool) -> dict[str, Any]:
    """One choice's delta for one engine output. plain (no parser on): content always
    present, as OpenAI streams it; otherwise only the fields this output brought."""
    delta: dict[str, Any] = {}
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    if reasoning:
        delta["reasoning_content"] = reasoning
    if text or plain:
        delta["content"] = text
    calls: list[dict[str, Any]] = []
    for e in events:
        if not isinstance(e, ToolCallDelta):
            continue
        if e.name is None and calls and calls[-1]["index"] == e.call:
            calls[-1]["function"]["arguments"] += e.arguments
            continue
        call: dict[str, Any] = {"index": e.call, "function": {"arguments": e.arguments}}
        if e.name is not None:
            call.update(id=e.id, type="function")
            call["function"]["name"] = e.name
        calls.append(call)
    if calls:
        delta["tool_calls"] = calls
    return delta
