"""The async engine client against mock engines: routing, handshake values, utilities, death."""
import asyncio
import signal
import socket
import subprocess
import sys
import time

import pytest

from engine import SamplingParams
from engine.errors import (
    EngineDeadError,
    EngineDrainingError,
    InconsistentUtilityResults,
    NoEnginesError,
)
from engine.mock.config import MockConfig
from engine.mock.core import MockEngineCore
from engine.model.loader import load_tokenizer
from engine.wire.core_client import EngineClient, HandshakeError
from engine.wire.core_server import EngineCoreServer
from engine.wire.utility_results import all_true, consensus


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


class Engines:
    """Mock engine-core servers in this process, stopped at the end of a test."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.servers, self.cores, self.addresses = [], [], []

    def add(self, **options) -> MockEngineCore:
        index = len(self.cores)
        config = MockConfig(engine_index=index, vocab_size=len(self.tokenizer), **options)
        core = MockEngineCore(config)
        address = free_address()
        self.servers.append(EngineCoreServer(core, address, index,
                                             heartbeat_interval_s=0.2).start())
        self.cores.append(core)
        self.addresses.append(address)
        return core

    async def client(self, **kwargs) -> EngineClient:
        return await EngineClient.connect(self.addresses, self.tokenizer,
                                          handshake_timeout_s=5, **kwargs)

    def stop(self):
        for s in self.servers:
            s.shutdown()


@pytest.fixture
def engines(tokenizer):
    e = Engines(tokenizer)
    yield e
    e.stop()


async def _tokens(client, request_id, prompt, params, rank=None):
    tokens, chunks = [], 0
    async for out in client.generate(request_id, prompt, params, data_parallel_rank=rank):
        tokens += out.outputs[0].token_ids
        chunks += 1
    return tokens, chunks


def test_two_engines_share_load_and_explicit_rank_wins(engines):
    engines.add(itl_s=0.01)
    engines.add(itl_s=0.01)
    params = SamplingParams(max_tokens=8, ignore_eos=True)

    async def main():
        client = await engines.client()
        assert len({e.ready.engine_index for e in client.engines}) == 2
        spread = await asyncio.gather(*(_tokens(client, f"r{i}", [10, 11, 12], params)
                                        for i in range(6)))
        pinned = await _tokens(client, "pinned", [10, 11, 12], params, rank=1)
        await client.shutdown()
        return spread, pinned

    spread, pinned = asyncio.run(main())
    assert all(len(t) == 8 for t, _ in spread)
    # mock tokens depend on the engine index: the pinned request ran on rank 1
    solo = MockEngineCore(MockConfig(engine_index=1, vocab_size=len(engines.tokenizer)))
    from engine.core_messages import EngineCoreRequest
    solo.add_request(EngineCoreRequest("pinned", [10, 11, 12], params))
    expected = []
    while solo.has_unfinished_requests():
        expected += [t for o in solo.step() for t in o.new_token_ids]
    assert pinned[0] == expected
    assert all(core.get_stats().num_running_reqs == 0 for core in engines.cores)


def test_requests_spread_over_both_engines(engines):
    a = engines.add(itl_s=0.02)
    b = engines.add(itl_s=0.02)
    seen = {0: 0, 1: 0}
    for index, core in enumerate((a, b)):
        original = core.add_request

        def counting(req, _orig=original, _i=index):
            seen[_i] += 1
            return _orig(req)
        core.add_request = counting
    params = SamplingParams(max_tokens=5, ignore_eos=True)

    async def main():
        client = await engines.client()
        await asyncio.gather(*(_tokens(client, f"s{i}", [7, 8], params) for i in range(8)))
        await client.shutdown()

    asyncio.run(main())
    assert seen == {0: 4, 1: 4}


def test_a_draining_engine_refusal_is_retried_on_another_engine(engines):
    """Downscale: an engine that is shutting down refuses new requests; the client sends
    them to the other engine instead of failing them, and stops picking the drainer."""
    engines.add()
    engines.add()
    params = SamplingParams(max_tokens=4, ignore_eos=True, n=2)

    async def main():
        client = await engines.client()
        try:
            assert engines.servers[0].drain(timeout=1.0)  # nothing in flight: returns at once
            async def count(request_id):
                n = 0
                async for out in client.generate(request_id, [7, 8], params):
                    n += sum(len(o.token_ids) for o in out.outputs)
                return n
            counts = await asyncio.gather(*(count(f"d{i}") for i in range(6)))
            assert counts == [8] * 6  # n=2 x 4 tokens each, none lost to the drainer
            assert client.engines[0].draining and not client.engines[1].draining
            with pytest.raises(EngineDrainingError):  # an explicit rank is not rerouted
                await _tokens(client, "pinned", [7], params, rank=0)
        finally:
            await client.shutdown()

    asyncio.run(main())
    assert engines.cores[1].get_stats().num_running_reqs == 0


def test_chunk_size_one_streams_per_token_and_larger_chunks_group(engines):
    # paced, so that the consumer keeps up (a consumer behind gets merged outputs)
    engines.add(output_chunk_size=1, itl_s=0.02)
    engines.add(output_chunk_size=4, itl_s=0.02)
    params = SamplingParams(max_tokens=10, ignore_eos=True)

    async def main():
        client = await engines.client()
        one = await _tokens(client, "one", [5, 6], params, rank=0)
        four = await _tokens(client, "four", [5, 6], params, rank=1)
        await client.shutdown()
        return one, four

    (t1, c1), (t4, c4) = asyncio.run(main())
    assert len(t1) == 10 and c1 == 10
    assert len(t4) == 10 and c4 == 3


def test_a_consumer_behind_the_engine_gets_merged_outputs_in_order(engines):
    """Outputs queued while the consumer was busy come as one (as vLLM's frontend
    does): fewer SSE events under load, every token and character in order."""
    engines.add(itl_s=0.005)
    engines.add(itl_s=0.005)
    params = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=1)

    async def collect(client, request_id, pause_s):
        outs = []
        async for out in client.generate(request_id, [5, 6, 7], params, data_parallel_rank=0):
            outs.append(out)
            await asyncio.sleep(pause_s)  # a slow SSE writer
        return outs

    async def main():
        client = await engines.client()
        fast = await collect(client, "r", 0)
        slow = await collect(client, "r", 0.05)  # same id and engine: same tokens
        await client.shutdown()
        return fast, slow

    fast, slow = asyncio.run(main())
    assert len(slow) < len(fast) / 3
    for outs in (fast, slow):
        tokens = [t for o in outs for t in o.outputs[0].token_ids]
        assert len(tokens) == 40
        assert sum(len(o.outputs[0].logprobs) for o in outs) == 40
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].outputs[0].finish_reason == "length"
    # the mock's tokens are a pure function of (engine, request id, position)
    assert [t for o in slow for t in o.outputs[0].token_ids] == \
        [t for o in fast for t in o.outputs[0].token_ids]
    assert "".join(o.outputs[0].text for o in slow) == "".join(o.outputs[0].text for o in fast)


def test_ready_values_come_from_the_engines(engines):
    engines.add(block_size=32, max_model_len=1000, num_blocks=100)
    engines.add(block_size=32, max_model_len=2000, num_blocks=50)

    async def main():
        client = await engines.client()
        values = client.block_size, client.max_model_len, client.num_gpu_blocks
        await client.shutdown()
        return values

    assert asyncio.run(main()) == (32, 1000, 150)


def test_block_size_disagreement_fails_at_connect(engines):
    engines.add(block_size=16)
    engines.add(block_size=32)
    with pytest.raises(HandshakeError, match="block_size"):
        asyncio.run(engines.client())


def test_utility_aggregation(engines):
    engines.add()
    engines.add(force_is_sleeping=True, force_reset_prefix_cache=False)

    async def main():
        client = await engines.client()
        with pytest.raises(InconsistentUtilityResults) as info:
            await client.is_sleeping()
        values = info.value.values
        reset = await client.reset_prefix_cache()
        per_engine = await client.call_utility("get_supported_tasks")
        await client.shutdown()
        return values, reset, per_engine

    values, reset, per_engine = asyncio.run(main())
    assert values == [False, True]
    assert reset is False
    assert per_engine == [["generate"], ["generate"]]


def test_a_client_without_a_tokenizer_makes_utility_calls_and_refuses_requests(engines):
    """The coordinator's client: utilities and liveness only, no tokenizer to load (it
    loaded one on its first utility call, seconds on the event loop, which held a new
    server's first /v1/models for 3-5 s)."""
    engines.add()
    engines.add(force_reset_prefix_cache=False)

    async def main():
        client = await EngineClient.connect(engines.addresses, handshake_timeout_s=5)
        try:
            assert client.processor is None and client.output_processor is None
            sleeping = await client.is_sleeping()
            reset = await client.reset_prefix_cache()
            await asyncio.sleep(0.5)  # heartbeats come in and are taken without a processor
            with pytest.raises(RuntimeError, match="without a tokenizer"):
                async for _ in client.generate("r", [5, 6], SamplingParams(max_tokens=2)):
                    pass
            await client.abort(["r"])
            return sleeping, reset, client.healthy
        finally:
            await client.shutdown()

    assert asyncio.run(main()) == (False, False, True)


