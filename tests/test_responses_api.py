"""POST /v1/responses (+ GET / DELETE), and chat completions with a reasoning parser, on
the in-process app over scripted mock engines,
driven by the official openai SDK: plain and streamed text, function tools (auto,
required through the grammar check of the mock), text.format json_schema parsed into
a pydantic model, reasoning items (qwen3 parser), previous_response_id, store=false,
and the 400s for what is not implemented. The same flows through Serve (DP=2, two
ingress replicas, the store shared by both) are in tests/e2e/agent_api_checks.py."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.app_server import MODEL, serve_app_over_mocks

CALL = ('[[emit]]<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>[[/emit]]')
# tool_choice "required": a JSON array of calls, the grammar applying after the thinking
FORCED = ('[[emit]]<think>Use the tool.</think>[{"name": "get_weather", "arguments": '
          '{"city": "Paris"}}][[/emit]]')
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}]


class City(BaseModel):
    name: str
    population: int


@pytest.fixture(scope="module")
def server(tokenizer):
    with serve_app_over_mocks(tokenizer, engines=2, scripted=True,
                              reasoning_parser="qwen3") as s:
        yield s


def run(server, test):
    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none",
                                      max_retries=0) as oai:
            await test(oai)
    asyncio.run(main())


def test_text_plain_and_streamed(server):
    async def test(oai):
        r = await oai.responses.create(model=MODEL, input="[[emit]]Hello there.[[/emit]]")
        assert r.status == "completed" and r.output_text == "Hello there."
        assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
        assert [i.type for i in r.output] == ["message"]
        kinds, text = [], ""
        async with oai.responses.stream(model=MODEL, input="[[emit]]Hi you.[[/emit]]",
                                        instructions="Be brief.") as stream:
            async for event in stream:
                kinds.append(event.type)
                if event.type == "response.output_item.added":
                    assert event.item.content == []  # the part comes with its own event
                if event.type == "response.output_text.delta":
                    text += event.delta
            final = await stream.get_final_response()
        assert text == "Hi you." == final.output_text and final.instructions == "Be brief."
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] == "response.completed"
        for kind in ("response.output_item.added", "response.content_part.added",
                     "response.output_text.done", "response.output_item.done"):
            assert kind in kinds
    run(server, test)


def test_function_calls_and_a_tool_round_trip(server):
    async def test(oai):
        r = await oai.responses.create(model=MODEL, input=f"Weather? {CALL}", tools=TOOLS)
        calls = [i for i in r.output if i.type == "function_call"]
        assert len(calls) == 1 and calls[0].name == "get_weather"
        assert json.loads(calls[0].arguments) == {"city": "Paris"}
        follow = await oai.responses.create(
            model=MODEL, previous_response_id=r.id, tools=TOOLS, input=[{
                "type": "function_call_output", "call_id": calls[0].call_id,
                "output": "[[emit]]It is sunny in Paris.[[/emit]]"}])
        assert follow.output_text == "It is sunny in Paris."
        assert follow.previous_response_id == r.id
        # streamed: the arguments arrive as function_call_arguments events
        kinds, args = [], ""
        async with oai.responses.stream(model=MODEL, input=FORCED, tools=TOOLS,
                                        tool_choice="required") as stream:
            async for event in stream:
                kinds.append(event.type)
                if event.type == "response.function_call_arguments.delta":
                    args += event.delta
            final = await stream.get_final_response()
        assert json.loads(args) == {"city": "Paris"}
        assert "response.function_call_arguments.done" in kinds
        assert [i.type for i in final.output] == ["reasoning", "function_call"]
        with pytest.raises(openai.BadRequestError, match="does not satisfy"):
            await oai.responses.create(model=MODEL, input=CALL.replace(
                "[[emit]]", "[[emit]]<think>Hmm.</think>"), tools=TOOLS, tool_choice="required")
    run(server, test)


def test_text_format_json_schema_is_parsed(server):
    async def test(oai):
        r = await oai.responses.parse(
            model=MODEL, text_format=City,
            input='[[emit]]{"name": "Paris", "population": 2100000}[[/emit]]')
        assert r.output_parsed == City(name="Paris", population=2100000)
        with pytest.raises(openai.BadRequestError, match="does not satisfy"):
            await oai.responses.parse(model=MODEL, text_format=City,
                                      input='[[emit]]<think>x</think>{"name": "Paris"}[[/emit]]')
    run(server, test)


def test_reasoning_items(server):
    async def test(oai):
        script = "[[emit]]<think>Paris is in France.</think>It is Paris.[[/emit]]"
        r = await oai.responses.create(model=MODEL, input=script)
        assert [i.type for i in r.output] == ["reasoning", "message"]
        assert r.output[0].content[0].text == "Paris is in France."
        assert r.output_text == "It is Paris." and r.usage.output_tokens_details.reasoning_tokens > 0
        reasoning = ""
        async with oai.responses.stream(model=MODEL, input=script) as stream:
            async for event in stream:
                if event.type == "response.reasoning_text.delta":
                    reasoning += event.delta
            final = await stream.get_final_response()
        assert reasoning == "Paris is in France." and final.output_text == "It is Paris."
    run(server, test)


def test_store_get_delete_and_limits(server):
    async def test(oai):
        r = await oai.responses.create(model=MODEL, input="[[emit]]Kept.[[/emit]]",
                                       metadata={"k": "v"}, max_output_tokens=2)
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        got = await oai.responses.retrieve(r.id)
        assert got.id == r.id and got.metadata == {"k": "v"}
        await oai.responses.delete(r.id)
        with pytest.raises(openai.NotFoundError):
            await oai.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            await oai.responses.delete(r.id)
        unstored = await oai.responses.create(model=MODEL, input="[[emit]]x[[/emit]]",
                                              store=False)
        with pytest.raises(openai.NotFoundError):
            await oai.responses.retrieve(unstored.id)
        with pytest.raises(openai.NotFoundError, match="previous_response_id|not found"):
            await oai.responses.create(model=MODEL, input="hi",
                                       previous_response_id=unstored.id)
    run(server, test)


@pytest.mark.parametrize("field, value, param", [
    ("tools", [{"type": "web_search"}], "tools.0.type"),
    ("background", True, "background"),
    ("truncation", "auto", "truncation"),
    ("include", ["reasoning.encrypted_content"], "include"),
    ("reasoning", {"effort": "high"}, "reasoning.effort"),
    ("input", [{"type": "input_image", "image_url": "x"}], "input.0.type"),
    ("input", [{"role": "user", "content": [{"type": "input_image"}]}], "input.0.content.0"),
    ("conversation", "conv_1", "conversation"),
    ("frequency_penalty", 0.5, "frequency_penalty"),
    ("chat_template_kwargs", {"tokenize": True}, "chat_template_kwargs"),
])
def test_unsupported_fields_are_refused_by_name(server, field, value, param):
    body = {"model": MODEL, "input": "hi", field: value}
    if field == "input":
        body["input"] = value
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param or param in err["message"], err


def test_chat_completions_reasoning_with_tools_and_a_schema(server):
    """The thinking goes to reasoning_content, the call after it is parsed (streamed and
    not), and a response format is enforced after the thinking only."""
    async def test(oai):
        tools = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items()
                                                   if k != "type"}}]
        script = CALL.replace("[[emit]]", "[[emit]]<think>Weather needs a tool.</think>")
        messages = [{"role": "user", "content": script}]
        r = await oai.chat.completions.create(model=MODEL, messages=messages, tools=tools)
        message = r.choices[0].message
        assert message.reasoning_content == "Weather needs a tool."
        assert message.tool_calls[0].function.name == "get_weather"
        assert r.choices[0].finish_reason == "tool_calls" and not message.content
        reasoning, calls = "", []
        async for chunk in await oai.chat.completions.create(
                model=MODEL, messages=messages, tools=tools, stream=True):
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            calls += delta.tool_calls or []
        assert reasoning == "Weather needs a tool." and calls[0].function.name == "get_weather"
        # the message goes back as it came, reasoning_content included (the SDK's loop)
        follow = messages + [message.model_dump(exclude_none=True), {
            "role": "tool", "tool_call_id": message.tool_calls[0].id,
            "content": "[[emit]]Sunny.[[/emit]]"}]
        after = await oai.chat.completions.create(model=MODEL, messages=follow, tools=tools)
        assert after.choices[0].message.content == "Sunny."
        schema = {"type": "json_schema", "json_schema": {"name": "city", "schema":
                                                         City.model_json_schema()}}
        ok = await oai.chat.completions.create(model=MODEL, response_format=schema, messages=[
            {"role": "user", "content": '[[emit]]<think>{not json}</think>'
                                        '{"name": "Oslo", "population": 700000}[[/emit]]'}])
        assert ok.choices[0].message.reasoning_content == "{not json}"
        assert City.model_validate_json(ok.choices[0].message.content).name == "Oslo"
    run(server, test)


def test_a_stream_closed_by_its_client_is_aborted(tokenizer):
    """Responses and Messages streams left mid-way abort their engine requests (nothing
    stays in flight at the engine client)."""
    import time

    with serve_app_over_mocks(tokenizer, engines=1, itl_s=0.01) as s:
        bodies = {"/v1/responses": {"model": MODEL, "input": "hi", "stream": True,
                                    "max_output_tokens": 2000},
                  "/v1/messages": {"model": MODEL, "max_tokens": 2000, "stream": True,
                                   "messages": [{"role": "user", "content": "hi"}]}}
        for path, body in bodies.items():
            with httpx.stream("POST", f"{s.url}{path}", json=body, timeout=30) as r:
                assert r.status_code == 200
                next(r.iter_lines())
            client = s.clients[-1]
            deadline = time.monotonic() + 10
            while client.num_in_flight and time.monotonic() < deadline:
                time.sleep(0.05)
            assert client.num_in_flight == 0, path
