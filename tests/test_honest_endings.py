"""A generation its engine cut short (sleep, a drain for a downscale, a reset of running
requests) ends as an error, never as a 200 with finish_reason "abort", which no OpenAI
client knows (issue 40, finding 7): 503 when not streamed, an error event once streaming;
the server keeps serving after."""
from __future__ import annotations

import asyncio
import json

import pytest

from engine.errors import RequestAbortedError
from engine.sampling_params import SamplingParams
from tests.test_openai_app import MODEL, engines, serve, tokenizer  # noqa: F401 - fixtures


def test_engine_aborts_reach_the_client_as_errors(engines):  # noqa: F811
    engines.add(itl_s=0.02)

    async def test(http, oai):
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 200, "ignore_eos": True}

        async def streamed():
            events = []
            async with http.stream("POST", "/v1/completions",
                                   json={**body, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
            return r.status_code, events

        plain = asyncio.ensure_future(http.post("/v1/completions", json=body))
        stream = asyncio.ensure_future(streamed())
        await asyncio.sleep(0.5)  # both are generating
        assert (await http.post("/sleep?level=1")).status_code == 200
        answers = await plain, await stream
        await http.post("/wake_up")
        after = await http.post("/v1/completions", json={**body, "max_tokens": 3})
        return answers, after

    (plain, (status, events)), after = serve(engines, test, dev_mode=True)
    assert plain.status_code == 503
    assert plain.json()["error"]["type"] == "ServiceUnavailableError"
    assert "stopped by its engine" in plain.json()["error"]["message"]
    assert status == 200 and events[0]["choices"]  # tokens came before the cut
    assert "error" in events[-1] and events[-1]["error"]["code"] == 503
    assert all(c.get("finish_reason") != "abort" for e in events for c in e.get("choices", []))
    assert after.status_code == 200 and after.json()["choices"][0]["finish_reason"] == "length"


def test_the_client_raises_a_typed_error_for_an_engine_abort(engines):  # noqa: F811
    engines.add(itl_s=0.02)

    async def main():
        client = await engines.client()
        try:
            stream = client.generate("r", "Hello", SamplingParams(max_tokens=200,
                                                                  ignore_eos=True))
            await stream.__anext__()
            await client.call_utility("sleep", 1)
            with pytest.raises(RequestAbortedError):
                async for _ in stream:
                    pass
        finally:
            await client.shutdown()
    asyncio.run(main())
