"""/health is a readiness probe that never waits for the engines: 503 while they are not
connected (however long registration takes), 200 once they are, 503 again when one
dies; the connection attempt goes on in the background between probes."""
import asyncio

import httpx

from deployments.apis.server import IngressOptions, build_api_app
from engine.errors import NoEnginesError
from tests.test_openai_app import engines, tokenizer  # noqa: F401 - fixtures


def _app(get_client):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_api_app(
        get_client, IngressOptions("m"))), base_url="http://flotilla")


def test_health_answers_503_while_the_engines_register_then_200(engines):  # noqa: F811
    engines.add()

    async def main():
        registered = asyncio.Event()
        calls = []
        client = await engines.client()

        async def get_client():  # as the ingress's: waits until the engines register
            calls.append(1)
            await registered.wait()
            return client
        async with _app(get_client) as http:
            early = [await asyncio.wait_for(http.get("/health"), 5) for _ in range(3)]
            registered.set()
            await asyncio.sleep(0.05)
            ready = await asyncio.wait_for(http.get("/health"), 5)
        await client.shutdown()
        return early, ready, len(calls)

    early, ready, calls = asyncio.run(main())
    assert [r.status_code for r in early] == [503, 503, 503]
    assert early[0].json()["error"]["message"] == "the engines are not connected yet"
    assert ready.status_code == 200
    assert calls == 2  # one attempt in flight across the three early probes


def test_health_reports_a_failed_connection_and_tries_again(engines):  # noqa: F811
    engines.add()

    async def main():
        client = await engines.client(heartbeat_timeout_s=1.0)
        outcomes = [NoEnginesError("the engines did not register in time"), client]

        async def get_client():
            outcome = outcomes.pop(0) if len(outcomes) > 1 else outcomes[0]
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        async with _app(get_client) as http:
            failed = await http.get("/health")
            ok = await http.get("/health")
            engines.stop()  # the engine goes away: the client sees it dead
            for _ in range(100):
                if not client.healthy:
                    break
                await asyncio.sleep(0.1)
            dead = await http.get("/health")
        await client.shutdown()
        return failed, ok, dead

    failed, ok, dead = asyncio.run(main())
    assert failed.status_code == 503 and "did not register" in failed.json()["error"]["message"]
    assert ok.status_code == 200
    assert dead.status_code == 503, dead.text


def test_a_stopping_server_fails_health_and_refuses_new_requests_but_serves_metrics(
        engines):  # noqa: F811
    """Issue 41, item 2: once the server stops (the coordinator's stop_serving, seen by
    each ingress replica), /health answers 503 so load balancers drain the replica, and
    a new request gets 503 while the streams already running go on; /metrics stays."""
    engines.add()

    async def main():
        client = await engines.client()

        async def get_client():
            return client
        app = build_api_app(get_client, IngressOptions("m"))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://flotilla") as http:
            before = await http.get("/health")
            app.state.stopping = True
            after = await http.get("/health")
            late = await http.post("/v1/completions", json={"model": "m", "prompt": "Hi",
                                                            "max_tokens": 2})
            metrics = await http.get("/metrics")
        await client.shutdown()
        return before, after, late, metrics

    before, after, late, metrics = asyncio.run(main())
    assert before.status_code == 200
    assert after.status_code == 503 and after.json()["error"]["message"] == (
        "the server is stopping")
    assert late.status_code == 503
    assert late.json()["error"]["type"] == "ServiceUnavailableError"
    assert metrics.status_code == 200 and "vllm:num_requests_running" in metrics.text
