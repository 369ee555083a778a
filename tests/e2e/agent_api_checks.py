"""The agent APIs through Serve (DP=2, two ingress replicas, scripted mock engines),
with the official SDKs: called from tests/e2e/test_serve_app.py, which owns the module's
one Ray session (these run before its tests that kill replicas).

The scripted mock emits a prompt's last [[emit]]...[[/emit]] text, so each check says
what the "model" answers: text, reasoning tags, tool-call markup, JSON.
"""
from __future__ import annotations

import json

import anthropic
import httpx
import openai
from pydantic import BaseModel

from tests.app_server import check_openai_error

MODEL = "mock"
CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>')
FUNCTION = {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def emit(text: str) -> str:
    return f"[[emit]]{text}[[/emit]]"


class City(BaseModel):
    name: str
    population: int


def responses_sdk(base_url: str) -> None:
    """responses.create plain and streamed, with tools, text.format parsed into a pydantic
    model, and a follow-up through previous_response_id answered by the other replica."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    r = client.responses.create(model=MODEL, input=emit("Hello from Serve."))
    assert r.output_text == "Hello from Serve." and r.usage.total_tokens > 0
    with client.responses.stream(model=MODEL, input=emit("Streamed.")) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == "Streamed." == final.output_text
    tools = [{"type": "function", **FUNCTION}]
    r = client.responses.create(model=MODEL, input=emit(CALL), tools=tools)
    call = next(i for i in r.output if i.type == "function_call")
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    parsed = client.responses.parse(model=MODEL, text_format=City, input=emit(
        '<think>A city.</think>{"name": "Paris", "population": 2100000}'))
    assert parsed.output_parsed == City(name="Paris", population=2100000)
    # the tool result goes back through previous_response_id until the other ingress
    # replica answers: the stored response is the coordinator's, not the replica's
    first = client.responses.with_raw_response.create(model=MODEL, input=emit(CALL),
                                                      tools=tools)
    made_by, made = first.headers["x-flotilla-replica"], first.parse()
    call = next(i for i in made.output if i.type == "function_call")
    for _ in range(40):
        raw = client.responses.with_raw_response.create(
            model=MODEL, previous_response_id=made.id, tools=tools, input=[{
                "type": "function_call_output", "call_id": call.call_id,
                "output": emit("Sunny in Paris.")}])
        if raw.headers["x-flotilla-replica"] != made_by:
            break
    else:
        raise AssertionError("every follow-up landed on the replica that made the response")
    assert raw.parse().output_text == "Sunny in Paris."
    assert client.responses.retrieve(made.id).id == made.id  # GET from any replica
    client.responses.delete(made.id)


def messages_sdk(base_url: str) -> None:
    """messages.create plain and streamed, a tool round trip, count_tokens."""
    client = anthropic.Anthropic(base_url=base_url, api_key="none", max_retries=0)
    m = client.messages.create(model=MODEL, max_tokens=64, messages=[
        {"role": "user", "content": emit("Hi from Claude's API.")}])
    assert m.content[0].type == "text" and m.content[0].text == "Hi from Claude's API."
    assert m.stop_reason == "end_turn" and m.usage.input_tokens > 0
    with client.messages.stream(model=MODEL, max_tokens=64, messages=[
            {"role": "user", "content": emit("Streamed reply.")}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Streamed reply." == final.content[0].text
    tools = [{"name": FUNCTION["name"], "description": FUNCTION["description"],
              "input_schema": FUNCTION["parameters"]}]
    asked = [{"role": "user", "content": f"Weather? {emit(CALL)}"}]
    m = client.messages.create(model=MODEL, max_tokens=64, tools=tools, messages=asked)
    use = next(b for b in m.content if b.type == "tool_use")
    assert m.stop_reason == "tool_use" and use.input == {"city": "Paris"}
    m2 = client.messages.create(model=MODEL, max_tokens=64, tools=tools, messages=asked + [
        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": emit("It is sunny.")}]}])
    assert m2.content[-1].text == "It is sunny." and m2.stop_reason == "end_turn"
    count = client.messages.count_tokens(model=MODEL, messages=asked, tools=tools)
    assert count.input_tokens > 0


def reasoning_split(base_url: str, prefix: str, script: str, thinking: str,
                    answer: str) -> None:
    """Chat completions' reasoning_content, streamed and not, on an app with a parser."""
    client = openai.OpenAI(base_url=f"{base_url}{prefix}/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": emit(script)}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64)
    message = r.choices[0].message
    assert (message.reasoning_content, message.content) == (thinking, answer)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages,
                                                 max_tokens=64, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == thinking
    assert "".join(d.content or "" for d in deltas) == answer


def fuzz_new_endpoints(base_url: str, examples: int = 6) -> None:
    """Schemathesis over the Responses and Messages operations through Serve: no 5xx,
    and every 4xx in its API's error shape (tests/test_api_fuzz.py fuzzes the other
    operations in-process, with more examples)."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    operations = [op for op in operations
                  if op.path.startswith(("/v1/responses", "/v1/messages"))]
    assert len(operations) == 5, [op.label for op in operations]
    failures = {}
    for op in operations:
        for mode in GenerationMode:
            @given(case=op.as_strategy(mode))
            @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            def fuzz(case):
                response = case.call(base_url=base_url, timeout=60)
                where = f"{case.method} {case.formatted_path} {str(case.body)[:300]!r}"
                assert response.status_code < 500, (
                    f"{where} -> {response.status_code}: {response.text[:300]}")
                if response.status_code >= 400:
                    body = response.json()
                    if case.path.startswith("/v1/messages"):
                        assert body["type"] == "error" and body["error"]["message"], where
                    else:
                        check_openai_error(response.status_code, body, where)
            try:
                fuzz()
            except Unsatisfiable:
                pass
            except Exception as exc:  # noqa: BLE001 - collected, reported together
                failures[f"{op.label} ({mode.value})"] = str(exc)[:1500]
    assert not failures, "\n\n".join(f"{k}:\n{v}" for k, v in failures.items())
    assert httpx.get(f"{base_url}/health", timeout=30).status_code == 200
