"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) over scripted mock
engines, driven by the official `anthropic` SDK: the mock says what a prompt's last
[[emit]]...[[/emit]] directive says, so each test scripts the model's reply."""
import asyncio
import json

import anthropic
import httpx
import httpx2
import pytest

from deployments.apis.anthropic.protocol import MessagesRequest
from deployments.apis.anthropic.render import MessageShape, sse_events
from deployments.apis.events import Generation, OutputPlan
from deployments.apis.server import IngressOptions, build_api_app
from engine.errors import EngineOverloadedError, RequestTimeoutError
from engine.outputs import CompletionOutput, RequestOutput
from tests.app_server import MODEL, serve_app_over_mocks
from tests.test_core_client import Engines

KEY = "sekret"
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def emit(text: str) -> str:
    return f"[[emit]]{text}[[/emit]]"


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def server(tokenizer):
    with serve_app_over_mocks(tokenizer, engines=1, scripted=True,
                              reasoning_parser="qwen3") as s:
        yield s


def run(server, test):
    """Run `test(client)` with an AsyncAnthropic client of the server."""
    async def main():
        async with anthropic.AsyncAnthropic(base_url=server.url, max_retries=0,
                                            api_key="none") as client:
            return await test(client)
    return asyncio.run(main())


def test_plain_and_streamed_messages_agree(server):
    async def test(c):
        whole = await c.messages.create(model=MODEL, max_tokens=100,
                                        system="Be brief.", messages=user(emit("Hello there")))
        async with c.messages.stream(model=MODEL, max_tokens=100,
                                     messages=user(emit("Hello there"))) as s:
            texts = [t async for t in s.text_stream]
            final = await s.get_final_message()
        raw = [e async for e in await c.messages.create(
            model=MODEL, max_tokens=100, messages=user(emit("Hi")), stream=True)]
        return whole, texts, final, raw

    whole, texts, final, raw = run(server, test)
    assert whole.id.startswith("msg_") and whole.model == MODEL and whole.role == "assistant"
    assert [(b.type, b.text) for b in whole.content] == [("text", "Hello there")]
    assert whole.stop_reason == "end_turn" and whole.stop_sequence is None
    assert whole.usage.input_tokens > 0 and whole.usage.output_tokens > 0
    assert whole.usage.cache_creation_input_tokens == 0
    assert "".join(texts) == "Hello there"
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == "end_turn" and final.usage.output_tokens > 0
    kinds = [e.type for e in raw]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert raw[0].message.usage.input_tokens > 0 and raw[-2].delta.stop_reason == "end_turn"


def test_a_tool_round_trip(server):
    async def test(c):
        asked = user(emit(CALL))
        called = await c.messages.create(model=MODEL, max_tokens=200, tools=[WEATHER],
                                         messages=asked)
        async with c.messages.stream(model=MODEL, max_tokens=200, tools=[WEATHER],
                                     messages=asked) as s:
            streamed = await s.get_final_message()
        use = next(b for b in called.content if b.type == "tool_use")
        answered = await c.messages.create(
            model=MODEL, max_tokens=200, tools=[WEATHER],
            messages=asked + [{"role": "assistant", "content": called.content},
                              {"role": "user", "content": [{
                                  "type": "tool_result", "tool_use_id": use.id,
                                  "content": [{"type": "text",
                                               "text": emit("Sunny, 21 C.")}]}]}])
        single = await c.messages.create(
            model=MODEL, max_tokens=200, tools=[WEATHER], messages=user(emit(CALL + CALL)),
            tool_choice={"type": "auto", "disable_parallel_tool_use": True})
        return called, streamed, answered, single

    called, streamed, answered, single = run(server, test)
    assert called.stop_reason == "tool_use"
    (use,) = called.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    assert use.input == {"city": "Paris"}
    (s_use,) = streamed.content
    assert streamed.stop_reason == "tool_use" and s_use.input == {"city": "Paris"}
    assert [(b.type, b.text) for b in answered.content] == [("text", "Sunny, 21 C.")]
    assert answered.stop_reason == "end_turn"
    assert [b.type for b in single.content] == ["tool_use"]