def test_utility_agreement_and_no_engines(engines):
    engines.add()
    engines.add()

    async def main():
        client = await engines.client()
        result = await client.is_sleeping(), await client.reset_prefix_cache()
        await client.shutdown()
        return result

    assert asyncio.run(main()) == (False, True)
    with pytest.raises(NoEnginesError):
        consensus("is_sleeping", [])
    with pytest.raises(NoEnginesError):
        all_true("reset_prefix_cache", [])
    with pytest.raises(NoEnginesError):
        asyncio.run(EngineClient.connect([], engines.tokenizer))


def test_handshake_times_out_on_a_silent_address(tokenizer):
    with pytest.raises(HandshakeError, match="did not answer"):
        asyncio.run(EngineClient.connect([free_address()], tokenizer, handshake_timeout_s=0.5))


def _mock_engine_process(address: str, tokenizer) -> subprocess.Popen:
    """A mock engine-core server in its own process (so that it can be SIGKILLed)."""
    return subprocess.Popen([sys.executable, "-m", "engine.mock", "--address", address,
                             "--vocab-size", str(len(tokenizer)), "--itl-s", "0.05"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_killed_engine_ends_streams_with_engine_dead_error(tokenizer):
    address = free_address()
    proc = _mock_engine_process(address, tokenizer)
    try:
        async def main():
            client = await EngineClient.connect(
                [address], tokenizer, handshake_timeout_s=30, heartbeat_timeout_s=2.0,
                is_alive=[lambda: proc.poll() is None])
            params = SamplingParams(max_tokens=1000, ignore_eos=True)
            streams = [client.generate(f"k{i}", [5, 6, 7], params) for i in range(3)]
            for s in streams:
                await s.__anext__()
            proc.send_signal(signal.SIGKILL)
            start = time.monotonic()
            errors = []
            for s in streams:
                try:
                    async for _ in s:
                        pass
                except EngineDeadError as exc:
                    errors.append(exc)
            elapsed = time.monotonic() - start
            healthy = client.healthy
            with pytest.raises(EngineDeadError):
                async for _ in client.generate("late", [1, 2], params):
                    pass
            await client.shutdown()
            return errors, elapsed, healthy

        errors, elapsed, healthy = asyncio.run(main())
        assert len(errors) == 3 and elapsed < 60  # failed, not hung (generous on 2 cores)
        assert not healthy
    finally:
        proc.kill()
        proc.wait()


def test_a_dropped_connection_is_noticed_before_the_heartbeat_timeout(tokenizer):
    """No process handle (a remote engine) and a 120 s heartbeat timeout: the TCP
    disconnect of a killed engine still ends its streams within seconds."""
    address = free_address()
    proc = _mock_engine_process(address, tokenizer)
    try:
        async def main():
            client = await EngineClient.connect([address], tokenizer, handshake_timeout_s=30,
                                                heartbeat_timeout_s=120.0)
            try:
                stream = client.generate("r", [5, 6], SamplingParams(max_tokens=5000,
                                                                      ignore_eos=True))
                await stream.__anext__()
                proc.send_signal(signal.SIGKILL)

                async def drain():
                    async for _ in stream:
                        pass
                with pytest.raises(EngineDeadError, match="silent"):
                    await asyncio.wait_for(drain(), 30)  # far below the 120 s timeout
                assert not client.healthy
            finally:
                await client.shutdown()

        asyncio.run(main())
    finally:
        proc.kill()
        proc.wait()


def test_explicit_abort_and_a_mixed_queue(engines):
    core = engines.add(itl_s=0.01, max_num_seqs=3)
    mixed = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 20, 7, 1, 12)]

    async def main():
        client = await engines.client()
        tasks = [asyncio.create_task(_tokens(client, f"m{i}", [4, 5, 6], p))
                 for i, p in enumerate(mixed)]
        victim = client.generate("victim", [9, 9], SamplingParams(max_tokens=500,
                                                                  ignore_eos=True))
        await victim.__anext__()
        stats = await client.get_stats()
        await client.abort(["victim"])
        with pytest.raises(Exception, match="aborted"):
            async for _ in victim:
                pass
        results = await asyncio.gather(*tasks)
        await asyncio.sleep(0.1)
        await client.shutdown()
        return results, stats

    results, stats = asyncio.run(main())
    assert [len(t) for t, _ in results] == [3, 20, 7, 1, 12]
    assert stats[0].num_running_reqs + stats[0].num_waiting_reqs >= 1
    assert not core.has_unfinished_requests()


