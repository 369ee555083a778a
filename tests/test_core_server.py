"""Engine-core server + async client with the real engine (tiny model) behind them."""
import asyncio
import socket
import time

import pytest
import zmq
import zmq.asyncio

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.errors import EngineRequestError, EngineSleepingError
from engine.model.loader import load_tokenizer
from engine.wire.core_client import EngineClient
from engine.wire.core_server import EngineCoreServer
from engine.wire.protocol import ADD

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], list(range(300, 340)), [1000, 1001]]


def free_tcp_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class RecordingCore(EngineCore):
    """The real engine core, recording every ABORT it receives."""

    def __init__(self, config):
        super().__init__(config)
        self.abort_calls: list[tuple[float, list[str]]] = []

    def abort_requests(self, request_ids):
        self.abort_calls.append((time.monotonic(), list(request_ids)))
        super().abort_requests(request_ids)


@pytest.fixture(scope="module", params=["tcp", "ipc"])
def served(request, tiny_llama, tmp_path_factory):
    core = RecordingCore(EngineConfig(model=str(tiny_llama), dtype="float32", block_size=8))
    if request.param == "tcp":
        address = free_tcp_address()
    else:
        address = f"ipc://{tmp_path_factory.mktemp('ipc')}/engine.sock"
    server = EngineCoreServer(core, address).start()
    yield core, address, server
    server.shutdown()


def run(coro):
    return asyncio.run(coro)


async def _connect(core, address):
    return await EngineClient.connect([address], load_tokenizer(core.checkpoint),
                                      handshake_timeout_s=10)


async def _collect(client, request_id, prompt, params):
    tokens, chunks = [], 0
    async for out in client.generate(request_id, prompt, params):
        tokens += out.outputs[0].token_ids
        chunks += 1
    return tokens, chunks, out


def test_greedy_through_client_equals_offline_llm(served, tiny_llama):
    core, address, _ = served
    expected = [o.outputs[0].token_ids for o in LLM(str(tiny_llama), dtype="float32").generate(
        PROMPTS, GREEDY, use_tqdm=False)]

    async def main():
        client = await _connect(core, address)
        assert client.block_size == 8 and client.max_model_len == core.max_model_len
        results = await asyncio.gather(*(_collect(client, f"p{i}", p, GREEDY)
                                         for i, p in enumerate(PROMPTS)))
        await client.shutdown()
        return results

    results = run(main())
    assert [r[0] for r in results] == expected
    # a chunk per step while the consumer keeps up; what it falls behind on is merged
    assert all(1 <= chunks <= 12 for _, chunks, _ in results)
    assert all(out.outputs[0].finish_reason == "length" for *_, out in results)
    assert core.kv.num_free_blocks == core.kv.num_blocks


def test_dropped_streams_abort_in_one_message(served):
    core, address, _ = served

    async def main():
        client = await _connect(core, address)
        long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        streams = [client.generate(f"drop{i}", PROMPTS[0], long) for i in range(3)]
        for s in streams:
            await s.__anext__()  # each is running at the engine
        core.abort_calls.clear()
        for s in streams:
            await s.aclose()
        await asyncio.sleep(0.3)
        await client.shutdown()
        return client

    client = run(main())
    assert len(core.abort_calls) == 1
    assert sorted(core.abort_calls[0][1]) == ["drop0", "drop1", "drop2"]
    assert client.abort_causes["client_disconnect"] == 3
    deadline = time.monotonic() + 5
    while core.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert core.kv.num_free_blocks == core.kv.num_blocks


def test_stop_string_aborts_at_engine(served):
    core, address, _ = served

    async def main():
        client = await _connect(core, address)
        free, _, out = await _collect(client, "free", PROMPTS[1], GREEDY)
        tok = client.processor.tokenizer
        full = tok.decode(free)
        stop = full[len(full) // 2:len(full) // 2 + 2]
        core.abort_calls.clear()
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, stop=[stop])
        pieces = []
        async for o in client.generate("stopped", PROMPTS[1], params):
            pieces.append(o.outputs[0].text)
        await asyncio.sleep(0.2)
        await client.shutdown()
        return full, stop, "".join(pieces), o, client

    full, stop, text, last, client = run(main())
    assert text == full[:full.find(stop)]
    assert last.outputs[0].finish_reason == "stop" and last.outputs[0].stop_reason == stop
    assert [ids for _, ids in core.abort_calls] == [["stopped"]]
    assert client.abort_causes["stop_string"] == 1


