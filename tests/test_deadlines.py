"""Request deadlines and priority over HTTP: a request past its timeout is aborted at its
engine (nothing left running, KV free) and answered with 408 and the usage so far (a
final error event when streaming); a priority the engines cannot honour is a 400."""
import asyncio
import json
import time

import pytest

from engine.wire.core_client import EngineClient
from tests.test_openai_app import MODEL, engines, serve, tokenizer  # noqa: F401 - fixtures

SLOW = {"max_tokens": 200, "ignore_eos": True}  # 200 tokens at 20 ms: about 4 s


async def _engine_idle(core, timeout: float = 5.0) -> bool:
    """The mock engine has nothing running or waiting and holds no KV blocks."""
    stop = time.monotonic() + timeout
    while time.monotonic() < stop:
        stats = core.get_stats()
        if stats.num_running_reqs == stats.num_waiting_reqs == 0 and stats.kv_cache_usage == 0:
            return True
        await asyncio.sleep(0.02)
    return False


def _clients(holder: list):
    """Keep the app's EngineClient, to read its abort causes after the request."""
    original = EngineClient.connect

    async def connect(*args, **kwargs):
        client = await original(*args, **kwargs)
        holder.append(client)
        return client
    return connect


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_request_past_its_timeout_gets_408_with_partial_usage(engines, endpoint,  # noqa: F811
                                                                 monkeypatch):
    core = engines.add(itl_s=0.02)
    clients: list = []
    monkeypatch.setattr(EngineClient, "connect", _clients(clients))

    async def test(http, oai):
        if endpoint == "completions":
            body = {"model": MODEL, "prompt": "Hello there", "timeout": 0.3, **SLOW}
        else:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                    "timeout": 0.3, **SLOW}
        path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
        started = time.monotonic()
        response = await http.post(path, json=body)
        elapsed = time.monotonic() - started
        return response, elapsed, await _engine_idle(core)

    response, elapsed, idle = serve(engines, test)
    assert response.status_code == 408, response.text
    body = response.json()
    assert body["error"]["type"] == "TimeoutError" and body["error"]["code"] == 408
    usage = body["usage"]
    # answered at the deadline: fewer than the 200 tokens asked for
    assert 0 < usage["completion_tokens"] < 200 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert idle  # aborted at the engine: nothing runs, no KV held
    assert clients[0].abort_causes["deadline"] == 1


def test_a_streamed_request_past_its_timeout_ends_with_an_error_event(engines):  # noqa: F811
    core = engines.add(itl_s=0.02)

    async def test(http, oai):
        events = []
        async with http.stream("POST", "/v1/completions", json={
                "model": MODEL, "prompt": "Hello", "stream": True, "timeout": 0.3,
                **SLOW}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
        return response.status_code, events, await _engine_idle(core)

    status, events, idle = serve(engines, test)
    assert status == 200
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["error"]["code"] == 408 and last["error"]["type"] == "TimeoutError"
    chunks = [json.loads(e) for e in events[:-2]]
    streamed = sum(1 for c in chunks if c["choices"] and c["choices"][0]["text"])
    assert 0 < last["usage"]["completion_tokens"] < 200
    assert last["usage"]["completion_tokens"] >= streamed > 0
    assert idle


def test_the_server_default_applies_and_a_request_may_name_its_own(engines):  # noqa: F811
    core = engines.add(itl_s=0.02)

    async def test(http, oai):
        body = {"model": MODEL, "prompt": "Hello", **SLOW, "max_tokens": 30}
        by_default = await http.post("/v1/completions", json=body)  # 30 x 20 ms > 0.2 s
        longer = await http.post("/v1/completions", json={**body, "timeout": 30})
        return by_default, longer, await _engine_idle(core)

    by_default, longer, idle = serve(engines, test, request_timeout_s=0.2)
    assert by_default.status_code == 408
    assert longer.status_code == 200 and longer.json()["usage"]["completion_tokens"] == 30
    assert idle


def test_a_timeout_before_the_first_token_reports_the_prompt(engines):  # noqa: F811
    core = engines.add(ttft_s=2.0)

    async def test(http, oai):
        streamed = await http.post("/v1/completions", json={
            "model": MODEL, "prompt": [5, 6, 7, 8], "stream": True, "timeout": 0.2})
        chat = await http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
            "timeout": 0.2})
        return streamed, chat, await _engine_idle(core)

    streamed, chat, idle = serve(engines, test)
    assert streamed.status_code == 408  # nothing was sent yet: a plain HTTP error
    assert streamed.json()["usage"] == {"prompt_tokens": 4, "completion_tokens": 0,
                                        "total_tokens": 4}
    assert chat.status_code == 408 and chat.json()["usage"]["completion_tokens"] == 0
    assert idle


