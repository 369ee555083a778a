"""An engine killed under load is replaced and serving within 30 s (issue 62, item 5):
the coordinator frees a dead engine's rank without waiting out a handshake, a
replacement joining a server that already serves backs its KV pool after ready (in the
background) instead of before, and Serve checks the engines often enough to notice a
death within a few seconds (bench/recovery.py times each phase)."""
from __future__ import annotations

import asyncio
import sys

import pytest

import deployments.serve.engine_server as engine_server
from deployments.serve import coordinator as coordinator_module
from tests.test_coordinator_restart import ARGS, MemoryRankStore, _coordinator_class, _listening
from tests.test_coordinator_stall import _Remote
from tests.test_hugepages import _resident


def _closed_port() -> str:
    """An address whose port refuses connections, as a SIGKILLed engine's does."""
    sock, address = _listening()
    sock.close()
    return address


def test_a_dead_engines_rank_goes_to_its_replacement_without_a_handshake(monkeypatch):
    """A registered engine was probed with a ZMQ handshake only: ZMQ retries a refused
    connect in silence, so each replacement of a killed engine waited the probe's whole
    timeout (2 s) for its rank. A port that refuses is now gone at once; only an engine
    whose port accepts (live, or SIGSTOPped) is asked to answer."""
    asked: list[str] = []

    async def answers(address, keys):
        asked.append(address)
        return True
    monkeypatch.setattr(coordinator_module, "_answers", answers)
    coordinator = _coordinator_class(MemoryRankStore())(ARGS)
    live_sock, live = _listening()
    try:
        assert asyncio.run(coordinator.assign_rank("a")) == 0
        assert asyncio.run(coordinator.assign_rank("b")) == 1
        coordinator.register(0, "a", live, {}, None)
        coordinator.register(1, "b", _closed_port(), {}, None)
        assert asyncio.run(coordinator.assign_rank("c")) == 1
        assert asked == [live]  # the dead one was never handshaken
        assert 1 not in coordinator.registry  # out of the membership until "c" registers
    finally:
        live_sock.close()


def test_the_coordinator_says_whether_the_server_already_serves():
    coordinator = _coordinator_class(MemoryRankStore())(ARGS)
    socks = [_listening() for _ in range(2)]
    try:
        for replica in ("a", "b"):
            asyncio.run(coordinator.assign_rank(replica))
        coordinator.register(0, "a", socks[0][1], {}, None)
        assert not coordinator.serving()  # a first start: rank 1 still loading
        coordinator.register(1, "b", socks[1][1], {}, None)
        assert coordinator.serving()
    finally:
        for sock, _ in socks:
            sock.close()


def _engine_replica(serving):
    """An EngineServer replica object (not started) whose coordinator answers serving()
    with `serving()` (a coroutine function)."""
    cls = engine_server.EngineServer.func_or_class
    cls = cls if "_build_core" in vars(cls) else cls.__mro__[1]
    replica = object.__new__(cls)
    replica.args = engine_server.AppArgs.model_validate({"model": "default"})
    replica.rank, replica.server = 1, None
    replica.coordinator = type("C", (), {"serving": _Remote(serving)})()
    return replica


@pytest.mark.parametrize("serving, before_ready", [(True, False), (False, True), (None, True)])
def test_a_replacement_backs_its_kv_pool_after_ready(monkeypatch, serving, before_ready):
    """Joining a server that serves: the KV pool's pages after ready. At a first start,
    or when the coordinator does not answer (None): before, as always."""
    import engine.core.engine_core as engine_core
    monkeypatch.setattr(engine_server, "COORDINATOR_CALL_TIMEOUT_S", 0.2)
    built = {}

    class FakeCore:
        def __init__(self, config, launcher, kv_pages_before_ready=True):
            built["before_ready"] = kv_pages_before_ready
    monkeypatch.setattr(engine_core, "EngineCore", FakeCore)

    async def answer():
        if serving is None:
            await asyncio.Event().wait()  # a stopped coordinator: never answers
        return serving
    asyncio.run(_engine_replica(answer)._build_core())
    assert built == {"before_ready": before_ready}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore(2) on Linux")
def test_an_engine_joining_a_serving_server_backs_its_kv_pool_in_the_background(tiny_llama):
    from engine.config import EngineConfig
    from engine.core.engine_core import EngineCore
    core = EngineCore(EngineConfig(model=str(tiny_llama), dtype="float32", max_num_seqs=2,
                                   max_model_len=64), kv_pages_before_ready=False)
    try:
        populating = core.runner._populating
        assert populating is not None and populating.wait(60)
        full_batch = 2 * 64 // core.block_size
        for layer in core.runner.kv_caches:  # the same blocks as a first start's, later
            assert all(_resident(layer[:full_batch]))
        assert float(core.runner.kv_caches[:, full_batch:].abs().sum()) == 0.0
        core.runner.free_kv_cache()  # sleep mode: the pool goes, its population stops
        assert core.runner._populating is None and not populating.thread.is_alive()
    finally:
        core.shutdown()


def test_background_populate_keeps_what_was_written_and_stops_early():
    import torch

    from engine.model.hugepages import BackgroundPopulate, lazily_zeroed
    t = lazily_zeroed((4, 64 << 20), torch.uint8)
    t[0, :4096] = 9  # a step wrote it first: kept
    job = BackgroundPopulate([t[0:2]], "test pages")
    assert job.wait(60)
    assert int(t[0, :4096].min()) == 9 and int(t[0, 4096:].max()) == 0
    if sys.platform.startswith("linux"):
        assert all(_resident(t[0:2])) and not any(_resident(t[3, 4 << 20:]))
    stopped = BackgroundPopulate([t[2:4]], "test pages")
    stopped.stop()  # returns once its thread has left (between chunks)
    assert stopped.wait(0)


def test_serve_checks_the_engines_often_enough_to_notice_a_death_in_seconds():
    """Serve notices a dead replica when a health check of it fails: at most a period
    after the kill (it was 5 s)."""
    config = engine_server.EngineServer._deployment_config
    assert config.health_check_period_s == engine_server.HEALTH_CHECK_PERIOD_S <= 2.0