def test_bad_input_gets_error_output_and_engine_keeps_serving(served):
    core, address, _ = served
    import msgspec

    from engine.errors import PromptTooLongError
    from engine.core_messages import EngineCoreOutputs, EngineCoreRequest
    from engine.wire.protocol import HELLO, PROTOCOL_VERSION, READY, Hello

    async def main():
        client = await _connect(core, address)
        with pytest.raises(PromptTooLongError):  # caught by the client's own checks
            await _collect(client, "long", list(range(100, 100 + core.max_model_len)), GREEDY)
        slow = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        running = client.generate("dup", PROMPTS[0], slow)
        first = await running.__anext__()  # may already hold several merged tokens
        tokens = list(first.outputs[0].token_ids)
        with pytest.raises(EngineRequestError, match="already running"):
            await _collect(client, "dup", PROMPTS[0], GREEDY)

        # a second, raw connection sends garbage and requests the engine must refuse
        ctx = zmq.asyncio.Context()
        raw = ctx.socket(zmq.DEALER)
        raw.connect(address)
        enc = msgspec.msgpack.encode
        await raw.send_multipart([HELLO, enc(Hello("raw", PROTOCOL_VERSION))])
        kind, _ = await asyncio.wait_for(raw.recv_multipart(), 5)
        assert kind == READY
        await raw.send_multipart([ADD, b"\xc1garbage"])
        await raw.send_multipart([b"\x7f", b"\x00"])
        await raw.send_multipart([b"only one frame"])
        await raw.send_multipart([ADD, enc(EngineCoreRequest("dup", [1, 2, 3], GREEDY))])
        too_long = list(range(100, 100 + core.max_model_len))
        await raw.send_multipart([ADD, enc(EngineCoreRequest("raw-long", too_long, GREEDY))])
        errors = {}
        while len(errors) < 2:
            kind, payload = await asyncio.wait_for(raw.recv_multipart(), 5)
            msg = msgspec.msgpack.decode(payload, type=EngineCoreOutputs)
            for out in msg.outputs:
                errors[out.request_id] = (out.finish_reason, out.error)
        raw.close(0)
        ctx.term()

        async for out in running:  # the client's "dup" is untouched by the raw duplicate
            tokens += out.outputs[0].token_ids
        after, _, _ = await _collect(client, "after", PROMPTS[0], GREEDY)
        await client.shutdown()
        return errors, tokens, after

    errors, tokens, after = run(main())
    assert errors["dup"][0] == "error" and "Duplicate" in errors["dup"][1]
    assert errors["raw-long"][0] == "error" and "PromptTooLong" in errors["raw-long"][1]
    assert len(tokens) == 60 and len(after) == 12


def test_sleep_frees_memory_and_refuses_requests(served):
    core, address, _ = served

    async def main():
        client = await _connect(core, address)
        before = (await client.call_utility("get_memory_usage"))[0]
        await client.call_utility("sleep", 2)
        asleep = (await client.call_utility("get_memory_usage"))[0]
        assert await client.is_sleeping() is True
        with pytest.raises(EngineSleepingError, match="asleep"):
            await _collect(client, "zz", PROMPTS[0], GREEDY)
        await client.call_utility("wake_up")
        assert await client.is_sleeping() is False
        tokens, _, _ = await _collect(client, "awake", PROMPTS[0], GREEDY)
        assert await client.reset_prefix_cache() is True
        await client.shutdown()
        return before, asleep, tokens

    before, asleep, tokens = run(main())
    assert before["weights_bytes"] > 0 and before["kv_cache_bytes"] > 0
    assert asleep == {"weights_bytes": 0, "kv_cache_bytes": 0}
    assert len(tokens) == 12


