"""The HTTP API fuzzed: schemathesis generates requests from the app's own OpenAPI
document (/openapi.json) for every operation, valid and invalid, against the app served
by uvicorn over two mock engines (no Ray). No answer may be a 5xx, every 4xx carries
OpenAI's error object, and the server still serves a normal request afterwards.

The budget (max_examples per operation and mode) keeps the module near a minute on a 2-core
machine; FLOTILLA_FUZZ_EXAMPLES raises it for a longer hunt.
"""
from __future__ import annotations

import os
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode

from tests.app_server import check_openai_error, serve_app_over_mocks

EXAMPLES = int(os.environ.get("FLOTILLA_FUZZ_EXAMPLES", "30"))


@pytest.fixture(scope="module")
def base_url(tokenizer):
    with serve_app_over_mocks(tokenizer, engines=2) as server:
        yield server.url


def _check(case, base_url: str) -> int:
    response = case.call(base_url=base_url, timeout=30)
    where = f"{case.method} {case.formatted_path} body={str(case.body)[:300]!r}"
    assert response.status_code < 500, f"{where} -> {response.status_code}: {response.text[:500]}"
    if response.status_code >= 400:
        check_openai_error(response.status_code, response.json(), where)
    return response.status_code


def test_no_input_gets_a_5xx_and_every_4xx_is_an_openai_error(base_url):
    """Every operation of the document, positive and negative cases (schemathesis's
    pytest plugin does not load under pytest 9, so hypothesis drives each operation's
    strategy here); failures are collected per operation and reported together."""
    from hypothesis import given
    from hypothesis.errors import Unsatisfiable

    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    # the agent APIs' operations are fuzzed through Serve (tests/e2e/agent_api_checks.py)
    operations = [result.ok() for result in schema.get_all_operations()
                  if not result.ok().path.startswith(("/v1/responses", "/v1/messages"))]
    assert len(operations) >= 10, [op.label for op in operations]
    failures, statuses = {}, Counter()
    cases = [(op, mode) for op in operations for mode in GenerationMode]
    for op, mode in cases:
        @given(case=op.as_strategy(mode))
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def fuzz(case):
            statuses[_check(case, base_url) // 100] += 1
        try:
            fuzz()
        except Unsatisfiable:  # an operation without inputs has no invalid input
            assert mode == GenerationMode.NEGATIVE, op.label
        except Exception as exc:  # hypothesis re-raises the minimal failing example
            failures[f"{op.label} ({mode.value})"] = str(exc)[:2000]
    assert not failures, "\n\n".join(f"{k}:\n{v}" for k, v in failures.items())
    # both kinds were exercised: requests served and requests refused
    assert statuses[2] >= len(operations) and statuses[4] >= len(operations), statuses


def test_a_normal_request_is_served_after_the_fuzzing(base_url):
    """Runs after the fuzz cases (file order): nothing they sent broke the server."""
    r = httpx.post(f"{base_url}/v1/completions", timeout=30, json={
        "model": "mock-model", "prompt": "Hello", "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5
