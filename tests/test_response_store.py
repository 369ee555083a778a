"""The response store's bounds (count, age, bytes) and the Responses input mapping,
without a server."""
from __future__ import annotations

import pytest

from deployments.apis.errors import ParamError
from deployments.apis.responses.protocol import input_messages
from deployments.apis.responses.store import ResponseStore


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def record(text: str) -> dict:
    return {"response": {"id": text}, "conversation": [{"role": "user", "content": text}]}


def test_the_oldest_go_first_past_the_count_and_the_bytes():
    store = ResponseStore(max_items=2, ttl_s=60)
    for name in ("a", "b", "c"):
        assert store.put(name, record(name))
    assert store.get("a") is None and store.get("c") == record("c") and len(store) == 2
    one = len(b'{"response":{"id":"x"},"conversation":[{"role":"user","content":"x"}]}')
    store = ResponseStore(max_items=100, ttl_s=60, max_bytes=2 * one + 10)
    for name in ("x", "y", "z"):
        store.put(name, record(name))
    assert store.get("x") is None and store.get("y") and store.get("z")
    assert store.bytes <= 2 * one + 10
    assert store.put("big", record("q" * 1000)) is False and store.get("big") is None
    assert store.delete("y") and not store.delete("y") and store.bytes == one


def test_records_expire_after_their_ttl():
    clock = Clock()
    store = ResponseStore(max_items=10, ttl_s=5, clock=clock)
    store.put("a", record("a"))
    clock.now = 3
    store.put("b", record("b"))
    clock.now = 6
    assert store.get("a") is None and store.get("b") is not None
    clock.now = 9
    assert len(store) == 0 and store.bytes == 0


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        ResponseStore(max_items=0)
    with pytest.raises(ValueError):
        ResponseStore(ttl_s=0)


def test_input_items_become_chat_messages():
    """developer is the system role; a function_call joins the assistant turn before it;
    its output is a tool message; reasoning items are left out."""
    messages = input_messages([
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}])
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    with pytest.raises(ParamError, match="input_image"):
        input_messages([{"type": "input_image"}])
    with pytest.raises(ParamError, match="call_id"):
        input_messages([{"type": "function_call", "name": "w", "arguments": "{}"}])
