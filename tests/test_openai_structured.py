"""Structured outputs, tool calling and honest parameters through the OpenAI app, with
the official client, over a real engine on a tiny random model (no Ray)."""
import json

import jsonschema
import pytest

from tests.test_openai_app import MODEL, _Real, serve, tiny_server  # noqa: F401
from tests.test_structured_outputs import FLAGS, PERSON

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "integer", "minimum": -12, "maximum": 12}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def real(tiny_server, tiny_llama):
    from engine.model.loader import load_tokenizer
    return _Real(tiny_server, load_tokenizer(tiny_llama))


def _params(tool):
    return tool["function"]["parameters"]


def test_response_format_and_vllm_constraints(real):
    async def test(http, oai):
        out = {}
        for name, schema in (("person", PERSON), ("flags", FLAGS)):
            r = await oai.chat.completions.create(
                model=MODEL, messages=MSGS, max_tokens=160, seed=3,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": name, "schema": schema}})
            out[name] = r.choices[0].message.content
        pieces = []
        async for chunk in await oai.chat.completions.create(
                model=MODEL, messages=MSGS, max_tokens=160, temperature=0, stream=True,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "p", "schema": PERSON}}):
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
        out["streamed"] = "".join(pieces)
        r = await oai.completions.create(model=MODEL, prompt="Answer:", max_tokens=10, seed=1,
                                         extra_body={"structured_outputs": {
                                             "choice": ["red", "green"]}})
        out["choice"] = r.choices[0].text
        r = await oai.completions.create(model=MODEL, prompt="Code:", max_tokens=10, seed=1,
                                         extra_body={"guided_regex": "[A-Z]{2}[0-9]{2}"})
        out["regex"] = r.choices[0].text
        r = await oai.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=100,
                                              extra_body={"guided_json": FLAGS}, seed=5)
        out["guided_json"] = r.choices[0].message.content
        return out

    out = serve(real, test)
    jsonschema.validate(json.loads(out["person"]), PERSON)
    jsonschema.validate(json.loads(out["flags"]), FLAGS)
    jsonschema.validate(json.loads(out["streamed"]), PERSON)
    jsonschema.validate(json.loads(out["guided_json"]), FLAGS)
    assert out["choice"] in ("red", "green")
    import re
    assert re.fullmatch("[A-Z]{2}[0-9]{2}", out["regex"])


def test_unknown_unsupported_and_bad_fields_are_400_naming_them(real):
    async def test(http, oai):
        results = {}
        cases = {
            "unknown": ("/v1/chat/completions", {"messages": MSGS, "frobnicate": 1}),
            "unknown_nested": ("/v1/chat/completions", {
                "messages": MSGS, "response_format": {"type": "json_object", "extra": 1}}),
            "audio": ("/v1/chat/completions", {"messages": MSGS, "audio": {"voice": "x"}}),
            "suffix": ("/v1/completions", {"prompt": "x", "suffix": "y"}),
            "bad_schema": ("/v1/chat/completions", {
                "messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {
                    "name": "x", "schema": {"type": "strin"}}}}),
            "bad_regex": ("/v1/completions", {"prompt": "x", "guided_regex": "a(b"}),
            "two": ("/v1/completions", {"prompt": "x", "guided_regex": "a",
                                        "structured_outputs": {"choice": ["b"]}}),
            "bias": ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 300}}),
            "bias_id": ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 1}}),
            "tool_choice": ("/v1/chat/completions", {"messages": MSGS,
                                                     "tool_choice": "required"}),
            "part": ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "x"}}]}]}),
            "strict_auto": ("/v1/chat/completions", {"messages": MSGS, "tools": [
                {**WEATHER, "function": {**WEATHER["function"], "strict": True}}]}),
            "parallel_no_tools": ("/v1/chat/completions", {"messages": MSGS,
                                                           "parallel_tool_calls": False}),
            "stream_options": ("/v1/completions", {"prompt": "x", "stream_options": {
                "include_usage": True}}),
            "min_tokens": ("/v1/completions", {"prompt": "x", "min_tokens": 2,
                                               "guided_choice": ["a"]}),
        }
        for name, (path, body) in cases.items():
            r = await http.post(path, json=body)
            results[name] = (r.status_code, r.json()["error"]["param"],
                             r.json()["error"]["message"])
        r = await http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 3,
                                                          "user": "u-1", "store": False})
        results["after"] = r.status_code
        return results

    r = serve(real, test)
    assert r["unknown"][:2] == (400, "frobnicate") and "unknown field" in r["unknown"][2]
    assert r["unknown_nested"][:2] == (400, "response_format.extra")
    assert r["audio"][:2] == (400, "audio") and "not supported" in r["audio"][2]
    assert r["suffix"][:2] == (400, "suffix")
    assert r["bad_schema"][0] == 400 and "strin" in r["bad_schema"][2]
    assert r["bad_regex"][0] == 400 and "compile" in r["bad_regex"][2]
    assert r["two"][:2] == (400, "guided_regex")
    assert "structured_outputs and guided_regex" in r["two"][2]
    assert r["bias"][0] == 400 and r["bias_id"][0] == 400
    assert r["tool_choice"][0] == 400 and r["part"][:2] == (400, "messages.0.content")
    assert r["strict_auto"][0] == 400 and "strict" in r["strict_auto"][2]
    assert r["parallel_no_tools"][0] == 400 and r["stream_options"][0] == 400
    assert r["min_tokens"][0] == 400 and "min_tokens" in r["min_tokens"][2]
    assert r["after"] == 200


