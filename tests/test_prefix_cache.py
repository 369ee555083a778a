"""Prefix caching: shared prefixes reuse KV blocks, results stay identical, reset works."""
import random

import pytest

from engine import LLM, SamplingParams
from engine.outputs import OutputKind

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", block_size=8)


def test_shared_prefix_is_served_from_cache_with_same_output(llm):
    rng = random.Random(1)
    prefix = [rng.randrange(100, 40000) for _ in range(40)]
    first = llm.generate([prefix + [11, 12, 13]], GREEDY, use_tqdm=False)[0]
    second = llm.generate([prefix + [11, 12, 13]], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 40  # 5 full blocks of 8
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    other = llm.generate([prefix + [99]], GREEDY, use_tqdm=False)[0]
    assert other.num_cached_tokens == 40


def test_reset_prefix_cache_forgets_blocks(llm):
    prompt = list(range(200, 250))
    llm.generate([prompt], GREEDY, use_tqdm=False)
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens > 0
    assert llm.reset_prefix_cache() is True
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_reset_prefix_cache_refused_while_requests_hold_blocks(llm):
    engine = llm.llm_engine
    engine.add_request("busy", list(range(300, 340)), GREEDY, OutputKind.DELTA)
    outputs = engine.step()
    assert engine.reset_prefix_cache() is False
    assert engine.reset_prefix_cache(reset_running_requests=True) is True
    while engine.has_unfinished_requests():
        outputs += engine.step()
    tokens = [t for o in outputs for t in o.outputs[0].token_ids]
    assert len(tokens) == 16  # the preempted request recomputed and finished normally
    kv = engine.engine_core.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_cached_prefix_matches_uncached_run(tiny_llama):
    rng = random.Random(2)
    prompts = [[rng.randrange(100, 40000) for _ in range(33)] for _ in range(3)]
    shared = [prompts[0][:24] + p[24:] for p in prompts]
    with_cache = LLM(str(tiny_llama), dtype="float32", block_size=8)
    without = LLM(str(tiny_llama), dtype="float32", block_size=8, enable_prefix_caching=False)
    a = [o.outputs[0].token_ids for o in with_cache.generate(shared, GREEDY, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in without.generate(shared, GREEDY, use_tqdm=False)]
    assert a == b


def test_kv_events_match_the_kv_cache(tiny_llama):
    """The events an engine publishes, applied to a router's index, always equal the set
    of hashes its cache can hit: stored on register, removed when a cached block is
    reused, cleared on reset; and they are the hashes a router computes for a prompt."""
    from engine.core.block_hash import prefix_block_hashes
    from engine.wire.prefix_index import PrefixIndex
    llm = LLM(str(tiny_llama), dtype="float32", block_size=8, num_gpu_blocks_override=24)
    core = llm.llm_engine.engine_core
    index = PrefixIndex()

    def sync() -> list:
        events = core.take_kv_events()
        if events is not None:
            index.apply(0, events)
        assert {h for h in core.kv.cached} == index._blocks.get(0, set())
        return events

    first = sync()
    assert first.cleared and first.stored == []  # the first take is a snapshot
    assert core.take_kv_events() is None  # nothing happened since
    rng = random.Random(3)
    prompt = [rng.randrange(100, 40000) for _ in range(43)]
    llm.generate([prompt], GREEDY, use_tqdm=False)
    stored = sync()
    assert not stored.cleared and stored.removed == []
    assert set(prefix_block_hashes(prompt, 8)) <= set(stored.stored)  # 5 prompt blocks
    assert index.cached_prefix(0, prefix_block_hashes(prompt, 8)) == 5
    removed = []
    for i in range(4):  # 24 blocks: new prompts reuse the cached ones
        other = [rng.randrange(100, 40000) for _ in range(60)]
        llm.generate([other], GREEDY, use_tqdm=False)
        removed += sync().removed
    assert removed and index.cached_prefix(0, prefix_block_hashes(prompt, 8)) < 5
    assert core.reset_prefix_cache() is True
    cleared = sync()
    assert cleared.cleared and index._blocks[0] == set() and not core.kv.cached
    again = core.kv_cache_snapshot()
    assert again.cleared and again.stored == []
    llm.shutdown()