def _thread_cpu_ticks(thread) -> int:
    """utime + stime of one thread, in clock ticks (Linux /proc)."""
    with open(f"/proc/self/task/{thread.native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def test_idle_server_does_not_spin(served):
    import os
    _, _, server = served
    threads = server._threads + [server._loop_thread]
    assert all(t.is_alive() for t in threads)
    start = [_thread_cpu_ticks(t) for t in threads]
    time.sleep(1.0)
    used = sum(_thread_cpu_ticks(t) for t in threads) - sum(start)
    # a spinning loop would burn ~1 s of CPU (100+ ticks); blocked threads use ~none
    assert used < 0.1 * os.sysconf("SC_CLK_TCK"), used


def test_frontend_utilities_answer_or_fail_clearly(served):
    """The real engine drops its (nonexistent) multimodal and encoder caches; what it
    cannot do fails with a message naming the method, never "unknown method"."""
    from engine.errors import UtilityCallError
    core, address, _ = served

    async def main():
        client = await _connect(core, address)
        try:
            answers = [await client.call_utility("reset_mm_cache"),
                       await client.call_utility("reset_encoder_cache")]
            with pytest.raises(UtilityCallError, match="does not support 'profile'"):
                await client.call_utility("profile", True)
            tokens, _, _ = await _collect(client, "after-utils", PROMPTS[0], GREEDY)
            return answers, tokens
        finally:
            await client.shutdown()

    answers, tokens = run(main())
    assert answers == [[True], [None]] and len(tokens) == 12


def test_requests_queued_behind_a_long_step_are_bounded(tokenizer):  # noqa: F811
    """A step that runs long (here a utility call held on the core loop) let a flood of
    ADDs pile up in the server's input queue without bound; past max_num_seqs +
    max_waiting_requests queued ones (what the idle core would take) the io thread
    refuses at once (EngineOverloadedError, served as 429) and those it took run when
    the step ends."""
    import threading

    from engine.errors import EngineOverloadedError
    from engine.mock.config import MockConfig
    from engine.mock.core import MockEngineCore
    from tests.test_core_client import free_address
    core = MockEngineCore(MockConfig(vocab_size=len(tokenizer), itl_s=0.001,
                                     max_num_seqs=2, max_waiting_requests=4))
    held, release = threading.Event(), threading.Event()

    def long_step(*_args, **_kwargs):
        held.set()
        release.wait(30)
        return True
    core.reset_prefix_cache = long_step
    address = free_address()
    server = EngineCoreServer(core, address).start()

    async def one(client, i):
        out = []
        async for o in client.generate(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=3,
                                                                         ignore_eos=True)):
            out += o.outputs[0].token_ids
        return out

    async def main():
        client = await EngineClient.connect([address], tokenizer, handshake_timeout_s=10)
        try:
            utility = asyncio.ensure_future(client.call_utility("reset_prefix_cache"))
            await asyncio.get_running_loop().run_in_executor(None, held.wait, 10)
            assert server.loop_watch.busy_for() > 0  # a utility call is timed as a step
            tasks = [asyncio.ensure_future(one(client, i)) for i in range(10)]
            for _ in range(100):  # the refusals come at once; the others wait for the step
                if sum(t.done() for t in tasks) >= 4:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)
            done = [t for t in tasks if t.done()]
            refused = [t for t in done if isinstance(t.exception(), EngineOverloadedError)]
            assert len(refused) == 4 and len(done) == 4
            release.set()
            await utility
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert sum(isinstance(r, list) and len(r) == 3 for r in results) == 6
        finally:
            release.set()
            await client.shutdown()

    try:
        asyncio.run(main())
        assert server._adds_in == server._adds_out == 6
    finally:
        server.shutdown()


