"""Prefix-cache-aware routing over data-parallel mock engines: stable block hashes, the
mock's prefix cache and KV events, the client's index, cost, sessions, restarts."""
import asyncio
import os
import subprocess
import sys
import threading
import time

import pytest

from engine import SamplingParams
from engine.core.block_hash import BASE_ROOT_SEED, prefix_block_hashes, root_seed
from engine.core_messages import EngineCoreRequest, KVEvents
from engine.lora.request import LoRARequest
from engine.mock.config import MockConfig
from engine.mock.core import MockEngineCore
from engine.wire.core_server import EngineCoreServer
from engine.wire.prefix_index import RECENT_S, PrefixIndex
from engine.wire.routing import MISS_WEIGHT, RUNNING_COST_BLOCKS, Router, check_routing

PARAMS = SamplingParams(max_tokens=2, ignore_eos=True)
PREFIX = list(range(1000, 1064))  # 4 full blocks of 16
LORA = LoRARequest("ad", 7, "/adapters/ad")


# ---- hashes ------------------------------------------------------------------------------
def test_block_hashes_are_the_same_in_another_process():
    code = ("from engine.core.block_hash import prefix_block_hashes as p;"
            "from engine.lora.request import LoRARequest as L;"
            "print(p(list(range(1000, 1064)), 16), p(list(range(1000, 1064)), 16, "
            "L('ad', 7, '/adapters/ad')))")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True).stdout
    here = f"{prefix_block_hashes(PREFIX, 16)} {prefix_block_hashes(PREFIX, 16, LORA)}"
    assert out.strip() == here


def test_chains_differ_per_adapter_and_only_count_full_blocks():
    base, lora = prefix_block_hashes(PREFIX + [1, 2], 16), prefix_block_hashes(PREFIX, 16, LORA)
    assert len(base) == len(lora) == 4 and not set(base) & set(lora)
    assert root_seed(None) == BASE_ROOT_SEED != root_seed(LORA)
    assert root_seed(LoRARequest("ad", 7, "/elsewhere")) != root_seed(LORA)
    assert prefix_block_hashes(PREFIX, 16, max_blocks=2) == base[:2]


def test_unknown_routing_policy_is_refused():
    assert check_routing("round_robin") == "round_robin"
    with pytest.raises(ValueError, match="prefix, least_loaded, round_robin"):
        Router("random")


def test_a_routed_prompt_counts_as_cached_there_until_events_catch_up():
    # events lag up to ~100 ms: a burst with a new prefix must follow the first request
    index = PrefixIndex()
    hashes = prefix_block_hashes(PREFIX, 16)
    index.routed(0, hashes)
    assert index.cached_prefix(0, hashes) == 4 and index.cached_prefix(1, hashes) == 0
    index.apply(0, KVEvents(removed=hashes[2:]))  # the engine says otherwise: it wins
    assert index.cached_prefix(0, hashes) == 2
    index.routed(1, hashes, now=time.monotonic() - RECENT_S)  # too long ago, no event
    assert index.cached_prefix(1, hashes) == 0
    index.routed(1, hashes)
    index.apply(1, KVEvents(cleared=True))
    assert index.cached_prefix(1, hashes) == 0
    index.routed(0, hashes)
    index.drop(0)
    assert index.cached_prefix(0, hashes) == 0