def test_draining_engine_finishes_in_flight_and_refuses_new(engines):
    from engine.errors import EngineDrainingError
    engines.add(itl_s=0.01)

    async def main():
        client = await engines.client()
        params = SamplingParams(max_tokens=30, ignore_eos=True)
        running = asyncio.create_task(_tokens(client, "in-flight", [5, 6], params))
        await asyncio.sleep(0.05)
        loop = asyncio.get_running_loop()
        drained = loop.run_in_executor(None, engines.servers[0].drain, 10.0)
        while not engines.servers[0]._draining.is_set():
            await asyncio.sleep(0.01)
        with pytest.raises(EngineDrainingError):
            await _tokens(client, "new", [5, 6], params)
        tokens, _ = await running
        result = await drained
        await client.shutdown()
        return tokens, result

    tokens, finished_cleanly = asyncio.run(main())
    assert len(tokens) == 30 and finished_cleanly is True


def test_a_drain_keeps_refusing_for_its_settle_time_when_nothing_is_in_flight(engines):
    """A leaving engine with nothing in flight still refuses (rather than dropping) what
    clients send during the settle time, so they resubmit elsewhere."""
    from engine.errors import EngineDrainingError
    engines.add(itl_s=0.01)

    async def main():
        client = await engines.client()
        loop = asyncio.get_running_loop()
        drained = loop.run_in_executor(None, lambda: engines.servers[0].drain(5.0, min_s=1.5))
        started = time.monotonic()
        while not engines.servers[0]._draining.is_set():
            await asyncio.sleep(0.01)
        with pytest.raises(EngineDrainingError):
            await _tokens(client, "late", [5, 6], SamplingParams(max_tokens=4))
        still_draining = not drained.done() or time.monotonic() - started >= 1.5
        result = await drained
        await client.shutdown()
        return result, still_draining

    finished_cleanly, lingered = asyncio.run(main())
    assert finished_cleanly is True
    assert lingered  # nothing was in flight, yet the drain did not end before min_s


