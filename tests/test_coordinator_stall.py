"""A coordinator that stops answering (issue 62, item 2): with its process SIGSTOPped,
GET /v1/models and a request naming an unknown model hung, since the adapter list was
fetched through it on the request path, and several of its callers had no timeout.
Driven here without Ray: the ingress replica's class over in-process mock engines and a
stand-in coordinator handle whose calls never complete once it is "stopped"."""
from __future__ import annotations

import asyncio

import httpx
import pytest

import deployments.serve.coordinator_calls as coordinator_calls
import deployments.serve.engine_server as engine_server
import deployments.serve.ingress as ingress
from deployments.serve.coordinator_calls import CoordinatorTimeoutError
from engine.lora.request import LoRARequest, adapter_id
from tests.test_openai_app import engines, tokenizer  # noqa: F401 - fixtures

MODEL = "mock"  # the served model's name (AppArgs model=mock)
ADAPTER = LoRARequest("ad1", adapter_id("ad1"), "/nowhere/ad1")


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class StoppableCoordinator:
    """Answers membership and list_loras until stop(); then no call completes until
    resume() (as a SIGSTOPped process: its node still takes the connection, nothing
    answers)."""

    def __init__(self, addresses: list[str]) -> None:
        self.running = asyncio.Event()
        self.running.set()
        self.calls: list[str] = []

        def method(name, answer):
            async def call(*args):
                self.calls.append(name)
                await self.running.wait()
                return answer()
            return _Remote(call)
        self.membership = method("membership", lambda: (1, list(addresses), {}, False))
        self.list_loras = method("list_loras", lambda: [ADAPTER])
        self.call = method("call", lambda: [None] * len(addresses))

    def stop(self) -> None:
        self.running.clear()

    def resume(self) -> None:
        self.running.set()


def test_models_and_unknown_models_are_answered_while_the_coordinator_is_silent(
        engines, monkeypatch):  # noqa: F811
    """The replica answers from its last membership and adapter list: /v1/models lists the
    adapter, an unknown model is a 404 (OpenAI's error body), the base model generates,
    /health says the coordinator is silent, each within 2 s instead of hanging; a
    control call times out with a typed error."""
    monkeypatch.setattr(ingress, "MEMBERSHIP_POLL_S", 0.05)
    monkeypatch.setattr(coordinator_calls, "SILENT_AFTER_S", 0.2)
    monkeypatch.setattr(ingress, "CONTROL_TIMEOUT_S", 0.3)
    engines.add()

    async def main():
        coordinator = StoppableCoordinator(engines.addresses)
        cls = ingress.OpenAIIngress.func_or_class.__mro__[1]  # the class under Serve's wrapper
        replica = cls.__new__(cls)
        await replica.__init__({"model": MODEL}, coordinator, None)
        app = replica.__serve_build_asgi_app__()
        await replica.get_client()
        for _ in range(100):  # the replica's first adapter list, fetched in the background
            await asyncio.sleep(0.02)
            if "list_loras" in coordinator.calls:
                break
        await asyncio.sleep(0.1)
        coordinator.stop()
        app.state.adapters.miss_age_s = 0.0  # the list counts as old: it would be asked for
        await asyncio.sleep(0.3)  # past SILENT_AFTER_S

        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as http:
            def within(call):
                return asyncio.wait_for(call, 2.0)
            models = await within(http.get("/v1/models"))
            unknown = await within(http.post("/v1/completions", json={
                "model": "no-such-model", "prompt": "Hi", "max_tokens": 2}))
            one = await within(http.get("/v1/models/no-such-model"))
            base = await within(http.post("/v1/completions", json={
                "model": MODEL, "prompt": "Hi", "max_tokens": 2}))
            health = await within(http.get("/health"))
        with pytest.raises(CoordinatorTimeoutError, match="call") as stalled:
            await within(replica._control.sleep(1))
        replica._follower.cancel()
        await replica._client.shutdown()
        return models, unknown, one, base, health, stalled.value, coordinator.calls

    models, unknown, one, base, health, stalled, calls = asyncio.run(main())
    assert models.status_code == 200
    assert [m["id"] for m in models.json()["data"]] == [MODEL, "ad1"]
    assert unknown.status_code == 404 and one.status_code == 404
    assert unknown.json()["error"]["type"] == "NotFoundError"
    assert unknown.json()["error"]["param"] == "model"
    assert base.status_code == 200
    assert health.status_code == 200
    details = health.json()
    assert details["coordinator"]["state"] == "silent"
    assert details["coordinator"]["engines"] == 1
    assert details["adapters"]["count"] == 1
    assert isinstance(stalled, TimeoutError)  # what the engines' callers catch
    assert calls.count("list_loras") <= 2  # one fetch at a time, not one per request


def test_an_ingress_replica_starting_while_the_coordinator_is_silent_waits_for_it(
        engines, monkeypatch):  # noqa: F811
    """A replacement ingress that came up while the coordinator was SIGSTOPped knew no
    engine and no adapter, and answered the chaos run's probes 503 while the other
    replica served from memory. Now its constructor (Serve routes to a replica only
    once that returns) asks until the coordinator answers, and takes the adapter list
    with the membership: stopped again right after, it serves from what it heard."""
    monkeypatch.setattr(ingress, "COORDINATOR_CALL_TIMEOUT_S", 0.2)
    engines.add()

    async def main():
        coordinator = StoppableCoordinator(engines.addresses)
        coordinator.stop()
        cls = ingress.OpenAIIngress.func_or_class.__mro__[1]
        replica = cls.__new__(cls)
        init = asyncio.ensure_future(replica.__init__({"model": MODEL}, coordinator, None))
        await asyncio.sleep(1.5)  # several asks timed out meanwhile
        waited = not init.done()
        coordinator.resume()
        await asyncio.wait_for(init, 5.0)
        app = replica.__serve_build_asgi_app__()
        coordinator.stop()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as http:
            models = await asyncio.wait_for(http.get("/v1/models"), 2.0)
            base = await asyncio.wait_for(http.post("/v1/completions", json={
                "model": MODEL, "prompt": "Hi", "max_tokens": 2}), 2.0)
        if replica._follower is not None:
            replica._follower.cancel()
        await replica._client.shutdown()
        return waited, models, base, coordinator.calls

    waited, models, base, calls = asyncio.run(main())
    assert waited and calls.count("membership") >= 3
    assert models.status_code == 200
    assert [m["id"] for m in models.json()["data"]] == [MODEL, "ad1"]
    assert base.status_code == 200, base.text


def test_an_engine_replica_gives_up_on_a_silent_coordinator_at_start(monkeypatch):
    """assign_rank had no timeout: a replica starting while the coordinator was stopped
    waited for ever. Now its start fails (Serve starts it again)."""
    monkeypatch.setattr(engine_server, "ASSIGN_RANK_TIMEOUT_S", 0.2)
    cls = engine_server.EngineServer.func_or_class
    cls = cls if "_start" in vars(cls) else cls.__mro__[1]
    replica = object.__new__(cls)
    replica.replica_id, replica.server = "x", None

    async def never(*_):
        await asyncio.Event().wait()
    replica.coordinator = type("C", (), {"assign_rank": _Remote(never)})()

    async def start():
        await asyncio.wait_for(replica._start(), 2.0)
    with pytest.raises(CoordinatorTimeoutError, match="assign_rank"):
        asyncio.run(start())