# ---- the mock engine's prefix cache --------------------------------------------------------
class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _req(rid, ids, max_tokens=2):
    return EngineCoreRequest(rid, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_mock_prefix_cache_skips_cached_prefill_and_publishes_events():
    clock = Clock()
    core = MockEngineCore(MockConfig(prefill_s_per_token=0.01, num_blocks=6), clock=clock)
    assert core.take_kv_events() == KVEvents(cleared=True)  # first take: the snapshot
    core.add_request(_req("a", PREFIX + [5, 6]))
    a = core._running["a"]
    assert a.num_cached == 0 and a.first_due == pytest.approx(100.0 + 0.01 * 66)
    events = core.take_kv_events()
    assert sorted(events.stored) == sorted(prefix_block_hashes(PREFIX, 16)) and not events.removed
    core.add_request(_req("b", PREFIX + [7]))
    b = core._running["b"]
    assert b.num_cached == 64 and b.first_due == pytest.approx(100.0 + 0.01 * 1)
    assert core.take_kv_events() is None  # b's blocks were all cached already
    clock.now = 200.0
    outs = core.step()
    assert {o.num_cached_tokens for o in outs if o.request_id == "b"} == {64}
    stats = core.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (66 + 65, 64)
    # a prompt of exactly 4 blocks reuses 3 (one token is always computed)
    core.add_request(_req("c", PREFIX))
    assert core._running["c"].num_cached == 48
    # 6 blocks: three new ones evict the least recently used, the old prefix's tail first
    other = list(range(2000, 2048))
    core.add_request(_req("d", other))
    events = core.take_kv_events()
    assert len(events.stored) == 3 and len(events.removed) == 1
    assert events.removed == [prefix_block_hashes(PREFIX, 16)[3]]
    assert set(core._cache) == set(prefix_block_hashes(PREFIX, 16)[:3]) | set(
        prefix_block_hashes(other, 16))
    assert core.kv_cache_snapshot() == KVEvents(cleared=True, stored=list(core._cache))
    clock.now = 300.0
    while core.has_unfinished_requests():
        core.step()
        clock.now += 1
    assert core.reset_prefix_cache() is True
    assert core.take_kv_events() == KVEvents(cleared=True) and not core._cache


def test_mock_serial_prefill_queues_prompts_and_caching_can_be_off():
    clock = Clock()
    core = MockEngineCore(MockConfig(prefill_s_per_token=0.01, serial_prefill=True,
                                     enable_prefix_caching=False), clock=clock)
    core.add_request(_req("a", PREFIX))
    core.add_request(_req("b", PREFIX))
    assert core._running["a"].first_due == pytest.approx(100.64)
    assert core._running["b"].first_due == pytest.approx(101.28)  # after a's prefill
    assert core._running["b"].num_cached == 0 and core.take_kv_events() == KVEvents(cleared=True)
    assert core.take_kv_events() is None


# ---- routing over two mock engines -----------------------------------------------------------
async def _index_has(client, engine: int, hashes, timeout: float = 5.0) -> None:
    """Wait until the client's index says `engine` holds every hash (events are batched)."""
    for _ in range(int(timeout / 0.02)):
        if all(client.router.index.holds(engine, h) for h in hashes):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine {engine}'s blocks never reached the index")


async def _run(client, rid, ids, **kwargs):
    out = None
    async for out in client.generate(rid, ids, PARAMS, **kwargs):
        pass
    return out


def _queries(engines) -> list[int]:
    return [c.get_stats().prefix_cache_queries for c in engines.cores]


def test_requests_sharing_a_prefix_land_on_the_engine_that_cached_it(engines):
    engines.add()
    engines.add()

    async def main():
        client = await engines.client()
        try:
            first = await _run(client, "p0", PREFIX + [1])
            assert first.num_cached_tokens == 0
            home = next(i for i, q in enumerate(_queries(engines)) if q)
            await _index_has(client, home, prefix_block_hashes(PREFIX, 16))
            before = _queries(engines)
            outs = [await _run(client, f"p{i}", PREFIX + [i, i + 1]) for i in range(1, 7)]
            after = _queries(engines)
            assert after[1 - home] == before[1 - home]  # nothing went to the other engine
            assert all(o.num_cached_tokens == 64 for o in outs)
            # an unrelated prompt is routed by load, and can go anywhere
            await _run(client, "x", list(range(5000, 5040)))
        finally:
            await client.shutdown()

        # the same load under least_loaded alternates, and half of it misses the cache
        ll = await engines.client(routing="least_loaded")
        try:
            before = _queries(engines)
            [await _run(ll, f"l{i}", PREFIX + [i, i + 2]) for i in range(6)]
            after = _queries(engines)
            assert all(a > b for a, b in zip(after, before))
        finally:
            await ll.shutdown()
    asyncio.run(main())


def _starter(client, engines, tasks: list):
    """start(rid, ids, **kw): run a request in the background until an engine runs it;
    returns that engine's index."""
    async def start(rid, ids, **kw):
        task = asyncio.create_task(_run(client, rid, ids, **kw))
        tasks.append(task)
        while not any(rid in c._running for c in engines.cores):
            await asyncio.sleep(0.01)
        return next(i for i, c in enumerate(engines.cores) if rid in c._running)
    return start


def _on_two_slow_engines(engines, main) -> None:
    """Run `await main(client, start)` over two engines whose requests decode for a long
    time (they stay running); what it started is cancelled afterwards."""
    engines.add(itl_s=30.0)
    engines.add(itl_s=30.0)

    async def run():
        client = await engines.client()
        tasks = []
        try:
            await main(client, _starter(client, engines, tasks))
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await client.shutdown()
    asyncio.run(run())


def test_a_hot_prefix_spreads_when_its_engine_queue_outgrows_recomputing_it(engines):
    # requests decode for a long time: each one queued on the hot engine raises its cost
    async def main(client, start):
        home = await start("h0", PREFIX + [1])
        await _index_has(client, home, prefix_block_hashes(PREFIX, 16))
        placed = [await start(f"h{i}", PREFIX + [i, i]) for i in range(1, 12)]
        spill = placed.index(1 - home)  # it did spread
        assert placed[:2] == [home, home]  # affinity first
        # it spread once the hot engine's queue (h0 and `spill` more running there)
        # cost about what recomputing the 64 cached tokens elsewhere costs, not before
        run_cost = RUNNING_COST_BLOCKS * 16
        assert (MISS_WEIGHT * 2 + run_cost * (spill + 1) >= MISS_WEIGHT * 66
                >= MISS_WEIGHT * 2 + run_cost * spill)
        await _index_has(client, 1 - home, prefix_block_hashes(PREFIX, 16))
        # now both engines hold the prefix: the next one goes where the queue is shorter
        loads = [client.engines[i].in_flight for i in (0, 1)]
        nxt = await start("h-next", PREFIX + [99])
        assert loads[nxt] == min(loads)
    _on_two_slow_engines(engines, main)


def test_events_survive_an_engine_restart_and_a_late_client_gets_a_snapshot(engines):
    engines.add()
    engines.add()
    other = list(range(3000, 3064))

    async def main():
        client = await engines.client(heartbeat_timeout_s=1.0)
        try:
            await _run(client, "p", PREFIX + [1], data_parallel_rank=0)
            await _run(client, "q", other + [1], data_parallel_rank=1)
            await _index_has(client, 0, prefix_block_hashes(PREFIX, 16))
            await _index_has(client, 1, prefix_block_hashes(other, 16))
            engines.servers[0].shutdown()  # engine 0 dies: its index is dropped
            for _ in range(200):
                if client.engines[0].dead:
                    break
                await asyncio.sleep(0.05)
            assert client.engines[0].dead and client.router.index.num_blocks(0) == 0
            assert client.router.index.num_blocks(1) >= 4
        finally:
            await client.shutdown()
        # engine 0 restarts (empty cache) at its address; a new client, as the ingress
        # makes on a membership change, learns both engines' caches from snapshots
        core = MockEngineCore(MockConfig(engine_index=0, vocab_size=len(engines.tokenizer)))
        engines.servers[0] = EngineCoreServer(core, engines.addresses[0], 0,
                                              heartbeat_interval_s=0.2).start()
        engines.cores[0] = core
        late = await engines.client()
        try:
            await _index_has(late, 1, prefix_block_hashes(other, 16))
            assert late.router.index.num_blocks(0) == 0
            out = await _run(late, "q2", other + [2])  # goes where the snapshot says
            assert out.num_cached_tokens == 64 and engines.cores[0].get_stats() \
                .prefix_cache_queries == 0
            await _run(late, "p2", PREFIX + [2], data_parallel_rank=0)
            await _index_has(late, 0, prefix_block_hashes(PREFIX, 16))  # new events flow
            assert (await _run(late, "p3", PREFIX + [3])).num_cached_tokens == 64
        finally:
            await late.shutdown()
    asyncio.run(main())


def test_a_session_sticks_to_its_engine_until_it_leaves(engines):
    async def main(client, start):
        home = await start("s0", list(range(4000, 4010)), session_id="chat-1")
        # load the session's engine: least load and the cache both point elsewhere
        for i in range(3):
            await start(f"busy{i}", list(range(6000 + 50 * i, 6040 + 50 * i)),
                        data_parallel_rank=home)
        assert await start("s1", PREFIX, session_id="chat-1") == home
        assert await start("s2", list(range(7000, 7010)), session_id="chat-1") == home
        assert await start("n1", list(range(7100, 7110))) == 1 - home  # no session
        # the session's engine leaves (drains): the session moves, and stays moved
        drain = threading.Thread(target=engines.servers[home].drain, args=(0.5, 3.0))
        drain.start()
        await asyncio.sleep(0.1)
        assert await start("s3", list(range(7200, 7210)), session_id="chat-1") == 1 - home
        assert client.router.sessions["chat-1"] == engines.addresses[1 - home]
        drain.join()
    _on_two_slow_engines(engines, main)


def test_sessions_move_to_a_new_client_and_an_unknown_engine_reroutes():
    from types import SimpleNamespace
    old, new = Router(), Router()
    a, b = (SimpleNamespace(index=i, address=f"tcp://e{i}") for i in range(2))
    old.remember_session("s", a)
    new.adopt_sessions(old)
    assert new.session_engine("s", [a, b]) is a
    assert new.session_engine("s", [b]) is None  # its engine is gone: route anew
    assert new.session_engine(None, [a, b]) is None


def test_session_ids_are_bounded_so_the_session_table_is_bounded_in_bytes(engines):
    """The router keeps MAX_SESSIONS ids: each at most 256 characters, or the table's
    bytes grow with whatever clients send. Over HTTP a longer x-session-id is a 400
    naming the header; through the client's API an InvalidRequestError."""
    from types import SimpleNamespace

    from engine.errors import InvalidRequestError
    from engine.wire.routing import MAX_SESSION_ID_CHARS
    from tests.test_openai_app import MODEL, serve
    a = SimpleNamespace(index=0, address="tcp://e0")
    router = Router()
    router.remember_session("s" * MAX_SESSION_ID_CHARS, a)
    assert router.session_engine("s" * MAX_SESSION_ID_CHARS, [a]) is a
    with pytest.raises(InvalidRequestError, match="at most 256"):
        router.session_engine("s" * (MAX_SESSION_ID_CHARS + 1), [a])
    engines.add()

    async def test(http, oai):
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
        long = await http.post("/v1/completions", json=body,
                               headers={"x-session-id": "c" * 10_000})
        fits = await http.post("/v1/completions", json=body,
                               headers={"x-session-id": "c" * MAX_SESSION_ID_CHARS})
        key = await http.post("/v1/responses", json={  # the Responses API's session id
            "model": MODEL, "input": "Hi", "max_output_tokens": 2,
            "prompt_cache_key": "k" * (MAX_SESSION_ID_CHARS + 1)})
        return long, fits, key

    long, fits, key = serve(engines, test)
    assert long.status_code == 400 and long.json()["error"]["param"] == "x-session-id"
    assert fits.status_code == 200
    assert key.status_code == 400 and "prompt_cache_key" in key.json()["error"]["param"]


def test_the_x_session_id_header_keeps_a_conversation_on_one_engine(engines):
    from tests.test_openai_app import MODEL, serve
    engines.add()
    engines.add()

    async def test(http, oai):
        for i in range(4):  # short prompts: no cache to follow, only the session
            await oai.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"turn {i}"}], max_tokens=2,
                extra_headers={"x-session-id": "conv-9"})
            await oai.completions.create(model=MODEL, prompt=f"more {i}", max_tokens=2,
                                         extra_headers={"x-session-id": "conv-9"})
        sticky = _queries(engines)
        for i in range(4):
            await oai.completions.create(model=MODEL, prompt=f"free {i}", max_tokens=2)
        return sticky, _queries(engines)

    sticky, after = serve(engines, test)
    assert sorted(q > 0 for q in sticky) == [False, True]  # all eight on one engine
    assert all(q > 0 for q in after)  # without the header they spread