def test_the_abort_loop_survives_a_failing_send_and_retries(engines, caplog):
    """A send that raises (here zmq.Again, as past the high-water mark) is logged and
    retried; the loop goes on, so later dropped streams are aborted too."""
    import zmq

    from engine.wire.protocol import ABORT
    core = engines.add(itl_s=0.01)

    async def main():
        client = await engines.client()
        socket = client.engines[0].socket
        real_send, failures = socket.send_multipart, []

        async def flaky_send(frames, *args, **kwargs):
            if frames[0] == ABORT and len(failures) < 2:
                failures.append(frames)
                raise zmq.Again("resource temporarily unavailable")
            return await real_send(frames, *args, **kwargs)

        socket.send_multipart = flaky_send
        params = SamplingParams(max_tokens=100_000, ignore_eos=True)
        for round_ in range(2):  # the second round runs after the failures
            streams = [client.generate(f"d{round_}-{i}", [3, 4], params) for i in range(4)]
            for s in streams:
                await s.__anext__()
            for s in streams:
                await s.aclose()  # dropped streams: their aborts go through the loop
            deadline = time.monotonic() + 5
            while core.has_unfinished_requests() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not core.has_unfinished_requests(), f"round {round_}: still generating"
        abort_loop = next(t for t in client._tasks  # noqa: SLF001 - the task under test
                          if t.get_name() == "abort-loop")
        loop_alive = not abort_loop.done()
        result = (len(failures), client.abort_send_failures, client.abort_causes, loop_alive)
        await client.shutdown()
        return result

    with caplog.at_level("WARNING", logger="engine.wire.core_client"):
        sent_failures, counted, causes, loop_alive = asyncio.run(main())
    assert sent_failures == 2 and counted == 2 and loop_alive
    assert causes["client_disconnect"] == 8  # counted once each, not once per retry
    assert "retrying" in caplog.text


def test_the_mock_answers_the_frontend_utilities_as_no_ops(engines):
    """vLLM's frontends also send profile, reset_mm_cache, reset_encoder_cache and
    execute_dummy_batch: the mock answers them; an unknown name is still refused."""
    from engine.errors import UtilityCallError
    engines.add()
    engines.add()

    async def main():
        client = await engines.client()
        try:
            answers = [await client.call_utility(m) for m in
                       ("reset_mm_cache", "reset_encoder_cache", "execute_dummy_batch")]
            answers.append(await client.call_utility("profile", True))
            answers.append(await client.call_utility("profile", is_start=False))
            with pytest.raises(UtilityCallError, match="unknown method 'frobnicate'"):
                await client.call_utility("frobnicate")
            tokens, _ = await _tokens(client, "after", [1, 2], SamplingParams(
                max_tokens=3, ignore_eos=True))  # still serving
            return answers, tokens
        finally:
            await client.shutdown()

    answers, tokens = asyncio.run(main())
    assert answers == [[True, True], [None, None], [None, None], [None, None], [None, None]]
    assert len(tokens) == 3


