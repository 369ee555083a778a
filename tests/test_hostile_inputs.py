"""Inputs a schema-driven fuzzer does not reach on its own, over real HTTP (uvicorn, two
mock engines): each gets a clear answer (served, or a 4xx in OpenAI's error shape),
never a 5xx or a hang, and the server keeps serving after all of them."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.app_server import MODEL, check_openai_error, serve_app_over_mocks

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def http(tokenizer):
    with serve_app_over_mocks(tokenizer, engines=2) as server, \
            httpx.Client(base_url=server.url, timeout=60) as client:
        yield client
        # after every case of the module: still serving
        ok = client.post(COMPLETIONS, json={"model": MODEL, "prompt": "still there?",
                                            "max_tokens": 3, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def _refused(r: httpx.Response, *statuses: int) -> dict:
    assert r.status_code in statuses, (r.status_code, r.text[:500])
    body = r.json()
    check_openai_error(r.status_code, body)
    return body["error"]


def _completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 4, **fields}


@pytest.mark.parametrize("n", [129, 10**6, 2**63, -1, 0])
def test_huge_or_bad_n_is_refused(http, n):
    assert _refused(http.post(COMPLETIONS, json=_completion(n=n)), 400)["param"] == "n"


@pytest.mark.parametrize("max_tokens", [2**64, 2**200, -5, 0])
def test_out_of_range_max_tokens_is_refused(http, max_tokens):
    assert _refused(http.post(COMPLETIONS, json=_completion(max_tokens=max_tokens)),
                    400)["param"] == "max_tokens"


@pytest.mark.parametrize("path,fields", [
    (COMPLETIONS, {"seed": 2**64}), (COMPLETIONS, {"top_k": -(2**70)}),
    (COMPLETIONS, {"prompt": [1, 2**64]}), (COMPLETIONS, {"stop_token_ids": [2**65]}),
    (COMPLETIONS, {"logit_bias": {str(2**64): 1.0}}), (COMPLETIONS, {"min_tokens": 2**64}),
    (COMPLETIONS, {"allowed_token_ids": [2**80]}), ("/detokenize", {"tokens": [2**64]}),
    ("/v1/embeddings", {"input": [[2**64]]}),
])
def test_integers_past_64_bits_are_refused_anywhere(http, path, fields):
    body = {"model": MODEL, **({"prompt": "Hi"} if path == COMPLETIONS else {}), **fields}
    _refused(http.post(path, json=body), 400)


@pytest.mark.parametrize("max_tokens", [10**7, 2**63 - 1])
def test_huge_max_tokens_ends_at_the_context_length(http, max_tokens):
    """As vLLM: max_tokens past the context is what the context leaves (the mock's
    context is 4,096 tokens), finish_reason "length"."""
    r = http.post(COMPLETIONS, json=_completion(prompt=[7, 8], max_tokens=max_tokens,
                                                ignore_eos=True))
    assert r.status_code == 200, r.text
    assert (r.json()["usage"]["completion_tokens"], r.json()["choices"][0]["finish_reason"]) == \
        (4094, "length"), r.text[-300:]


@pytest.mark.parametrize("depth", [64, 100_000])
def test_deeply_nested_messages_are_refused(http, depth):
    content = "[" * depth + "]" * depth
    raw = ('{"model": "%s", "messages": [{"role": "user", "content": %s}]}' % (MODEL, content))
    _refused(http.post(CHAT, content=raw, headers={"content-type": "application/json"}), 400)


def test_a_10_mb_body_is_refused_before_it_is_parsed(http):
    big = json.dumps(_completion(prompt="x" * (10 << 20)))
    _refused(http.post(COMPLETIONS, content=big, headers={"content-type": "application/json"}),
             413)


def test_a_10_mb_body_without_a_length_is_refused_too(http):
    def chunks():  # chunked transfer: no content-length to check up front
        yield b'{"model": "mock-model", "prompt": "'
        for _ in range(10):
            yield b"x" * (1 << 20)
        yield b'"}'
    _refused(http.post(COMPLETIONS, content=chunks(),
                       headers={"content-type": "application/json"}), 413)


@pytest.mark.parametrize("raw", [
    b'{"model": "mock-model", "prompt": "\xff\xfe bad", "max_tokens": 2}',
    b'{"model": "mock-model", "messages": [{"role": "user", "content": "\xc3\x28"}]}',
    b"\x80\x81\x82",
])
def test_invalid_utf8_is_refused(http, raw):
    path = CHAT if b"messages" in raw else COMPLETIONS
    _refused(http.post(path, content=raw, headers={"content-type": "application/json"}), 400)


def test_a_prompt_of_only_special_tokens_is_served(http, tokenizer):
    special = "".join(tokenizer.all_special_tokens) * 3
    r = http.post(COMPLETIONS, json=_completion(prompt=special, ignore_eos=True))
    assert r.status_code == 200, r.text
    ids = sorted(set(tokenizer.all_special_ids))
    r = http.post(COMPLETIONS, json=_completion(prompt=ids, ignore_eos=True))
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids)
    r = http.post(CHAT, json={"model": MODEL, "max_tokens": 3, "ignore_eos": True,
                              "messages": [{"role": "user", "content": special}]})
    assert r.status_code == 200, r.text


def test_a_stop_list_of_1000_strings_gets_a_clear_answer(http):
    stops = [f"stop-{i}-" for i in range(1000)]
    r = http.post(COMPLETIONS, json=_completion(stop=stops, max_tokens=8, ignore_eos=True))
    if r.status_code == 200:
        assert r.json()["usage"]["completion_tokens"] <= 8
    else:
        assert "stop" in _refused(r, 400)["message"]


@pytest.mark.parametrize("field,value", [
    ("temperature", "NaN"), ("temperature", "Infinity"), ("temperature", "-1"),
    ("top_p", "NaN"), ("top_p", "-Infinity"), ("presence_penalty", "NaN"),
    ("frequency_penalty", "1e400"), ("max_tokens", "NaN"), ("max_tokens", "-1"),
    ("seed", "1e30"), ("n", "Infinity"), ("logprobs", "-3"), ("top_k", "NaN"),
    ("min_p", "Infinity"), ("repetition_penalty", "-Infinity"),
])
def test_negative_nan_and_infinite_numbers_are_refused(http, field, value):
    raw = '{"model": "%s", "prompt": "Hi", "max_tokens": 4, "%s": %s}' % (MODEL, field, value)
    raw = raw.replace('"max_tokens": 4, "max_tokens"', '"max_tokens"')
    _refused(http.post(COMPLETIONS, content=raw, headers={"content-type": "application/json"}),
             400)


@pytest.mark.parametrize("bias", ["NaN", "Infinity", "1e999", "-1e999"])
def test_non_finite_logit_bias_is_refused(http, bias):
    raw = '{"model": "%s", "prompt": "Hi", "logit_bias": {"5": %s}}' % (MODEL, bias)
    _refused(http.post(COMPLETIONS, content=raw, headers={"content-type": "application/json"}),
             400)


def test_concurrent_requests_with_one_request_id_are_kept_apart(http):
    """Eight requests at once share an X-Request-Id: each is its own engine request,
    streams and finishes with its own tokens, and the id is echoed back."""
    def one(i: int):
        with http.stream("POST", COMPLETIONS, headers={"x-request-id": "same-id"}, json=_completion(
                prompt=f"request {i}", max_tokens=16, ignore_eos=True, stream=True,
                seed=i, stream_options={"include_usage": True})) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            return r.status_code, r.headers.get("x-request-id"), events

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    ids = set()
    for status, echoed, events in results:
        assert status == 200 and echoed == "same-id" and events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] == 16
        ids.add(chunks[0]["id"])
    assert len(ids) == 8  # distinct response ids: none answered another's stream
