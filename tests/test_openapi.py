"""/openapi.json: a valid OpenAPI 3 document of every route the app serves, whose
response models match what the app really sends (mock engines, no Ray)."""
import json

from deployments.apis.openai.schema import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    VersionResponse,
)
from tests.test_openai_app import MODEL, engines, serve, tokenizer  # noqa: F401


def _events(body: str) -> list[dict]:
    data = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_openapi_document_is_valid_and_names_every_route(engines):
    from openapi_spec_validator import validate
    engines.add()

    async def test(http, oai):
        doc = (await http.get("/openapi.json")).json()
        return doc, http._transport.app.routes  # noqa: SLF001 - the app under test

    doc, routes = serve(engines, test)
    validate(doc)
    served = {(r.path.replace(":path}", "}"), m.lower()) for r in routes
              for m in r.methods if m != "HEAD"}
    documented = {(p, m) for p, ops in doc["paths"].items() for m in ops}
    assert documented == served
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ChatCompletionRequest")
    assert "text/event-stream" in chat["responses"]["200"]["content"]
    assert chat["responses"]["400"]["content"]["application/json"]["schema"]["$ref"] \
        .endswith("/ErrorResponse")
    request_schema = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert request_schema["additionalProperties"] is False
    assert {"tools", "response_format", "structured_outputs"} <= set(
        request_schema["properties"])


def test_real_responses_match_the_documented_models(engines):
    engines.add(itl_s=0.001)

    async def test(http, oai):
        r = {}
        body = {"prompt": "Hi", "max_tokens": 4, "logprobs": 1, "ignore_eos": True}
        r["completion"] = (await http.post("/v1/completions", json=body)).json()
        r["completion_stream"] = (await http.post("/v1/completions", json={
            **body, "stream": True, "stream_options": {"include_usage": True}})).text
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "logprobs": True, "top_logprobs": 2, "ignore_eos": True}
        r["chat"] = (await http.post("/v1/chat/completions", json=chat)).json()
        r["chat_stream"] = (await http.post("/v1/chat/completions", json={
            **chat, "stream": True, "stream_options": {"include_usage": True}})).text
        r["models"] = (await http.get("/v1/models")).json()
        r["model"] = (await http.get(f"/v1/models/{MODEL}")).json()
        r["tokenize"] = (await http.post("/tokenize", json={"prompt": "Hello"})).json()
        r["detokenize"] = (await http.post("/detokenize", json={"tokens": [1, 2]})).json()
        r["version"] = (await http.get("/version")).json()
        r["error"] = (await http.post("/v1/completions", json={"prompt": "x", "bogus": 1})
                      ).json()
        return r

    r = serve(engines, test)
    CompletionResponse.model_validate(r["completion"], strict=True)
    for event in _events(r["completion_stream"]):
        CompletionResponse.model_validate(event, strict=True)
    ChatCompletionResponse.model_validate(r["chat"], strict=True)
    chunks = _events(r["chat_stream"])
    for event in chunks:
        ChatCompletionChunk.model_validate(event, strict=True)
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    ModelList.model_validate(r["models"], strict=True)
    ModelCard.model_validate(r["model"], strict=True)
    TokenizeResponse.model_validate(r["tokenize"], strict=True)
    DetokenizeResponse.model_validate(r["detokenize"], strict=True)
    VersionResponse.model_validate(r["version"], strict=True)
    assert ErrorResponse.model_validate(r["error"], strict=True).error.param == "bogus"