def test_forced_tool_calls_validate_and_stream_like_the_whole(real):
    async def test(http, oai):
        out = {}
        r = await oai.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS,
                                              tool_choice="required", max_tokens=120, seed=7)
        out["required"], full = r.choices[0], r.usage.completion_tokens
        named = {"type": "function", "function": {"name": "get_weather"}}
        greedy = dict(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice=named,
                      max_tokens=80, temperature=0)
        r = await oai.chat.completions.create(**greedy)
        out["named"] = r.choices[0]
        calls: dict[int, dict] = {}
        finish = None
        async for chunk in await oai.chat.completions.create(stream=True, **greedy):
            for c in chunk.choices:
                finish = c.finish_reason or finish
                for d in c.delta.tool_calls or []:
                    call = calls.setdefault(d.index, {"id": None, "name": None, "args": ""})
                    call["id"] = call["id"] or d.id
                    call["name"] = call["name"] or (d.function and d.function.name)
                    call["args"] += (d.function and d.function.arguments) or ""
        out["streamed"], out["stream_finish"] = calls, finish
        r = await oai.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS,
                                              tool_choice="required", max_tokens=120, seed=7,
                                              parallel_tool_calls=False)
        out["single"] = r.choices[0]
        # the same sampled reply cut short by max_tokens at every few tokens
        cut = dict(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="required", seed=7)
        out["cuts"] = [(await oai.chat.completions.create(max_tokens=m, **cut)).choices[0]
                       for m in range(2, full, 2)]
        args, out["cut_stream_finish"] = [], None
        async for chunk in await oai.chat.completions.create(max_tokens=full - 2, stream=True,
                                                             **cut):
            for c in chunk.choices:
                out["cut_stream_finish"] = c.finish_reason or out["cut_stream_finish"]
                args += [d.function.arguments for d in c.delta.tool_calls or []]
        out["cut_stream_args"] = args
        return out

    out = serve(real, test)
    required = out["required"]
    assert required.finish_reason == "tool_calls" and required.message.tool_calls
    by_name = {t["function"]["name"]: t for t in TOOLS}
    for call in required.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments),
                            _params(by_name[call.function.name]))
    assert len(out["single"].message.tool_calls) == 1
    named = out["named"]
    assert named.message.content is None and len(named.message.tool_calls) == 1
    call = named.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), _params(WEATHER))
    streamed = out["streamed"]
    assert list(streamed) == [0] and streamed[0]["name"] == "get_weather"
    assert streamed[0]["args"] == call.function.arguments and streamed[0]["id"]
    assert out["stream_finish"] == named.finish_reason == "tool_calls"
    # cut short by max_tokens: finish_reason says so, no call carries broken JSON, and
    # the calls are those completed before the cut
    whole = [(c.function.name, c.function.arguments) for c in required.message.tool_calls]
    for choice in out["cuts"]:
        assert choice.finish_reason == "length"
        calls = [(c.function.name, c.function.arguments)
                 for c in choice.message.tool_calls or []]
        assert calls == whole[:len(calls)]
    assert out["cut_stream_finish"] == "length"
    assert all(isinstance(json.loads(a), dict) for a in out["cut_stream_args"])


