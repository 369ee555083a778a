"""Each request value is checked once at the frontend and once at the engine (issue 63,
point 5).

SamplingParams.__post_init__ is the one definition of a valid value: the HTTP APIs
only document those ranges (deployments/apis/common/sampling.py documented_range), and
a value out of one is still a 400 naming the field, in each API's error shape, before
any stream starts. The frontend Processor checks the request limits once. The engine
refuses again what reaches its socket: msgspec runs __post_init__ when it decodes a
request, and EngineCore.add_request runs check_params with the engine's own limits.
"""
from __future__ import annotations

import asyncio

import httpx
import msgspec
import pytest

from deployments.apis.anthropic.protocol import MessagesRequest
from deployments.apis.openai.protocol import ChatCompletionRequest, CompletionRequest
from deployments.apis.responses.protocol import ResponsesRequest
from deployments.apis.server import IngressOptions, build_api_app
from engine.config import EngineConfig
from engine.core_messages import EngineCoreRequest
from engine.errors import InvalidRequestError
from engine.frontend.processor import Processor
from engine.request_checks import check_params
from engine.request_limits import RequestLimits
from engine.sampling_params import SamplingParams
from tests.app_server import MODEL, check_openai_error
from tests.test_openai_app import engines, tokenizer  # noqa: F401 - fixtures

CHAT = [{"role": "user", "content": "Hi"}]
ANTHROPIC = "/v1/messages"

# (path, body fields, the field a 400 names): values only SamplingParams checks
OUT_OF_RANGE = [
    ("/v1/completions", {"top_p": 0}, "top_p"),
    ("/v1/completions", {"min_p": 2}, "min_p"),
    ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -2.5}, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"temperature": -0.5}, "temperature"),
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    # echo + logprobs make the engine compute prompt logprobs: a bad one is not hidden
    ("/v1/completions", {"echo": True, "logprobs": 2, "prompt_logprobs": -1},
     "prompt_logprobs"),
    ("/v1/completions", {"top_p": 0, "stream": True}, "top_p"),
    ("/v1/chat/completions", {"min_p": 2}, "min_p"),
    ("/v1/chat/completions", {"presence_penalty": 3, "stream": True}, "presence_penalty"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/responses", {"top_p": 0}, "top_p"),
    ("/v1/responses", {"temperature": -1}, "temperature"),
    ("/v1/responses", {"top_p": 1.5, "stream": True}, "top_p"),
    (ANTHROPIC, {"top_p": 0}, "top_p"),
    (ANTHROPIC, {"temperature": -0.1}, "temperature"),
    (ANTHROPIC, {"top_p": 2, "stream": True}, "top_p"),
]


def _body(path: str, fields: dict) -> dict:
    base = {"model": MODEL, "max_tokens": 4}
    if path == "/v1/completions":
        base["prompt"] = "Hi"
    elif path == "/v1/responses":
        base = {"model": MODEL, "max_output_tokens": 4, "input": "Hi"}
    else:
        base["messages"] = CHAT
    return {**base, **fields}


def _serve(engines, test):  # noqa: F811
    """Run `test(http)` against the app (in process, ASGI) over the mock engines."""
    async def main():
        client = await engines.client()

        async def get_client():
            return client
        app = build_api_app(get_client, IngressOptions(MODEL))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://flotilla") as http:
            try:
                return await test(http)
            finally:
                await client.shutdown()
    return asyncio.run(main())


def test_out_of_range_values_are_a_400_naming_the_field_on_every_api(engines):  # noqa: F811
    engines.add(itl_s=0.001)

    async def test(http):
        answers = []
        for path, fields, _ in OUT_OF_RANGE:
            r = await http.post(path, json=_body(path, fields))
            answers.append((r.status_code, r.headers.get("content-type", ""), r.json()))
        after = await http.post("/v1/completions", json=_body(
            "/v1/completions", {"ignore_eos": True}))
        return answers, after.status_code, after.json()

    answers, status, after = _serve(engines, test)
    for (path, fields, param), (code, kind, body) in zip(OUT_OF_RANGE, answers):
        where = f"{path} {fields}"
        assert code == 400 and kind.startswith("application/json"), (where, code, body)
        if path == ANTHROPIC:  # Anthropic's shape has no param: the message names it
            assert body["type"] == "error", (where, body)
            assert body["error"]["type"] == "invalid_request_error", (where, body)
            assert body["error"]["message"].startswith(param), (where, body)
        else:
            check_openai_error(400, body, where)
            assert body["error"]["param"] == param, (where, body)
            assert body["error"]["type"] == "BadRequestError", (where, body)
    assert status == 200 and after["usage"]["completion_tokens"] == 4  # still serving


def test_openapi_still_documents_the_ranges(engines):  # noqa: F811
    engines.add()

    async def test(http):
        return (await http.get("/openapi.json")).json()["components"]["schemas"]

    schemas = _serve(engines, test)
    for model in ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest",
                  "MessagesRequest"):
        number = schemas[model]["properties"]["top_p"]["anyOf"][0]
        assert (number["exclusiveMinimum"], number["maximum"]) == (0.0, 1.0), model
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["temperature"]["anyOf"][0] == {"type": "number", "minimum": 0.0,
                                               "maximum": 2.0}
    assert chat["presence_penalty"]["anyOf"][0]["minimum"] == -2.0
    assert (chat["n"]["minimum"], chat["n"]["maximum"]) == (1, 128)
    assert chat["prompt_logprobs"]["anyOf"][0]["maximum"] == 20
    assert schemas["MessagesRequest"]["properties"]["temperature"]["anyOf"][0][
        "maximum"] == 1.0


