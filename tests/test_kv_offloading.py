"""The shared KV tier through OffloadingConnector (issue 64, points 1, 4, 5): blocks an
engine computes are copied out as they fill; a prefix lookup continues past the pool
into the tier; another engine sharing the disk tier's directory (or the same engine
after its pool forgot them) loads them instead of computing them, with the same greedy
output; a corrupt or vanished block follows kv_load_failure_policy; nothing leaks."""
from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.core_messages import EngineCoreRequest
from engine.errors import InvalidRequestError
from engine.kv_transfer.base import ConnectorContext, KVLayout
from engine.kv_transfer.connectors.offloading import check_pool
from engine.outputs import OutputKind

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
BLOCK = 8


def _prompt(seed: int, n: int = 61) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 30000) for _ in range(n)]


def _engine(model, disk=None, policy: str = "fail", **extra) -> LLM:
    config = {"cpu_bytes_to_use": 64 << 20, **extra}
    if disk is not None:
        config["disk_path"] = str(disk)
    return LLM(str(model), dtype="float32", block_size=BLOCK, kv_transfer_config={
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_load_failure_policy": policy, "kv_connector_extra_config": config})


def _core(llm: LLM):
    return llm.llm_engine.engine_core


def _tokens(llm: LLM, prompts: list[list[int]], params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _assert_idle(llm: LLM) -> None:
    core = _core(llm)
    assert not core.scheduler.running and not core.scheduler.waiting_for_kv
    assert not core.scheduler.held_for_send
    assert core.kv.num_free_blocks == core.kv.usable_blocks


@pytest.fixture(scope="module")
def reference(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", block_size=BLOCK)
    yield lambda prompts, params=GREEDY: _tokens(llm, prompts, params)
    llm.shutdown()


def test_a_prefix_computed_on_one_engine_is_loaded_by_another(tiny_llama, tmp_path, reference):
    prompts = [_prompt(1), _prompt(2, 40)]
    first = _engine(tiny_llama, tmp_path / "tier")
    try:
        assert _tokens(first, prompts) == reference(prompts)
        assert _core(first).kv_transfer.connector.worker.blocks_saved > 0
    finally:
        first.shutdown()  # the tier outlives the engine that wrote it
    second = _engine(tiny_llama, tmp_path / "tier")
    try:
        outs = second.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference(prompts)
        # every full block but the one holding the last prompt token came from the tier
        assert [o.num_cached_tokens for o in outs] == [56, 32]
        assert _core(second).kv_transfer.connector.worker.blocks_loaded == 7 + 4
        _assert_idle(second)
    finally:
        second.shutdown()


def test_the_host_tier_serves_what_the_pool_forgot(tiny_llama, reference):
    llm = _engine(tiny_llama)
    try:
        prompt = [_prompt(3)]
        assert _tokens(llm, prompt) == reference(prompt)
        assert llm.reset_prefix_cache() is True  # the pool forgets; the tier does not
        out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == reference(prompt)[0] and out.num_cached_tokens == 56
        _assert_idle(llm)
    finally:
        llm.shutdown()


def test_pool_hits_come_first_and_the_tier_continues_them(tiny_llama, reference):
    """A prompt sharing 3 blocks with one in the pool and 7 with one only in the tier
    takes 3 from the pool and the next 4 from the tier."""
    llm = _engine(tiny_llama)
    try:
        long = _prompt(4)
        _tokens(llm, [long])
        assert llm.reset_prefix_cache() is True
        _tokens(llm, [long[:25]])  # 3 blocks back in the pool
        worker = _core(llm).kv_transfer.connector.worker
        loaded = worker.blocks_loaded
        out = llm.generate([long], GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == reference([long])[0]
        assert worker.blocks_loaded - loaded == 4 and out.num_cached_tokens == 56
    finally:
        llm.shutdown()


def _corrupt_one(directory) -> None:
    files = sorted(directory.rglob("*.kv"))
    assert files, "the tier wrote no block"
    data = bytearray(files[0].read_bytes())
    data[-1] ^= 0xFF
    files[0].write_bytes(bytes(data))


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_corrupt_block_follows_the_load_failure_policy(tiny_llama, tmp_path, reference,
                                                         policy):
    prompt = [_prompt(5)]
    writer = _engine(tiny_llama, tmp_path / "tier")
    try:
        _tokens(writer, prompt)
    finally:
        writer.shutdown()
    for path in (tmp_path / "tier").rglob("*.kv"):  # every block corrupt: one is read
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    reader = _engine(tiny_llama, tmp_path / "tier", policy=policy)
    try:
        if policy == "recompute":
            out = reader.generate(prompt, GREEDY, use_tqdm=False)[0]
            assert out.outputs[0].token_ids == reference(prompt)[0]
        else:
            core = _core(reader)
            core.add_request(EngineCoreRequest("bad", prompt[0], GREEDY))
            ends = []
            while core.has_unfinished_requests():
                ends += [o for o in core.step() if o.finished]
            assert [o.finish_reason for o in ends] == ["error"]
            assert "corrupt" in ends[0].error and "kv_load_failure_policy" in ends[0].error
        assert _core(reader).kv_transfer.loads_failed == 1
        _assert_idle(reader)
        assert _tokens(reader, [_prompt(6)]) == reference([_prompt(6)])  # still serving
    finally:
        reader.shutdown()


def test_an_abort_while_the_kv_loads_leaks_nothing(tiny_llama, tmp_path, reference):
    prompt = _prompt(7)
    writer = _engine(tiny_llama, tmp_path / "tier")
    try:
        _tokens(writer, [prompt])
    finally:
        writer.shutdown()
    reader = _engine(tiny_llama, tmp_path / "tier")
    try:
        engine = reader.llm_engine
        engine.add_request("gone", prompt, GREEDY, OutputKind.DELTA)
        engine.step()  # admitted to wait for its blocks
        assert "gone" in _core(reader).scheduler.waiting_for_kv
        engine.abort_request(["gone"])
        while engine.has_unfinished_requests():
            engine.step()
        _assert_idle(reader)
        assert _tokens(reader, [prompt]) == reference([prompt])
    finally:
        reader.shutdown()


def test_the_tier_is_per_model(tiny_models, tmp_path):
    """Another checkpoint's engine sharing the directory never reads these blocks: the
    pool fingerprint names the folder."""
    prompt = [_prompt(8)]
    a = _engine(tiny_models["llama"], tmp_path / "tier")
    try:
        _tokens(a, prompt)
    finally:
        a.shutdown()
    folders = {p.name for p in (tmp_path / "tier").iterdir()}
    b = _engine(tiny_models["qwen2"], tmp_path / "tier")
    try:
        out = b.generate(prompt, GREEDY, use_tqdm=False)[0]
        assert out.num_cached_tokens == 0
        assert {p.name for p in (tmp_path / "tier").iterdir()} - folders  # its own folder
    finally:
        b.shutdown()


def _context(**changes) -> ConnectorContext:
    base = dict(caches=None, layout=KVLayout((1,), None, BLOCK, "f"), prefix_caching=True,
                kv_groups=1, state_blocks=False, tensor_parallel_size=1, block_major=True)
    return ConnectorContext(**{**base, **changes})


@pytest.mark.parametrize("change, named", [
    (dict(prefix_caching=False), "prefix caching is off"),
    (dict(tensor_parallel_size=2), "tensor parallelism"),
    (dict(state_blocks=True), "hybrid"),
    (dict(kv_groups=2), "separate block tables"),
    (dict(block_major=False), "head-major"),
])
def test_pools_the_connector_cannot_move_are_refused_by_name(change, named):
    with pytest.raises(InvalidRequestError, match=named):
        check_pool(_context(**change))


def test_unknown_extra_config_is_refused_by_name(tiny_llama):
    with pytest.raises(InvalidRequestError, match="'disk_size'"):
        _engine(tiny_llama, disk_size=3)


def test_a_full_tier_drops_its_oldest_blocks_and_serves_on(tiny_llama, tmp_path, reference):
    """Tiers far smaller than the load: they keep their most recent blocks, every
    request is still answered exactly, and nothing leaks. (A block this small a disk
    tier may evict between the lookup and the read is a lost load: recomputed here.)"""
    block_bytes = 2 * 2 * 2 * BLOCK * 16 * 4  # layers x (k, v) x kv heads x bs x dim x fp32
    llm = _engine(tiny_llama, tmp_path / "tier", policy="recompute",
                  cpu_bytes_to_use=3 * block_bytes, disk_bytes_to_use=3 * block_bytes)
    try:
        prompts = [_prompt(20 + i) for i in range(4)]
        assert _tokens(llm, prompts) == reference(prompts)
        store = _core(llm).kv_transfer.connector.worker.store
        assert len(store.host) <= 3 and store.host.evictions > 0
        assert llm.reset_prefix_cache() is True
        assert _tokens(llm, prompts) == reference(prompts)
        _assert_idle(llm)
    finally:
        llm.shutdown()


def test_blocks_computed_under_an_adapter_are_never_another_s(tiny_llama, tmp_path):
    """The tier's keys fold the adapter in: a base-model request never loads blocks an
    adapter request computed (nor the reverse)."""
    from engine.lora.request import LoRARequest
    from tests.test_lora import make_adapter
    make_adapter(tiny_llama, tmp_path / "adapter", 8, ["q_proj", "v_proj"], seed=1)
    adapter = tmp_path / "adapter"
    llm = LLM(str(tiny_llama), dtype="float32", block_size=BLOCK, enable_lora=True,
              max_lora_rank=8, kv_transfer_config={
                  "kv_connector": "OffloadingConnector", "kv_role": "kv_both"})
    try:
        prompt = _prompt(30)
        lora = LoRARequest("a", 1, str(adapter))
        llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)
        assert llm.reset_prefix_cache() is True
        base = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert base.num_cached_tokens == 0  # the adapter's blocks are not the base's
        assert llm.reset_prefix_cache() is True
        first = llm.llm_engine.engine_core.kv_transfer.connector.worker.blocks_loaded
        again = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0]
        assert again.num_cached_tokens == 56  # its own, from the tier
        assert _core(llm).kv_transfer.connector.worker.blocks_loaded - first == 7
    finally:
        llm.shutdown()


def test_chunked_prefill_and_n_2_through_the_tier(tiny_llama, tmp_path, reference):
    """Blocks saved chunk by chunk (a step budget of 16 tokens) load whole on another
    engine; a request with n=2 loads once and both sequences match the reference."""
    prompt = _prompt(40)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=8, n=2,
                             ignore_eos=True)

    def engine():
        return LLM(str(tiny_llama), dtype="float32", block_size=BLOCK,
                   max_num_batched_tokens=16, kv_transfer_config={
                       "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"disk_path": str(tmp_path / "t")}})
    first = engine()
    try:
        assert _tokens(first, [prompt]) == reference([prompt])
        expected = [c.token_ids for c in first.generate(
            [prompt], sampled, use_tqdm=False)[0].outputs]
    finally:
        first.shutdown()
    second = engine()
    try:
        out = second.generate([prompt], sampled, use_tqdm=False)[0]
        assert [c.token_ids for c in out.outputs] == expected
        assert out.num_cached_tokens == 56
        assert _tokens(second, [prompt]) == reference([prompt])
        _assert_idle(second)
    finally:
        second.shutdown()


def test_a_sliding_window_model_through_the_tier(tiny_tokenizer_dir, tmp_path_factory,
                                                 tmp_path):
    """Mistral with a 16-token window (its sequences give back slid-out blocks): the
    prefix is saved as it fills and loads on another engine with the same output."""
    from tests.conftest import build_tiny_model
    model = build_tiny_model(tmp_path_factory.mktemp("mistral-tier"), "mistral",
                             tiny_tokenizer_dir, sliding_window=16)
    prompt = [_prompt(50)]
    plain = LLM(str(model), dtype="float32", block_size=BLOCK, max_num_batched_tokens=16)
    try:
        expected = _tokens(plain, prompt)
    finally:
        plain.shutdown()
    first = _engine(model, tmp_path / "tier")
    try:
        assert _tokens(first, prompt) == expected
    finally:
        first.shutdown()
    second = _engine(model, tmp_path / "tier")
    try:
        out = second.generate(prompt, GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == expected[0] and out.num_cached_tokens == 56
        _assert_idle(second)
    finally:
        second.shutdown()
