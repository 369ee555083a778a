"""The ingress's grammar check runs under a time limit inside the request's deadline
(engine/structured/check_limit.py, issue 62 item 3): a check past CHECK_TIMEOUT_S is a
400 naming the constraint's field, one past the request's own timeout a 408, runaway
builds are bounded in number, and the app keeps serving."""
import asyncio
import threading
import time

import pytest

from engine.structured import check_limit, grammar
from tests.test_core_client import engines, tokenizer  # noqa: F401 - fixtures
from tests.test_openai_app import MODEL, serve

MSGS = [{"role": "user", "content": "Hi"}]


def _checked(r) -> bool:
    """The request passed the ingress's check (the mock engine then refuses any
    constraint: it has no model to constrain)."""
    return r.status_code == 200 or (
        r.status_code == 400 and "mock engine does not support" in r.json()["error"]["message"])


def _schema(tag: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": tag, "schema": {
        "type": "object", "properties": {tag: {"type": "string"}}}}}


@pytest.fixture
def slow_builds(monkeypatch):
    """Builds of schemas whose name starts with "slow" take `hold` seconds (or until
    released); the others build as usual."""
    release = threading.Event()
    state = {"hold": 5.0, "release": release}
    real = grammar.build_grammar

    def build(spec):
        if spec.json is not None and '"slow' in spec.json:
            release.wait(state["hold"])
        return real(spec)
    monkeypatch.setattr(grammar, "build_grammar", build)
    grammar._checked.clear()
    yield state
    release.set()


def test_a_check_past_the_limit_is_a_400_naming_the_field(engines, slow_builds,  # noqa: F811
                                                          monkeypatch):
    monkeypatch.setattr(check_limit, "CHECK_TIMEOUT_S", 0.3)
    engines.add(itl_s=0.001)

    async def test(http, oai):
        start = time.monotonic()
        r = await http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": MSGS, "max_tokens": 2,
            "response_format": _schema("slow_a")})
        assert time.monotonic() - start < 3
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "response_format" and error["type"] == "BadRequestError"
        assert "did not build within 0.3 s" in error["message"]
        r = await http.post("/v1/completions", json={
            "model": MODEL, "prompt": "Hi", "max_tokens": 2,
            "structured_outputs": {"json": _schema("slow_b")["json_schema"]["schema"]}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs"
        # the app keeps serving: unconstrained, and constrained with a schema that builds
        r = await http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": MSGS, "max_tokens": 2})
        assert r.status_code == 200, r.text
        r = await http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": MSGS, "max_tokens": 2,
            "response_format": _schema("quick")})
        assert _checked(r), r.text
    serve(engines, test)


def test_the_check_ends_at_the_requests_own_timeout(engines, slow_builds):  # noqa: F811
    engines.add(itl_s=0.001)

    async def test(http, oai):
        start = time.monotonic()
        r = await http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": MSGS, "max_tokens": 2, "timeout": 0.4,
            "response_format": _schema("slow_c")})
        took = time.monotonic() - start
        assert r.status_code == 408, r.text
        assert took < 2.0, took  # not the 5 s the build takes, nor CHECK_TIMEOUT_S
    serve(engines, test)


def test_runaway_builds_are_bounded_and_a_retry_joins_the_running_one(  # noqa: F811
        engines, slow_builds, monkeypatch):
    monkeypatch.setattr(check_limit, "CHECK_TIMEOUT_S", 0.2)
    monkeypatch.setattr(check_limit, "MAX_RUNNING", 2)
    engines.add(itl_s=0.001)

    async def test(http, oai):
        async def ask(tag):
            r = await http.post("/v1/chat/completions", json={
                "model": MODEL, "messages": MSGS, "max_tokens": 2,
                "response_format": _schema(tag)})
            return "checked" if _checked(r) else r.status_code
        assert await ask("slow_d") == 400
        assert await ask("slow_d") == 400  # the same schema again: joins its build
        assert await ask("slow_e") == 400
        assert check_limit.builds.running == 2  # abandoned, still on their threads
        assert await ask("slow_f") == 429  # a third would take another core: refused
        assert await ask("quick2") == 429  # any new build, until one ends
        slow_builds["release"].set()
        deadline = time.monotonic() + 5
        while check_limit.builds.running and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert check_limit.builds.running == 0
        assert await ask("slow_d") == "checked"  # its build ended meanwhile: marked
        assert await ask("quick2") == "checked"
    serve(engines, test)


def _slow(release: threading.Event, hold_s: float = 5.0):
    return lambda: release.wait(hold_s)


def test_run_check_within_the_scope_limits(monkeypatch):
    """Without the app: the scope's deadline gives a 408's error, the ceiling a 400's
    naming the scope's field; each waits no longer than its limit."""
    monkeypatch.setattr(check_limit, "CHECK_TIMEOUT_S", 0.3)
    release = threading.Event()
    try:
        def in_scope(deadline_s, digest):
            check_limit.scope(None if deadline_s is None else time.monotonic() + deadline_s,
                              lambda: "guided_regex")
            start = time.monotonic()
            try:
                check_limit.run_check(digest, _slow(release))
            except Exception as exc:  # noqa: BLE001 - returned for the asserts
                return exc, time.monotonic() - start
            return None, time.monotonic() - start
        import contextvars
        exc, took = contextvars.copy_context().run(in_scope, 0.1, b"u1")
        assert isinstance(exc, check_limit.RequestTimeoutError) and took < 0.25
        exc, took = contextvars.copy_context().run(in_scope, 5.0, b"u2")
        assert isinstance(exc, check_limit.CheckTimeoutError) and exc.param == "guided_regex"
        assert 0.25 < took < 1.0
        exc, _ = contextvars.copy_context().run(in_scope, -1.0, b"u3")  # already past
        assert isinstance(exc, check_limit.RequestTimeoutError)
        with pytest.raises(check_limit.CheckTimeoutError) as info:  # no scope: offline
            check_limit.run_check(b"u4", _slow(release))
        assert info.value.param == "structured_outputs"
        assert check_limit.run_check(b"u5", lambda: 7) == 7
    finally:
        release.set()