def test_a_handshake_is_answered_during_a_long_step_and_the_step_is_timed(tokenizer):  # noqa: F811
    """Liveness that means progress (issue 40, finding 5): READY comes from the io thread
    while a step runs (it waited behind the step), and the server reports how long the
    running step has taken, which the replica's health check holds to
    engine_step_timeout_s."""
    import threading

    from engine.mock.config import MockConfig
    from engine.mock.core import MockEngineCore
    from tests.test_core_client import free_address
    core = MockEngineCore(MockConfig(vocab_size=len(tokenizer), itl_s=0.001))
    inside, release = threading.Event(), threading.Event()
    real_step = core.step

    def hung_step():
        inside.set()
        release.wait(30)
        return real_step()
    core.step = hung_step
    address = free_address()
    server = EngineCoreServer(core, address).start()

    async def main():
        first = await EngineClient.connect([address], tokenizer, handshake_timeout_s=10)
        second = None
        try:
            stream = first.generate("r", [5, 6, 7], SamplingParams(max_tokens=2))
            pending = asyncio.ensure_future(stream.__anext__())
            await asyncio.get_running_loop().run_in_executor(None, inside.wait, 10)
            await asyncio.sleep(0.3)
            assert server.loop_watch.busy_for() >= 0.3
            second = await EngineClient.connect([address], tokenizer, handshake_timeout_s=5)
            assert not release.is_set()  # answered while the step still ran
            release.set()
            await pending
        finally:
            release.set()
            await first.shutdown()
            if second is not None:
                await second.shutdown()

    try:
        asyncio.run(main())
        assert server.loop_watch.busy_for() == 0.0
    finally:
        server.shutdown()


def test_the_engine_replica_fails_its_health_check_on_a_step_past_the_timeout():
    from types import SimpleNamespace

    from deployments.serve import engine_server
    from deployments.config import AppArgs
    cls = engine_server.EngineServer.func_or_class
    cls = cls if "check_health" in vars(cls) else cls.__mro__[1]
    replica = object.__new__(cls)
    watch = SimpleNamespace(busy_for=lambda: 301.0)
    replica.server = SimpleNamespace(alive=lambda: True, loop_watch=watch)
    replica.args = AppArgs(model="mock")
    replica.rank, replica.replica_id = 0, "x"

    async def heartbeat(*_):
        return True
    replica.coordinator = SimpleNamespace(heartbeat=SimpleNamespace(remote=heartbeat))
    with pytest.raises(RuntimeError, match="completed nothing .* for 301s"):
        asyncio.run(replica.check_health())
    watch.busy_for = lambda: 5.0
    asyncio.run(replica.check_health())  # a step within the timeout is healthy

    async def silent(*_):  # a coordinator being restarted: no answer
        await asyncio.sleep(5)
    replica.coordinator.heartbeat.remote = silent
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_server, "COORDINATOR_CALL_TIMEOUT_S", 0.1)
        asyncio.run(replica.check_health())  # healthy: the engine is fine

    async def refused(*_):  # its rank went to another replica meanwhile
        raise RuntimeError("rank 0 belongs to replica y, not x")
    replica.coordinator.heartbeat.remote = refused
    with pytest.raises(RuntimeError, match="belongs to replica y"):
        asyncio.run(replica.check_health())
    replica.server = None  # nothing for its __del__ to drain


def _mock_server(tokenizer, heartbeat_interval_s: float):
    """An engine-core server over the mock engine (10 ms a token): (server, address)."""
    from engine.mock.config import MockConfig
    from engine.mock.core import MockEngineCore
    from tests.test_core_client import free_address
    core = MockEngineCore(MockConfig(vocab_size=len(tokenizer), itl_s=0.01))
    address = free_address()
    return EngineCoreServer(core, address, heartbeat_interval_s=heartbeat_interval_s).start(), \
        address


async def _two_clients(address: str, tokenizer) -> tuple[EngineClient, EngineClient]:
    return tuple([await EngineClient.connect([address], tokenizer, handshake_timeout_s=10)
                  for _ in range(2)])