def test_auto_tool_calls_are_parsed_and_a_tool_result_conversation_runs(real):
    """tool_choice auto reads the model's Hermes-style calls; the random model is steered
    to emit one with a constraint, which is what the parser has to find."""
    reply = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
             '"unit": "C"}}\n</tool_call>')

    async def test(http, oai):
        out = {}
        r = await oai.chat.completions.create(
            model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=200,
            extra_body={"structured_outputs": {"choice": [reply]}})
        out["auto"] = r.choices[0]
        deltas = []
        async for chunk in await oai.chat.completions.create(
                model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=200, stream=True,
                extra_body={"structured_outputs": {"choice": [reply]}}):
            deltas += [c.delta for c in chunk.choices]
        out["stream"] = deltas
        history = MSGS + [
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
        r = await oai.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                              max_tokens=8, temperature=0)
        out["followup"] = r
        r = await http.post("/tokenize", json={"messages": history})
        out["prompt"] = r.json()["tokens"]
        two = reply + "\n" + reply.replace("Paris", "Rome")
        r = await oai.chat.completions.create(
            model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=250,
            extra_body={"structured_outputs": {"choice": [two]}})
        out["two"] = r.choices[0]
        r = await oai.chat.completions.create(
            model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=250, parallel_tool_calls=False,
            extra_body={"structured_outputs": {"choice": [two]}})
        out["one"] = r.choices[0]
        r = await oai.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS,
                                              tool_choice="none", max_tokens=8,
                                              extra_body={"structured_outputs": {
                                                  "choice": [reply]}})
        out["none"] = r.choices[0]
        return out

    out = serve(real, test)
    auto = out["auto"]
    assert auto.finish_reason == "tool_calls" and auto.message.content is None
    (call,) = auto.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "C"}
    streamed = [d for d in out["stream"] if d.tool_calls]
    assert streamed[0].tool_calls[0].function.name == "get_weather"
    assert "".join(d.tool_calls[0].function.arguments for d in streamed) == \
        call.function.arguments
    assert not any(d.content for d in out["stream"])
    assert [json.loads(c.function.arguments)["city"] for c in out["two"].message.tool_calls] \
        == ["Paris", "Rome"]
    assert [json.loads(c.function.arguments)["city"] for c in out["one"].message.tool_calls] \
        == ["Paris"]
    assert out["followup"].choices[0].message.content is not None
    assert out["none"].message.tool_calls is None and "<tool_call>" in out["none"].message.content


def test_prompt_renders_tools_and_tool_results(tiny_llama):
    """A template without a tools section gets the default tool prompt; earlier calls and
    results are in the text; a template with one gets tools= instead."""
    from deployments.apis.common.tools import plan_tools, render_chat_prompt
    from deployments.apis.openai.routes import chat_input
    from deployments.apis.openai.protocol import ChatCompletionRequest
    from engine.frontend.processor import Processor
    from engine.model.loader import load_tokenizer
    processor = Processor(load_tokenizer(tiny_llama), 512, 49152)
    history = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    body = ChatCompletionRequest(messages=history, tools=TOOLS)
    text = render_chat_prompt(processor, body.conversation(), plan_tools(chat_input(body).tools, "auto", None, "hermes"),
                              None, True, {})
    assert "<tools>" in text and '"get_time"' in text
    assert '<tool_call>\n{"name": "get_weather"' in text and "18 degrees" in text
    own = ("{% for t in tools %}TOOL {{ t.function.name }};{% endfor %}"
           "{% for m in messages %}[{{ m.role }}] {{ m.content }}"
           "{% for c in m.tool_calls or [] %}CALL {{ c.function.arguments.city }}"
           "{% endfor %}{% endfor %}")
    text = render_chat_prompt(processor, body.conversation(), plan_tools(chat_input(body).tools, "auto", None, "hermes"),
                              own, True, {})
    assert text.startswith("TOOL get_weather;TOOL get_time;") and "<tools>" not in text
    assert "CALL Paris" in text  # arguments reach the template as an object, not text


def test_concurrent_mixed_batch_keeps_unconstrained_tokens(real):
    """16 concurrent requests, half with a schema: the others' greedy text is the text
    they get alone."""
    import asyncio

    async def test(http, oai):
        async def plain(i):
            r = await oai.completions.create(model=MODEL, prompt=f"Item {i}:", max_tokens=10,
                                             temperature=0, extra_body={"ignore_eos": True})
            return r.choices[0].text

        async def constrained(i):
            r = await oai.completions.create(
                model=MODEL, prompt=f"Item {i}:", max_tokens=100, seed=i,
                extra_body={"structured_outputs": {"json": FLAGS}})
            return r.choices[0].text
        alone = [await plain(i) for i in range(8)]
        mixed = await asyncio.gather(*[plain(i) for i in range(8)],
                                     *[constrained(i) for i in range(8)])
        return alone, mixed

    alone, mixed = serve(real, test)
    assert mixed[:8] == alone
    for text in mixed[8:]:
        jsonschema.validate(json.loads(text), FLAGS)
