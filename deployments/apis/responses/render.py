"""The Responses API's output: the Response object and its typed stream events, built
from the neutral generation events (deployments.apis.events).

ResponseBuilder folds events into output items in the order the model produced them:
a `reasoning` item (reasoning_text content), a `message` item (output_text), one
`function_call` item per tool call. Each step returns the stream events it caused
(response.output_item.added, response.content_part.added, response.output_text.delta,
response.reasoning_text.delta, response.function_call_arguments.delta, and their
.done events as an item closes); the non-streamed response is the same fold with the
events dropped. Whitespace between tool calls opens no message item.
"""
from __future__ import annotations

import time
import uuid
from typing import Any

from deployments.apis.events import (
    ChoiceEnd,
    Event,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
    Usage,
)
from deployments.apis.responses.protocol import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _open_item(kind: str, call: ToolCallDelta | None = None) -> dict[str, Any]:
    if kind == "reasoning":
        return {"id": new_id("rs"), "type": "reasoning", "summary": [],
                "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
    if kind == "message":
        return {"id": new_id("msg"), "type": "message", "role": "assistant",
                "status": "in_progress", "content": [
                    {"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
    assert call is not None
    return {"id": new_id("fc"), "type": "function_call", "call_id": call.id,
            "name": call.name, "arguments": "", "status": "in_progress"}


class ResponseBuilder:
    """One response's output items and stream events (see the module docstring)."""

    def __init__(self, body: ResponsesRequest, model: str, response_id: str) -> None:
        self.body, self.model, self.id = body, model, response_id
        self.created_at = int(time.time())
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being written
        self._open_call: int | None = None  # its tool call's number
        self._space = ""  # whitespace held back: it opens no message on its own
        self.finish: str | None = None
        self._seq = 0

    # ---- events -----------------------------------------------------------------------------
    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return payload

    def start(self) -> list[dict[str, Any]]:
        snapshot = self.response("in_progress", None)
        return [self.event("response.created", response=snapshot),
                self.event("response.in_progress", response=snapshot)]

    def feed(self, events: list[Event]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, ReasoningDelta):
                out += self._write("reasoning", e.text)
            elif isinstance(e, TextDelta):
                if self._open is None or self._open["type"] != "message":
                    if not (self._space + e.text).strip():
                        self._space += e.text
                        continue
                    text, self._space = self._space + e.text, ""
                    out += self._write("message", text)
                else:
                    out += self._write("message", e.text)
            elif isinstance(e, ToolCallDelta):
                out += self._call(e)
            elif isinstance(e, ChoiceEnd):
                self.finish = e.finish_reason
        return out

    def close(self) -> list[dict[str, Any]]:
        """Closes the open item (at the end of generation)."""
        return self._close_open()

    def _write(self, kind: str, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            out += self._close_open()
            out += self._add(_open_item(kind))
        item, index = self._open, len(self.output) - 1
        assert item is not None
        item["content"][0]["text"] += text
        delta = "response.reasoning_text.delta" if kind == "reasoning" else \
            "response.output_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        out.append(self.event(delta, item_id=item["id"], output_index=index, content_index=0,
                              delta=text, **extra))
        return out

    def _call(self, e: ToolCallDelta) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if e.name is not None:
            out += self._close_open()
            self._space = ""
            out += self._add(_open_item("function_call", e))
            self._open_call = e.call
        item, index = self._open, len(self.output) - 1
        if item is None or self._open_call != e.call:
            return out  # a later chunk of a call already closed: cannot happen (one delta)
        item["arguments"] += e.arguments
        if e.arguments:
            out.append(self.event("response.function_call_arguments.delta",
                                  item_id=item["id"], output_index=index, delta=e.arguments))
        return out

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.output.append(item)
        self._open = item
        index = len(self.output) - 1
        added = _snapshot(item)
        if "content" in added:  # the part comes with response.content_part.added
            added["content"] = []
        out = [self.event("response.output_item.added", output_index=index, item=added)]
        if item["type"] != "function_call":
            part = {**item["content"][0], "text": ""}
            out.append(self.event("response.content_part.added", item_id=item["id"],
                                  output_index=index, content_index=0, part=part))
        return out

    def _close_open(self) -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        self._open = self._open_call = None
        index = self.output.index(item)
        item["status"] = self._item_status()
        out = []
        if item["type"] == "function_call":
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=index, name=item["name"],
                                  arguments=item["arguments"]))
        else:
            part = item["content"][0]
            done = ("response.reasoning_text.done" if item["type"] == "reasoning" else
                    "response.output_text.done")
            extra = {"logprobs": []} if item["type"] == "message" else {}
            out.append(self.event(done, item_id=item["id"], output_index=index,
                                  content_index=0, text=part["text"], **extra))
            out.append(self.event("response.content_part.done", item_id=item["id"],
                                  output_index=index, content_index=0, part=dict(part)))
        out.append(self.event("response.output_item.done", output_index=index,
                              item=_snapshot(item)))
        return out

    def _item_status(self) -> str:
        return "incomplete" if self.finish == "length" else "completed"

    # ---- the Response object ----------------------------------------------------------------
    def status(self) -> str:
        return "incomplete" if self.finish == "length" else "completed"

    def response(self, status: str, usage: Usage | None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        b = self.body
        fmt = (b.text.format.model_dump(by_alias=True, exclude_none=True)
               if b.text is not None and b.text.format is not None else {"type": "text"})
        out: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "error": error,
            "incomplete_details": ({"reason": "max_output_tokens"}
                                   if status == "incomplete" else None),
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "model": self.model, "output": [_snapshot(i) for i in self.output]
            if status != "in_progress" else [],
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": b.store is not False,
            "temperature": b.temperature, "text": {"format": fmt},
            "tool_choice": (b.tool_choice.model_dump() if hasattr(b.tool_choice, "model_dump")
                            else b.tool_choice or ("auto" if b.tools else "none")),
            "tools": [{"type": "function", "name": t.name, "description": t.description,
                       "parameters": t.parameters, "strict": t.strict}
                      for t in b.tools or ()],
            "top_p": b.top_p, "truncation": "disabled", "user": b.user,
            "metadata": b.metadata or {}, "usage": None}
        if usage is not None:
            out["usage"] = {
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
                "total_tokens": usage.prompt_tokens + usage.completion_tokens}
        return out

    def assistant_messages(self) -> list[dict[str, Any]]:
        """The output as chat messages (what a follow-up's prompt continues): the
        message text and the tool calls; reasoning is left out, as templates do."""
        text = "".join(i["content"][0]["text"] for i in self.output if i["type"] == "message")
        calls = [{"id": i["call_id"], "type": "function",
                  "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.output if i["type"] == "function_call"]
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = calls
        return [message]


def _snapshot(item: dict[str, Any]) -> dict[str, Any]:
    """A copy of an item as it stands (events must not change when it grows)."""
    copy = dict(item)
    if "content" in copy:
        copy["content"] = [dict(part) for part in item["content"]]
    return copy