def test_an_idle_client_hears_heartbeats_while_another_client_streams(tokenizer):  # noqa: F811
    """Heartbeats went out only when the engine had sent nothing to anyone for an
    interval, so while one client streamed, every other client (an ingress replica that
    had sent no request, the coordinator) heard nothing and took the engine for dead
    after heartbeat_timeout_s (seen with the ingress scaled out under 256 streams). Each
    client now gets a heartbeat once it was sent nothing for an interval."""
    server, address = _mock_server(tokenizer, heartbeat_interval_s=0.5)

    async def main():
        busy, idle = await _two_clients(address, tokenizer)
        try:
            heard, outputs = set(), 0
            params = SamplingParams(max_tokens=400, ignore_eos=True)
            async for out in busy.generate("long", [5, 6, 7], params):
                outputs += 1
                heard.add(idle.engines[0].last_heard)
            assert out.finished and outputs > 50  # the engine sent to `busy` all along
            # a 4-second stream at 0.5-second heartbeats: the idle client heard several
            assert len(heard) >= 3, sorted(heard)
            assert not idle.engines[0].dead and idle.healthy
        finally:
            await busy.shutdown()
            await idle.shutdown()

    try:
        asyncio.run(main())
    finally:
        server.shutdown()


def test_a_big_output_is_forwarded_without_starting_pyzmq_s_garbage_collector(tokenizer):  # noqa: F811
    """The io thread sent each encoded batch as bytes with copy=False; pyzmq sends a
    bytes object over 64 KiB without copying by keeping it alive in a garbage collector
    of its own, a zmq context and a thread it starts at the first such send. An engine
    replica thus grew three threads at its first big batch, mid-soak, which the soak's
    leak check reported. Frames are now forwarded as the zmq messages they came in."""
    from zmq.utils.garbage import gc as zmq_gc

    from engine.mock.config import MockConfig
    from engine.mock.core import MockEngineCore
    from tests.test_core_client import free_address
    core = MockEngineCore(MockConfig(vocab_size=len(tokenizer), itl_s=0.001))
    big = "x" * 300_000
    core.reset_prefix_cache = lambda *_a, **_k: big
    if zmq_gc.is_alive():
        zmq_gc.stop()
    address = free_address()
    server = EngineCoreServer(core, address).start()

    async def main():
        client = await EngineClient.connect([address], tokenizer, handshake_timeout_s=10)
        try:
            return await client.call_utility("reset_prefix_cache")
        finally:
            await client.shutdown()

    try:
        answer = asyncio.run(main())
    finally:
        server.shutdown()
    assert big in (answer if isinstance(answer, list) else [answer])
    assert not zmq_gc.is_alive()


def test_every_client_hears_the_counts_fall_right_after_an_abort(tokenizer):  # noqa: F811
    """An ABORT changes the running count with no output to carry it: the clients read
    the old count until a heartbeat, so /metrics showed a dropped storm still running a
    second after the engines had let it go (issue 62). The engine now sends its stats to
    every client after handling aborts."""
    # heartbeats far apart: only the post-abort stats can bring the new counts
    server, address = _mock_server(tokenizer, heartbeat_interval_s=30.0)

    async def main():
        owner, other = await _two_clients(address, tokenizer)
        try:
            params = SamplingParams(max_tokens=4000, ignore_eos=True)
            streams = [owner.generate(f"r{i}", [5, 6, 7], params) for i in range(3)]
            for s in streams:
                await s.__anext__()
            await owner.refresh_stats(0.0, 5.0)
            await other.refresh_stats(0.0, 5.0)
            before = [c.engines[0].stats.num_running_reqs for c in (owner, other)]
            for s in streams:
                await s.aclose()
            for _ in range(50):
                await asyncio.sleep(0.02)
                after = [c.engines[0].stats.num_running_reqs for c in (owner, other)]
                if after == [0, 0]:
                    break
            return before, after
        finally:
            await owner.shutdown()
            await other.shutdown()

    try:
        before, after = asyncio.run(main())
    finally:
        server.shutdown()
    assert before == [3, 3]
    assert after == [0, 0]