def test_thinking_blocks_streamed_and_not(server):
    script = emit("<think>hmm, let me see</think>The answer is 4.")
    thinking = {"type": "enabled", "budget_tokens": 1024}

    async def test(c):
        whole = await c.messages.create(model=MODEL, max_tokens=2000, thinking=thinking,
                                        messages=user(script))
        async with c.messages.stream(model=MODEL, max_tokens=2000, thinking=thinking,
                                     messages=user(script)) as s:
            events = [e async for e in s]
            final = await s.get_final_message()
        omitted = await c.messages.create(model=MODEL, max_tokens=2000, messages=user(script),
                                          thinking={**thinking, "display": "omitted"})
        return whole, events, final, omitted

    whole, events, final, omitted = run(server, test)
    think, text = whole.content
    assert think.type == "thinking" and think.thinking == "hmm, let me see" and think.signature
    assert text.type == "text" and text.text == "The answer is 4."
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert "thinking_delta" in deltas and "signature_delta" in deltas
    assert deltas.index("signature_delta") < deltas.index("text_delta")
    assert omitted.content[0].thinking == "" and omitted.content[0].signature
    assert omitted.content[1].text == "The answer is 4."


def test_stop_sequences_max_tokens_and_prefill(server):
    async def test(c):
        stopped = await c.messages.create(model=MODEL, max_tokens=100, stop_sequences=["three"],
                                          messages=user(emit("one two three four")))
        cut = await c.messages.create(model=MODEL, max_tokens=3,
                                      messages=user(emit("a long answer that goes on and on")))
        async with c.messages.stream(model=MODEL, max_tokens=3,
                                     messages=user(emit("a long answer that goes on"))) as s:
            cut_streamed = await s.get_final_message()
        prefilled = await c.messages.create(
            model=MODEL, max_tokens=50, metadata={"user_id": "u-1"}, service_tier="auto",
            cache_control={"type": "ephemeral"},  # (this SDK has no sampling arguments)
            extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 5},
            messages=user(emit("the rest")) + [{"role": "assistant", "content": "Sure:"}])
        return stopped, cut, cut_streamed, prefilled

    stopped, cut, cut_streamed, prefilled = run(server, test)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "three"
    assert stopped.content[0].text == "one two "
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    assert cut_streamed.stop_reason == "max_tokens" and cut_streamed.usage.output_tokens == 3
    assert prefilled.content[0].text == "the rest" and prefilled.stop_reason == "end_turn"


def test_count_tokens_is_the_prompt_of_the_request(server):
    messages = user(emit("Hi")) + [{"role": "assistant", "content": "Hello"},
                                   {"role": "user", "content": "And?"}]

    async def test(c):
        made = await c.messages.create(model=MODEL, max_tokens=5, system="sys",
                                       messages=messages, tools=[WEATHER])
        counted = await c.messages.count_tokens(model=MODEL, system="sys", messages=messages,
                                                tools=[WEATHER])
        bare = await c.messages.count_tokens(model=MODEL, messages=messages)
        return made, counted, bare

    made, counted, bare = run(server, test)
    u = made.usage
    assert counted.input_tokens == u.input_tokens + u.cache_read_input_tokens
    assert 0 < bare.input_tokens < counted.input_tokens  # no tool prompt, no system


