"""Tensor parallelism on CPU (gloo): TP=2/3 greedy output equals TP=1, shards are 1/tp of
the weights, bad sizes are refused, and a dead worker fails the engine fast."""
import os
import signal

import pytest

from engine import LLM, SamplingParams
from engine.errors import EngineDeadError, InvalidRequestError
from tests.conftest import build_tiny_model
from tests.test_parity import _prompts

NEW_TOKENS = 32


def _greedy(llm, prompts, n=NEW_TOKENS):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def tiny_mqa(tmp_path_factory, default_model_dir):
    """4 heads, 1 KV head: under TP=2 the KV head is replicated on both ranks."""
    return build_tiny_model(tmp_path_factory.mktemp("mqa") / "llama", "llama",
                            default_model_dir, num_key_value_heads=1)


def _prompt_logprobs(llm, prompts) -> list[list[float]]:
    """Each prompt token's logprob (from the second on)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    return [[e[t].logprob for t, e in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])]
            for o in llm.generate(prompts, params, use_tqdm=False)]


def _tp_vs_single(model_dir, tp, **engine_kwargs):
    prompts = _prompts([70, 33, 5, 100, 17])
    single = LLM(str(model_dir), dtype="float32", **engine_kwargs)
    expected = _greedy(single, prompts)
    expected_lp = _prompt_logprobs(single, prompts[:2])
    llm = LLM(str(model_dir), dtype="float32", tensor_parallel_size=tp, **engine_kwargs)
    try:
        assert _greedy(llm, prompts) == expected
        for got, want in zip(_prompt_logprobs(llm, prompts[:2]), expected_lp):
            assert got == pytest.approx(want, abs=1e-4)
        usage = llm.llm_engine.engine_core.get_memory_usage()
        whole = single.llm_engine.engine_core.get_memory_usage()["weights_bytes"]
        return usage, whole
    finally:
        llm.shutdown()


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_mqa"])
def test_tp2_matches_tp1_with_batching_and_chunked_prefill(model, request):
    usage, whole = _tp_vs_single(request.getfixturevalue(model), 2,
                                 max_num_batched_tokens=48, block_size=8)
    per_rank = usage["per_rank_weights_bytes"]
    assert len(per_rank) == 2
    # each rank holds about half: the sharded matrices halve, norms are replicated
    for b in per_rank:
        assert 0.4 * whole < b < 0.6 * whole


def test_smollm2_tp3_matches_tp1(default_model_dir):
    """9 heads / 3 KV heads / vocab 49152 split three ways, the weights GGUF blocks (each
    rank reads its rows, and its block columns of o and down). Teacher-forced on one
    rank's greedy continuations, every position's logprob agrees: the ranks' partial sums
    only add in another order. (Free-running greedy text of random token ids is digit
    runs full of near ties, where that order alone can flip a pick.)"""
    prompts = _prompts([12, 40, 7], seed=3)
    kwargs = dict(dtype="float32", max_model_len=512)
    single = LLM("default", **kwargs)
    full = [p + list(t) for p, t in zip(prompts, _greedy(single, prompts))]
    expected = _prompt_logprobs(single, full)
    llm = LLM("default", tensor_parallel_size=3, **kwargs)
    try:
        for got, want in zip(_prompt_logprobs(llm, full), expected):
            assert got == pytest.approx(want, abs=2e-3)
        per_rank = llm.llm_engine.engine_core.get_memory_usage()["per_rank_weights_bytes"]
        assert len(per_rank) == 3 and max(per_rank) < 0.4 * sum(per_rank)
    finally:
        llm.shutdown()


def test_indivisible_heads_are_refused(tiny_llama):
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size=3 does not divide"):
        LLM(str(tiny_llama), dtype="float32", tensor_parallel_size=3)


def test_sleep_and_wake_reach_every_rank(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", tensor_parallel_size=2)
    core = llm.llm_engine.engine_core
    try:
        before = _greedy(llm, _prompts([9]), 8)
        core.sleep(2)
        usage = core.get_memory_usage()
        assert usage["per_rank_weights_bytes"] == [0, 0]
        assert usage["per_rank_kv_cache_bytes"] == [0, 0]
        core.wake_up()
        usage = core.get_memory_usage()
        assert all(b > 0 for b in usage["per_rank_weights_bytes"])
        assert all(b > 0 for b in usage["per_rank_kv_cache_bytes"])
        assert _greedy(llm, _prompts([9]), 8) == before
    finally:
        llm.shutdown()


def test_killed_worker_fails_the_engine_fast(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", tensor_parallel_size=2)
    core = llm.llm_engine.engine_core
    try:
        _greedy(llm, _prompts([5]), 4)
        worker = core.runner.launcher.procs[1]
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(10)
        with pytest.raises(EngineDeadError, match="rank 1"):
            _greedy(llm, _prompts([5]), 4)
        with pytest.raises(EngineDeadError):  # and stays dead, without hanging
            _greedy(llm, _prompts([6]), 4)
    finally:
        llm.shutdown()


def test_served_tp_engine_fails_requests_and_reports_unhealthy_when_a_worker_dies(tiny_llama):
    """Through the engine-core server: in-flight streams end with EngineDeadError, new
    requests are refused with it, and alive() (the replica's health check) turns False."""
    import asyncio
    import socket

    from engine.config import EngineConfig
    from engine.core.engine_core import EngineCore
    from engine.model.loader import load_tokenizer
    from engine.wire.core_client import EngineClient
    from engine.wire.core_server import EngineCoreServer

    core = EngineCore(EngineConfig(model=str(tiny_llama), dtype="float32",
                                   tensor_parallel_size=2))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    server = EngineCoreServer(core, address, 0, heartbeat_interval_s=0.2).start()

    async def main():
        client = await EngineClient.connect([address], load_tokenizer(tiny_llama),
                                            handshake_timeout_s=10)
        long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        try:
            stream = client.generate("victim", _prompts([20])[0], long)
            await stream.__anext__()  # running
            os.kill(core.runner.launcher.procs[1].pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="rank 1"):
                async for _ in stream:
                    pass
            with pytest.raises(EngineDeadError):
                async for _ in client.generate("after", _prompts([5])[0], long):
                    pass
        finally:
            await client.shutdown()

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
        assert not server.alive()
    finally:
        server.shutdown()
    assert core.runner.launcher.dead()  # the surviving worker was stopped too
