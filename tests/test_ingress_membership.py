"""An ingress replica's engine set follows the coordinator (deployments/serve/ingress.py),
driven here without Ray: the replica's class over in-process mock engines and a stand-in
coordinator that answers `membership`."""
from __future__ import annotations

import asyncio

import pytest

import deployments.serve.ingress as ingress
from tests.test_openai_app import engines, tokenizer  # noqa: F401 - fixtures


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class _Coordinator:
    """membership -> (version, addresses, keys, stopping), fixed: engines in the clear."""

    def __init__(self, addresses: list[str]) -> None:
        async def membership():
            return 1, list(addresses), {}, False
        self.membership = _Remote(membership)


async def _replica(addresses: list[str]):
    """The replica's class constructed as Serve does (its __init__ is async)."""
    cls = ingress.OpenAIIngress.func_or_class.__mro__[1]  # the class under Serve's wrapper
    replica = cls.__new__(cls)
    await replica.__init__({"model": "mock"}, _Coordinator(addresses), None)
    return replica


@pytest.mark.parametrize("coordinator", ["answering", "silent"])
def test_an_engine_left_out_as_dead_is_tried_again_without_a_membership_change(
        engines, monkeypatch, coordinator):  # noqa: F811
    """After a blip the replica served from the other engines under the same membership
    version and, polling only for version changes, never used the blipped engine again
    (issue 40, finding 1). Now it tries the engines it left out every ENGINE_RETRY_S.
    It did so only after a membership answer: an engine that went quiet just before the
    coordinator stopped stayed out until the coordinator answered again (issue 62). Now
    it is tried from the last membership heard."""
    monkeypatch.setattr(ingress, "MEMBERSHIP_POLL_S", 0.05)
    monkeypatch.setattr(ingress, "ENGINE_RETRY_S", 0.2)
    monkeypatch.setattr(ingress, "COORDINATOR_CALL_TIMEOUT_S", 0.1)
    engines.add()
    engines.add()

    async def main():
        replica = await _replica(engines.addresses)
        client = await replica.get_client()
        assert [e.address for e in client.engines] == engines.addresses
        if coordinator == "silent":
            async def never():
                await asyncio.Event().wait()  # a SIGSTOPped coordinator
            replica.coordinator.membership = _Remote(never)
        client._mark_dead(client.engines[1], "silent for 10.0s (a blip)")
        narrowed = await replica.get_client()  # serves from the live engine meanwhile
        assert [e.address for e in narrowed.engines] == engines.addresses[:1]
        for _ in range(100):
            await asyncio.sleep(0.05)
            if len(replica._client.engines) == 2:
                break
        whole = replica._client
        found = [e.address for e in whole.engines], whole.healthy
        replica._follower.cancel()
        for c in {client, narrowed, whole}:
            await c.shutdown()
        return found

    addresses, healthy = asyncio.run(main())
    assert addresses == engines.addresses and healthy


def test_a_dead_engine_while_the_coordinator_is_down_leaves_the_replica_healthy(
        engines, monkeypatch):  # noqa: F811
    """The chaos run killed an engine right after the coordinator: the replica's client
    held the dead engine, the coordinator could not answer the reconnect, and the
    replica's health check failed, so Serve killed the ingress and cut its streams on
    the live engine. Now the check passes and reconnects at once to the live engines of
    the last membership the coordinator sent (issue 62, item 2: nothing waits on it)."""
    engines.add()
    engines.add()
    answering = asyncio.Event()

    async def main():
        replica = await _replica(engines.addresses)
        client = await replica.get_client()
        real = replica.coordinator.membership.remote

        async def slow_membership():
            await answering.wait()  # the coordinator restarting
            return await real()
        replica.coordinator.membership = _Remote(slow_membership)
        client._mark_dead(client.engines[1], "its process died")
        await replica.check_health()  # used to raise: "engine connection unhealthy"
        for _ in range(100):  # the coordinator still silent
            await asyncio.sleep(0.02)
            if replica._client is not client:
                break
        switched = replica._client
        answering.set()
        found = [e.address for e in switched.engines], switched.healthy
        await replica.check_health()
        if replica._follower is not None:
            replica._follower.cancel()
        for c in {client, switched}:
            await c.shutdown()
        return found

    addresses, healthy = asyncio.run(main())
    assert addresses == engines.addresses[:1] and healthy


def test_metrics_report_the_engines_of_the_replicas_current_client(engines):  # noqa: F811
    """A replica that moved to another engine set after its last request served the
    engine gauges of its retired client (the chaos run's idle check saw one engine where
    two served). /metrics now reads the current client."""
    import httpx
    engines.add()
    engines.add()

    async def main():
        replica = await _replica(engines.addresses)
        app = replica.__serve_build_asgi_app__()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as http:
            r = await http.post("/v1/completions", json={"model": "mock", "prompt": "Hi",
                                                          "max_tokens": 2})
            assert r.status_code == 200
            old = replica._client
            await replica._switch(replica._version + 1, engines.addresses[:1])
            text = (await http.get("/metrics")).text
        if replica._follower is not None:
            replica._follower.cancel()
        for c in {old, replica._client}:
            await c.shutdown()
        return [line for line in text.splitlines()
                if line.startswith("vllm:cache_config_info{")]  # one per engine

    lines = asyncio.run(main())
    assert len(lines) == 1 and 'engine="0"' in lines[0]


def test_a_replica_started_beside_serving_engines_reports_their_gauges_at_once(
        engines):  # noqa: F811
    """Issue 41, item 1: a replica made by a scale-out (or replacing one) reported no
    engine gauge until its first request made its client, so scrapes behind the load
    balancer alternated between full and empty. It now connects before it serves when
    the engines are up; with none registered yet (the app's first start) it starts at
    once and connects when they come."""
    import httpx
    engines.add()
    engines.add()

    async def main():
        replica = await _replica(engines.addresses)
        assert replica._client is not None  # connected in __init__
        app = replica.__serve_build_asgi_app__()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as http:
            text = (await http.get("/metrics")).text  # no request served before
        early = await _replica([])
        assert early._client is None and not early._starting.done()  # did not wait
        early.coordinator.membership = _Coordinator(engines.addresses).membership
        for _ in range(100):
            await asyncio.sleep(0.05)
            if early._client is not None:
                break
        connected = early._client is not None
        for r in (replica, early):
            if r._follower is not None:
                r._follower.cancel()
            if r._client is not None:
                await r._client.shutdown()
        return text, connected

    text, connected = asyncio.run(main())
    running = [line for line in text.splitlines()
               if line.startswith("vllm:num_requests_running{")]
    assert sorted(line.split('engine="', 1)[1][0] for line in running) == ["0", "1"], running
    assert connected