def _finishes(coro_fn, within_s: float) -> list:
    """Run coro_fn() on an event loop of its own thread; what it returned or raised, or []
    if the loop is still blocked after within_s (a daemon thread, left behind)."""
    import threading
    result: list = []

    def run():
        try:
            result.append(asyncio.run(coro_fn()))
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            result.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(within_s)
    return result


def test_a_cancelled_handshake_leaves_the_event_loop_free(tokenizer):
    """A caller that gives up during the handshake (a readiness probe's timeout cancels
    the coordinator's call) gets its cancellation; the loop goes on. Before, the
    handshake's socket stayed open and closing the context blocked the loop for good."""
    async def give_up():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(EngineClient.connect([free_address()], tokenizer,
                                                        handshake_timeout_s=30), 0.3)
        await asyncio.sleep(0.05)  # the loop still runs
        return "free"

    assert _finishes(give_up, 10) == ["free"]


def test_one_silent_engine_fails_the_connect_without_blocking(engines):
    """One engine answers, the other never does: the connect fails with HandshakeError
    and the answered engine's socket is closed too (before, it kept the loop blocked)."""
    engines.add()

    async def connect():
        return await EngineClient.connect([engines.addresses[0], free_address()],
                                          engines.tokenizer, handshake_timeout_s=0.5)

    result = _finishes(connect, 10)
    assert len(result) == 1 and isinstance(result[0], HandshakeError), result


def test_a_stall_of_the_clients_own_loop_declares_no_engine_dead(tokenizer):
    """An ingress SIGSTOPped for 15 s (the chaos run) woke up before its ZMQ io thread
    had read what the engines sent meanwhile, found every engine silent for 15 s and
    declared them all dead, failing its streams. After a stall of its own the client now
    gives each engine a new heartbeat timeout; a silent engine is still declared dead
    after that. (The engine's heartbeats stop with the stall here, as if none had
    arrived yet.)"""
    import threading
    core = MockEngineCore(MockConfig(vocab_size=len(tokenizer)))
    address = free_address()
    server = EngineCoreServer(core, address, heartbeat_interval_s=0.2).start()
    quiet, resume = threading.Event(), threading.Event()
    real_stats = server._safe_stats

    def stats():  # the io thread builds each heartbeat with these
        if quiet.is_set():
            resume.wait(10)
        return real_stats()
    server._safe_stats = stats

    async def main():
        client = await EngineClient.connect([address], tokenizer, handshake_timeout_s=5,
                                            heartbeat_timeout_s=1.0)
        try:
            await asyncio.sleep(1.5)
            before = client.engines[0].dead
            quiet.set()
            time.sleep(2.5)  # the event loop stopped, as by SIGSTOP
            await asyncio.sleep(0.3)
            after_stall = client.engines[0].dead
            await asyncio.sleep(1.5)
            return before, after_stall, client.engines[0].dead
        finally:
            resume.set()
            await client.shutdown()

    try:
        assert asyncio.run(main()) == (False, False, True)
    finally:
        resume.set()
        server.shutdown()


def test_a_scrape_asks_the_engines_for_stats_only_when_the_last_are_old(tokenizer):
    """/metrics used to ask every engine for its stats on each scrape, so a scrape waited
    on the busiest engine's loop; outputs and heartbeats bring stats at least every
    heartbeat interval, so refresh_stats asks only when one engine's are older."""
    core = MockEngineCore(MockConfig(vocab_size=len(tokenizer)))
    address = free_address()
    server = EngineCoreServer(core, address, heartbeat_interval_s=60).start()

    async def main():
        client = await EngineClient.connect([address], tokenizer, handshake_timeout_s=10)
        calls = []
        real = client.call_utility

        async def counted(method, *args, **kwargs):
            calls.append(method)
            return await real(method, *args, **kwargs)
        client.call_utility = counted
        try:
            client.engines[0].stats_at = 0.0  # as if none came yet
            await client.refresh_stats(max_age_s=30, timeout_s=10)
            asked = list(calls)
            assert client.engines[0].stats is not None
            await client.refresh_stats(max_age_s=30, timeout_s=10)  # fresh: not asked
            return asked, list(calls)
        finally:
            await client.shutdown()

    try:
        asked, after = asyncio.run(main())
    finally:
        server.shutdown()
    assert asked == ["get_stats"] and after == ["get_stats"]