def _documented_bounds():
    """(model, field, SamplingParams field, bound kind, bound) for every documented_range."""
    out = []
    for model in (CompletionRequest, ChatCompletionRequest, ResponsesRequest,
                  MessagesRequest):
        engine_names = {api: ours for ours, api in
                        getattr(model, "ENGINE_NAMES", {}).items()}
        for name, info in model.model_fields.items():
            for kind, bound in getattr(info.json_schema_extra, "bounds", {}).items():
                out.append((model.__name__, name, engine_names.get(name, name), kind, bound))
    return out


@pytest.mark.parametrize("model,field,engine_field,kind,bound", _documented_bounds())
def test_documented_bounds_are_what_sampling_params_checks(model, field, engine_field,
                                                           kind, bound):
    """The documentation cannot drift from the rule: just inside a documented bound is
    accepted, just outside refused, naming the field."""
    step = 1 if isinstance(bound, int) else 1e-3
    inside, outside = {"minimum": (bound, bound - step),
                       "exclusiveMinimum": (bound + step, bound),
                       "maximum": (bound, bound + step)}[kind]
    SamplingParams(**{engine_field: inside})
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(**{engine_field: outside})
    assert refused.value.param == engine_field


def _wire(params: dict) -> bytes:
    """An ADD payload whose sampling params are `params`, as any client could send it."""
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(
        EngineCoreRequest("r-1", [1, 2, 3], SamplingParams())))
    raw[2] = params
    return msgspec.msgpack.encode(raw)


@pytest.mark.parametrize("params,param", [({"top_p": 0.0}, "top_p"),
                                          ({"min_p": 2.0}, "min_p"),
                                          ({"prompt_logprobs": 21}, "prompt_logprobs"),
                                          ({"presence_penalty": 3.0}, "presence_penalty")])
def test_the_engine_decoder_refuses_bad_params(params, param):
    """The engine's io thread decodes ADD payloads so (engine/wire/server_io.py): msgspec
    runs __post_init__ and wraps its InvalidRequestError in a ValidationError, which
    the engine answers with an error output for that request."""
    with pytest.raises(msgspec.ValidationError) as refused:
        msgspec.msgpack.decode(_wire(params), type=EngineCoreRequest)
    assert isinstance(refused.value.__cause__, InvalidRequestError)
    assert refused.value.__cause__.param == param
    ok = msgspec.msgpack.decode(_wire({"top_p": 0.5}), type=EngineCoreRequest)
    assert ok.sampling_params.top_p == 0.5


def test_check_params_refuses_past_the_engines_max_logprobs():
    limits = RequestLimits.defaults()
    with pytest.raises(InvalidRequestError, match="logprobs must be <= 5"):
        check_params(SamplingParams(logprobs=10), 5, 100, limits)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs must be <= 5"):
        check_params(SamplingParams(prompt_logprobs=6), 5, 100, limits)
    with pytest.raises(InvalidRequestError, match="max_stop_strings"):  # limits too
        check_params(SamplingParams(stop=["x"] * (limits.max_stop_strings + 1)), 20, 100,
                     limits)
    check_params(SamplingParams(logprobs=5, prompt_logprobs=5), 5, 100, limits)


def test_an_engine_refuses_logprobs_past_its_max_logprobs(tiny_llama):
    """EngineCore.add_request: the engine's own check, whatever the frontend did."""
    from engine.core.engine_core import EngineCore
    core = EngineCore(EngineConfig(model=str(tiny_llama), dtype="float32", device="cpu",
                                   max_logprobs=5, max_num_seqs=1, log_stats_interval_s=0))
    try:
        with pytest.raises(InvalidRequestError, match="logprobs must be <= 5"):
            core.add_request(EngineCoreRequest("r", [1, 2, 3], SamplingParams(logprobs=6)))
        core.add_request(EngineCoreRequest("ok", [1, 2, 3], SamplingParams(logprobs=5)))
    finally:
        core.shutdown()


def test_the_frontend_checks_the_limits_once(tokenizer, monkeypatch):  # noqa: F811
    """Processor.make_requests: check_limits before tokenizing the bad words, their
    token sequences after, and check_params without the limits."""
    import engine.frontend.processor as processor_module
    import engine.request_checks as checks_module
    calls = []

    def counted(name, real):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        return wrapper
    for module in (processor_module, checks_module):
        monkeypatch.setattr(module, "check_limits",
                            counted("check_limits", module.check_limits))
    monkeypatch.setattr(processor_module, "check_bad_word_tokens", counted(
        "check_bad_word_tokens", processor_module.check_bad_word_tokens))
    tight = RequestLimits(**{**msgspec.structs.asdict(RequestLimits.defaults()),
                             "max_bad_words": 1})
    processor = Processor(tokenizer, max_model_len=64, vocab_size=len(tokenizer),
                          limits=tight)
    requests = processor.make_requests("r", [1, 2, 3], SamplingParams(bad_words=["hello"]))
    assert calls == ["check_limits", "check_bad_word_tokens"]
    assert requests[0].sampling_params.bad_words_token_ids
    calls.clear()
    with pytest.raises(InvalidRequestError, match="max_bad_words"):
        processor.make_requests("r", [1, 2, 3], SamplingParams(bad_words=["a", "b"]))
    assert calls == ["check_limits"]  # refused before tokenizing