def test_api_key_as_bearer_or_x_api_key(tokenizer):
    """In process (the served test app checks /v1/models without a key)."""
    engines = Engines(tokenizer)
    engines.add()
    body = {"model": MODEL, "max_tokens": 5, "messages": user("hi")}
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "whatever-2025"}

    async def main():
        client = await engines.client()

        async def get_client():
            return client
        app = build_api_app(get_client, IngressOptions(MODEL, api_key=KEY))
        results = {}
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://flotilla") as http:
                results["x-api-key"] = await http.post(
                    "/v1/messages", json=body, headers={**headers, "x-api-key": KEY})
                results["bad"] = await http.post("/v1/messages", json=body,
                                                 headers={"x-api-key": "nope"})
            for name, options in (("bearer", {"api_key": KEY}),
                                  ("header", {"api_key": None,
                                              "default_headers": {"x-api-key": KEY}}),
                                  ("wrong", {"api_key": "wrong"})):
                http2 = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app))
                async with anthropic.AsyncAnthropic(base_url="http://flotilla", max_retries=0,
                                                    http_client=http2, **options) as c:
                    try:
                        results[name] = await c.messages.create(**body)
                    except anthropic.APIStatusError as exc:
                        results[name] = exc
        finally:
            await client.shutdown()
        return results

    try:
        results = asyncio.run(main())
    finally:
        engines.stop()
    assert results["x-api-key"].status_code == 200, results["x-api-key"].text
    bad = results["bad"]
    assert bad.status_code == 401 and bad.json()["type"] == "error"
    assert bad.json()["error"]["type"] == "authentication_error"
    assert results["bearer"].usage.output_tokens == 5
    assert results["header"].usage.output_tokens == 5
    wrong = results["wrong"]
    assert isinstance(wrong, anthropic.AuthenticationError)
    assert wrong.status_code == 401 and wrong.body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("change, status, says", [
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "web_search_20250305"),
    ({"frobnicate": 1}, 400, "frobnicate"),
    ({"container": "c-1"}, 400, "container is not supported"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, 400, "mcp_servers"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AAAA"}}]}]}, 400, "'image'"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}]}]}, 400,
     "messages.0.content.0"),
    ({"thinking": {"type": "enabled", "budget_tokens": 512}}, 400, "budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 1024}, 400,
     "less than max_tokens"),
    ({"temperature": 1.5}, 400, "temperature"),
    ({"service_tier": "priority"}, 400, "service_tier"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]}, 400, "nope"),
    ({"model": "no-such-model"}, 404, "no-such-model"),
])
def test_refusals_are_anthropic_errors(server, change, status, says):
    body = {"model": MODEL, "max_tokens": 50, "messages": user("hi"), **change}
    r = httpx.post(f"{server.url}/v1/messages", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and says in err["error"]["message"], err
    assert err["error"]["type"] == ("invalid_request_error" if status == 400
                                    else "not_found_error")


def test_the_sdk_raises_bad_request(server):
    async def test(c):
        with pytest.raises(anthropic.BadRequestError) as err:
            await c.messages.create(model=MODEL, max_tokens=5, messages=user("hi"),
                                    tools=[{"type": "bash_20250124", "name": "bash"}])
        return err.value

    err = run(server, test)
    assert err.body["error"]["type"] == "invalid_request_error" and "bash" in err.message


def test_the_conversation_mapping():
    req = MessagesRequest.model_validate({
        "model": MODEL, "max_tokens": 10, "system": [{"type": "text", "text": "a"},
                                                     {"type": "text", "text": "b"}],
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": "s"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "text", "text": "thanks", "cache_control": {"type": "ephemeral"}},
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "boom",
                 "is_error": True}]}],
        "tools": [WEATHER], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "disabled"}})
    chat = req.chat_input()
    assert chat.conversation == [
        {"role": "system", "content": "a\n\nb"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [{
            "id": "toolu_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: boom"},
        {"role": "user", "content": "thanks"}]
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.template_kwargs == {"enable_thinking": False}
    assert chat.tools == [{"type": "function", "function": {
        "name": "get_weather", "description": WEATHER["description"],
        "parameters": WEATHER["input_schema"]}}]
    params = req.sampling_params(None, {"temperature": 0.7})
    assert params.temperature == 0.7 and params.max_tokens == 10


def _output(text: str, ids: list[int], finished: bool = False) -> RequestOutput:
    return RequestOutput("r", None, [1, 2, 3], [CompletionOutput(
        0, text, ids, finish_reason="stop" if finished else None)], finished)


@pytest.mark.parametrize("error, kind", [(EngineOverloadedError("full"), "rate_limit_error"),
                                         (RequestTimeoutError("late", "r", 3), "timeout_error")])
def test_an_error_after_the_stream_started_is_an_error_event(error, kind):
    async def main():
        async def stream():
            yield _output("Hel", [5])
            raise error
        s = stream()
        gen = Generation(s, OutputPlan(), lambda out: None)
        first = await s.__anext__()
        return [chunk async for chunk in sse_events(gen, first, MessageShape("msg_1", MODEL))]

    chunks = asyncio.run(main())
    names = [c.split(b"\n")[0].decode() for c in chunks]
    assert names == ["event: message_start", "event: content_block_start",
                     "event: content_block_delta", "event: error"]
    err = json.loads(chunks[-1].split(b"data: ", 1)[1])
    assert err["type"] == "error" and err["error"]["type"] == kind
