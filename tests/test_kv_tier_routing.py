"""Where blocks live outside the pool reaches the routers (issue 64, point 4): an
engine's KV events carry its host tier's and the shared disk tier's blocks, and the
prefix router counts a tier hit as cheaper than a miss and dearer than a pool hit."""
from __future__ import annotations

import random
from types import SimpleNamespace

from engine import LLM, SamplingParams
from engine.core.block_hash import prefix_block_hashes
from engine.core_messages import KVEvents
from engine.wire.routing import Router

BLOCK = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _engines(n: int):
    return [SimpleNamespace(index=i, address=f"tcp://e{i}", stats=None, in_flight=0)
            for i in range(n)]


def test_a_tier_hit_costs_less_than_a_miss_and_more_than_a_pool_hit():
    router = Router("prefix", block_size=BLOCK)
    prompt = list(range(1000, 1000 + 8 * BLOCK + 3))
    hashes = router.block_hashes(prompt, None)
    pool, host, miss = _engines(3)
    router.on_kv_events(pool.index, KVEvents(cleared=True, stored=hashes))
    router.on_kv_events(host.index, KVEvents(cleared=True, host_stored=hashes))
    router.on_kv_events(miss.index, KVEvents(cleared=True))
    load = lambda e: 0  # noqa: E731
    assert router.choose([host, miss], load, len(prompt), hashes)[0] is host
    chosen, to_prefill = router.choose([pool, host, miss], load, len(prompt), hashes)
    assert chosen is pool and to_prefill == 3
    # the shared disk tier counts on every engine, once any engine reported it
    router.on_kv_events(miss.index, KVEvents(disk_stored=hashes[:4]))
    assert router.index.tier_prefix(host.index, hashes, 0) == 8
    assert router.index.tier_prefix(pool.index, hashes, 8) == 0
    assert router.index.tier_prefix(miss.index, hashes, 0) == 4
    # a cleared engine forgets its host tier (a snapshot follows); removals apply
    router.on_kv_events(host.index, KVEvents(cleared=True))
    assert router.index.tier_prefix(host.index, hashes, 0) == 4  # the disk's part
    router.on_kv_events(pool.index, KVEvents(disk_removed=hashes[:1]))
    assert router.index.tier_prefix(miss.index, hashes, 0) == 0
    router.engine_gone(host.index)
    assert router.index.tier_prefix(host.index, hashes, 1) == 3


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 30000) for _ in range(61)]


def test_an_engine_s_events_say_which_blocks_its_tiers_hold(tiny_llama, tmp_path):
    llm = LLM(str(tiny_llama), dtype="float32", block_size=BLOCK, kv_transfer_config={
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"disk_path": str(tmp_path / "tier")}})
    core = llm.llm_engine.engine_core
    try:
        first = core.take_kv_events()  # the first answer is a snapshot
        assert first.cleared and not first.host_stored and not first.disk_stored
        prompt = _prompt(1)
        llm.generate([prompt], GREEDY, use_tqdm=False)
        core.kv_transfer.connector.worker.store.disk.flush(30)
        events = core.take_kv_events()
        blocks = prefix_block_hashes(prompt, BLOCK)  # the prompt's 7 full blocks
        assert set(blocks) <= set(events.stored)  # in the pool
        assert set(blocks) <= set(events.host_stored)  # and copied out as they filled
        assert set(blocks) <= set(events.disk_stored)
        # a router connecting now gets both tiers in its snapshot
        snap = core.kv_cache_snapshot()
        assert set(blocks) <= set(snap.host_stored) and set(blocks) <= set(snap.disk_stored)
        # the pool forgets (cleared): the host tier is sent whole again with it
        assert llm.reset_prefix_cache() is True
        again = core.take_kv_events()
        assert again.cleared and set(blocks) <= set(again.host_stored)
    finally:
        llm.shutdown()


def test_host_tier_evictions_are_removed_events(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", block_size=BLOCK, kv_transfer_config={
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both"})
    core = llm.llm_engine.engine_core
    try:
        core.take_kv_events()
        host = core.kv_transfer.connector.worker.store.host
        block = core.runner.kv_caches[:, 0]
        host.capacity_bytes = 4 * block.numel() * block.element_size()  # 4 blocks
        prompt = _prompt(2)
        llm.generate([prompt], GREEDY, use_tqdm=False)  # 8 full blocks copied out
        events = core.take_kv_events()
        assert len(host) == 4 and len(events.host_removed) == 4
        # coalesced per hash: the blocks still held are stored, the evicted removed
        assert set(events.host_stored) == set(host.hashes())
        assert set(events.host_removed) == set(prefix_block_hashes(
            prompt, BLOCK)[:4])
    finally:
        llm.shutdown()


def test_the_connector_s_counts_reach_the_engine_s_stats_and_metrics(tiny_llama):
    """SchedulerStats carries what the connector asked, supplied and moved; /metrics
    renders it under vLLM's external-prefix-cache names and Flotilla's transfer names."""
    from prometheus_client import CollectorRegistry, generate_latest
    from deployments.serve.metrics import _EngineCollector
    llm = LLM(str(tiny_llama), dtype="float32", block_size=BLOCK, kv_transfer_config={
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both"})
    core = llm.llm_engine.engine_core
    try:
        prompt = _prompt(3)
        llm.generate([prompt], GREEDY, use_tqdm=False)
        assert llm.reset_prefix_cache() is True
        llm.generate([prompt], GREEDY, use_tqdm=False)  # 7 blocks from the host tier
        stats = core.get_stats()
        block = core.runner.kv_caches[:, 0]
        assert stats.kv_connector == "OffloadingConnector"
        assert stats.external_prefix_cache_hits == 56 and stats.kv_blocks_in == 7
        assert stats.external_prefix_cache_queries == 2 * len(prompt)
        assert stats.kv_blocks_out == 8 and stats.kv_load_failures == 0
        assert stats.kv_bytes_in == 7 * block.numel() * block.element_size()
        engine = SimpleNamespace(index=0, stats=stats, ready=SimpleNamespace(
            block_size=BLOCK, num_gpu_blocks=core.num_blocks))
        registry = CollectorRegistry()
        registry.register(_EngineCollector("m", lambda: SimpleNamespace(engines=[engine])))
        text = generate_latest(registry).decode()
        assert 'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 56.0' in text
        assert ('flotilla:kv_transfer_blocks_total{connector="OffloadingConnector",'
                'direction="in",engine="0",model_name="m"} 7.0') in text
    finally:
        llm.shutdown()