def test_bad_timeout_and_priority_values_are_400(engines):  # noqa: F811
    engines.add()

    async def test(http, oai):
        out = []
        for extra in ({"timeout": 0}, {"timeout": -1}, {"timeout": "soon"},
                      {"priority": 1.5}, {"priority": 1 << 40}):
            out.append(await http.post("/v1/completions", json={
                "model": MODEL, "prompt": "Hi", "max_tokens": 2, **extra}))
        # the mock engine schedules first come first served: a priority is refused
        out.append(await http.post("/v1/completions", json={
            "model": MODEL, "prompt": "Hi", "max_tokens": 2, "priority": 3}))
        out.append(await http.post("/v1/completions", json={
            "model": MODEL, "prompt": "Hi", "max_tokens": 2, "priority": 0}))
        return out

    *bad, refused, fine = serve(engines, test)
    for response in bad:
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] in ("timeout", "priority")
    assert refused.status_code == 400
    assert "scheduling_policy 'priority'" in refused.json()["error"]["message"]
    assert fine.status_code == 200


def test_a_deadline_frees_the_real_engines_kv(tiny_llama):
    """On the real engine (tiny model): a streamed request cut by its deadline leaves no
    request and no KV block held; the engine serves the next request in full."""
    from engine.config import EngineConfig
    from engine.core.engine_core import EngineCore
    from engine.model.loader import load_tokenizer
    from engine.wire.core_server import EngineCoreServer
    from tests.test_core_client import free_address
    core = EngineCore(EngineConfig(model=str(tiny_llama), dtype="float32"))
    address = free_address()
    server = EngineCoreServer(core, address).start()

    class Real:
        async def client(self):
            return await EngineClient.connect([address], load_tokenizer(tiny_llama),
                                              handshake_timeout_s=10)

    async def test(http, oai):
        events, status = [], None
        async with http.stream("POST", "/v1/completions", json={
                "model": MODEL, "prompt": "Once upon a time", "stream": True,
                "timeout": 0.2, "max_tokens": 480, "ignore_eos": True}) as response:
            status = response.status_code
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
        stop = time.monotonic() + 5
        while time.monotonic() < stop and (core.requests or core.kv.usage > 0):
            await asyncio.sleep(0.02)
        held = (len(core.requests), core.kv.usage)
        after = await http.post("/v1/completions", json={
            "model": MODEL, "prompt": "Hi", "max_tokens": 5, "ignore_eos": True})
        return status, events, held, after

    try:
        status, events, held, after = serve(Real(), test)
    finally:
        server.shutdown()
    if status == 200:  # tokens came first: the stream ends with the error event
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == 408
    else:  # the deadline came before the first token
        assert status == 408
    assert held == (0, 0.0)
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 5


def test_requests_have_a_deadline_by_default():
    """A wedged engine cannot hold a request for ever: the served app's default deadline
    is 10 minutes (issue 40, finding 5); none only when asked for."""
    from deployments.config import AppArgs
    from deployments.apis.server import IngressOptions
    assert AppArgs().request_timeout_s == 600.0
    assert IngressOptions("m").request_timeout_s == 600.0
    assert AppArgs(request_timeout_s=None).request_timeout_s is None


def test_a_timeout_past_the_ceiling_or_not_finite_is_400(engines):  # noqa: F811
    """`timeout` is a deadline a client may shorten or lengthen up to the server's
    max_request_timeout_s, never switch off: 1e300 and Infinity were accepted."""
    engines.add()

    async def test(http, oai):
        out = []
        for path, body in (("/v1/completions", {"prompt": "Hi"}),
                           ("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "Hi"}]}),
                           ("/v1/responses", {"input": "Hi"})):
            tokens = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
            for timeout in (1e300, "Infinity", 30.5, 30):
                out.append((path, timeout, await http.post(path, json={
                    "model": MODEL, tokens: 2, "timeout": timeout, **body})))
        return out

    for path, timeout, response in serve(engines, test, max_request_timeout_s=30.0):
        if timeout == 30:
            assert response.status_code == 200, (path, response.text)
            continue
        assert response.status_code == 400, (path, timeout, response.text)
        error = response.json()["error"]
        assert error["param"] == "timeout" and "max_request_timeout_s" in error["message"]


def test_the_timeout_ceiling_is_an_option_above_the_default_deadline():
    from pydantic import ValidationError

    from deployments.apis.server import IngressOptions
    from deployments.config import AppArgs
    assert AppArgs().max_request_timeout_s == IngressOptions("m").max_request_timeout_s == 600
    assert AppArgs(max_request_timeout_s=3600).max_request_timeout_s == 3600
    for bad in ({"request_timeout_s": 900}, {"max_request_timeout_s": float("inf")},
                {"max_request_timeout_s": 0}):
        with pytest.raises(ValidationError):
            AppArgs(**bad)


def test_a_request_id_longer_than_256_characters_is_400(engines):  # noqa: F811
    """A client's x-request-id becomes part of engine request ids: an 8,000-character one
    was a 500. 256 characters are taken and echoed; past that, a 400 naming the header
    under a fresh id, and the server goes on serving."""
    engines.add()

    async def test(http, oai):
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
        long = await http.post("/v1/completions", json=body, headers={"x-request-id": "r" * 8000})
        fits = await http.post("/v1/completions", json=body, headers={"x-request-id": "s" * 256})
        return long, fits

    long, fits = serve(engines, test)
    assert long.status_code == 400, long.text
    assert long.json()["error"]["param"] == "x-request-id"
    assert 0 < len(long.headers["x-request-id"]) <= 256
    assert fits.status_code == 200 and fits.headers["x-request-id"] == "s" * 256
