"""MockEngineCore: deterministic tokens, EngineCore's stop rules, a latency model that
never busy-waits, sleep mode and the test knobs. Most timing runs on a fake clock."""
from __future__ import annotations

import time
from collections import defaultdict

import msgspec
import pytest

from engine.core_messages import EngineCoreOutput, EngineCoreReadyResponse, EngineCoreRequest
from engine.errors import (
    DuplicateRequestError,
    EngineSleepingError,
    InvalidRequestError,
    PromptTooLongError,
)
from engine.mock.config import FIRST_TOKEN_ID, MockConfig
from engine.mock.core import MockEngineCore
from engine.sampling_params import SamplingParams
from engine.wire.protocol import PROTOCOL_VERSION


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def mock(**options) -> MockEngineCore:
    return MockEngineCore(MockConfig(**options), clock=FakeClock())


def req(request_id: str, prompt: list[int] | None = None, **params) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, prompt or [5, 6, 7], SamplingParams(**params))


def run(engine: MockEngineCore, *requests: EngineCoreRequest) -> dict[str, list[EngineCoreOutput]]:
    """Add requests, then step until idle, moving the fake clock to each due time."""
    for r in requests:
        engine.add_request(r)
    outs: dict[str, list[EngineCoreOutput]] = defaultdict(list)
    while (delay := engine.next_step_delay()) is not None:
        engine._clock.now += delay
        for out in engine.step():
            outs[out.request_id].append(out)
    assert not engine.has_unfinished_requests()
    return outs


def tokens(outs: list[EngineCoreOutput]) -> list[int]:
    return [t for out in outs for t in out.new_token_ids]


def finish(outs: list[EngineCoreOutput]) -> tuple[str | None, int | str | None]:
    assert all(out.finish_reason is None for out in outs[:-1])
    return outs[-1].finish_reason, outs[-1].stop_reason


def test_tokens_are_deterministic_and_independent_of_the_batch():
    alone = tokens(run(mock(), req("a", max_tokens=50))["a"])
    batch = run(mock(max_num_seqs=2, itl_s=0.01),
                req("x", [9] * 30, max_tokens=7), req("a", max_tokens=50), req("y", max_tokens=3))
    assert tokens(batch["a"]) == alone
    assert len(alone) == 50 and len(set(alone)) > 40
    assert all(FIRST_TOKEN_ID <= t < 32000 for t in alone)
    assert tokens(batch["x"]) != alone[:7]


def test_seed_and_engine_index_change_tokens():
    def gen(**options):
        return tokens(run(mock(**options), req("a", max_tokens=20))["a"])
    assert gen(seed=1) != gen(seed=0) != gen(seed=0, engine_index=1) != gen(seed=1)
    assert gen(seed=1, engine_index=2) == gen(seed=1, engine_index=2)


def test_draws_avoid_eos_even_inside_the_vocab():
    out = tokens(run(mock(vocab_size=8, eos_token_id=5), req("a", max_tokens=300))["a"])
    assert set(out) == {3, 4, 6, 7}


def test_max_tokens_and_max_model_len_finish_with_length():
    outs = run(mock(), req("a", max_tokens=5))["a"]
    assert [len(o.new_token_ids) for o in outs] == [1] * 5
    assert finish(outs) == ("length", None)
    outs = run(mock(max_model_len=20), req("b", max_tokens=None))["b"]
    assert len(tokens(outs)) == 17 and finish(outs) == ("length", None)
    # max_model_len is also capped by the KV pool, as in EngineCore
    assert mock(max_model_len=4096, num_blocks=4, block_size=16).max_model_len == 64


def test_stop_token_ids_stop_with_stop_reason_but_not_before_min_tokens():
    base = tokens(run(mock(), req("a", max_tokens=30))["a"])
    stop = base[5]
    at = base.index(stop)
    outs = run(mock(), req("a", max_tokens=30, stop_token_ids=[stop]))["a"]
    assert tokens(outs) == base[:at + 1]
    assert finish(outs) == ("stop", stop)
    # before min_tokens the stop token is masked (redrawn), as the sampler does
    outs = run(mock(), req("a", max_tokens=30, min_tokens=at + 3, stop_token_ids=[stop]))["a"]
    got = tokens(outs)
    assert len(got) >= at + 3 and stop not in got[:at + 3]
    assert got[:at] == base[:at]
    assert finish(outs) in {("stop", stop), ("length", None)}


def test_eos_stops_after_min_tokens_unless_ignored():
    eos = 2
    outs = run(mock(emit_eos_after=4), req("a", max_tokens=10))["a"]
    assert len(tokens(outs)) == 5 and tokens(outs)[-1] == eos
    assert finish(outs) == ("stop", None)
    outs = run(mock(emit_eos_after=4), req("a", max_tokens=10, ignore_eos=True))["a"]
    assert tokens(outs)[4] == eos and len(tokens(outs)) == 10
    assert finish(outs) == ("length", None)
    outs = run(mock(emit_eos_after=4), req("a", max_tokens=10, min_tokens=7))["a"]
    assert tokens(outs).index(eos) == 7 and len(tokens(outs)) == 8
    # without emit_eos_after the mock never draws EOS
    assert eos not in tokens(run(mock(), req("a", max_tokens=500))["a"])


def test_output_chunk_size_groups_tokens():
    base = tokens(run(mock(), req("a", max_tokens=10))["a"])
    outs = run(mock(output_chunk_size=4), req("a", max_tokens=10))["a"]
    assert [len(o.new_token_ids) for o in outs] == [4, 4, 2]
    assert tokens(outs) == base and finish(outs) == ("length", None)
    outs = run(mock(output_chunk_size=4, emit_eos_after=5), req("a", max_tokens=10))["a"]
    assert [len(o.new_token_ids) for o in outs] == [4, 2] and finish(outs) == ("stop", None)


def test_abort_is_idempotent_and_yields_one_abort_output():
    engine = mock(itl_s=1.0)
    engine.add_request(req("a", max_tokens=10))
    engine.add_request(req("b", max_tokens=10))
    assert [o.request_id for o in engine.step()] == ["a", "b"]
    engine.abort_requests(["a", "a", "unknown"])
    engine.abort_requests(["a"])
    assert engine.next_step_delay() == 0.0 and engine.has_unfinished_requests()
    assert engine.step() == [EngineCoreOutput("a", [], "abort")]
    assert engine.step() == []
    engine._clock.now += 1.0
    assert [o.request_id for o in engine.step()] == ["b"]
    engine.add_request(req("a", max_tokens=10))  # a finished id may be used again
    engine.abort_requests(["a", "b"])
    assert {o.request_id for o in engine.step()} == {"a", "b"}
    assert not engine.has_unfinished_requests() and engine.next_step_delay() is None


def test_bad_requests_raise_typed_errors_and_the_engine_keeps_serving():
    engine = mock(max_model_len=10, vocab_size=100)
    engine.add_request(req("a", max_tokens=2))
    with pytest.raises(DuplicateRequestError):
        engine.add_request(req("a"))
    with pytest.raises(PromptTooLongError, match="10"):
        engine.add_request(req("long", list(range(3, 13))))
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request(EngineCoreRequest("empty", [], SamplingParams()))
    with pytest.raises(InvalidRequestError, match="100"):
        engine.add_request(req("oov", [5, 100]))
    with pytest.raises(InvalidRequestError):
        MockConfig(vocab_size=3)
    assert len(tokens(run(engine, req("b", max_tokens=3))["b"])) == 3


def test_sleep_aborts_in_flight_requests_and_refuses_new_ones():
    engine = mock(max_num_seqs=1)
    engine.add_request(req("running"))
    engine.add_request(req("waiting"))
    engine.sleep(level=2)
    assert engine.is_sleeping()
    assert {(o.request_id, o.finish_reason) for o in engine.step()} == {
        ("running", "abort"), ("waiting", "abort")}
    assert not engine.has_unfinished_requests()
    with pytest.raises(EngineSleepingError):
        engine.add_request(req("c"))
    with pytest.raises(InvalidRequestError):
        engine.wake_up(["bogus"])
    engine.wake_up(["weights"])
    assert engine.is_sleeping()
    engine.wake_up(["kv_cache"])
    assert not engine.is_sleeping()
    assert len(tokens(run(engine, req("c", max_tokens=2))["c"])) == 2
    with pytest.raises(InvalidRequestError):
        engine.sleep(level=3)


def test_latency_model_schedules_outputs():
    engine = mock(ttft_s=0.1, prefill_s_per_token=0.01, itl_s=0.05, output_chunk_size=2)
    clock = engine._clock
    assert engine.next_step_delay() is None
    engine.add_request(req("a", list(range(3, 13)), max_tokens=5))  # first token at +0.2
    assert engine.next_step_delay() == pytest.approx(0.25)  # first output: tokens 0 and 1
    clock.now += 0.24
    assert engine.step() == []
    clock.now += 0.02
    assert len(engine.step()[0].new_token_ids) == 2
    assert engine.next_step_delay() == pytest.approx(0.09)  # tokens 2 and 3 at +0.35
    clock.now += 1.0  # a late step gets one output per request, then the rest is due at once
    assert len(engine.step()) == 1 and engine.next_step_delay() == 0.0
    assert engine.step()[0].finish_reason == "length" and engine.next_step_delay() is None


def test_real_clock_never_returns_a_token_before_it_is_due():
    engine = MockEngineCore(MockConfig(itl_s=0.05))
    start = time.monotonic()
    engine.add_request(req("a", max_tokens=3))
    times = []
    while (delay := engine.next_step_delay()) is not None:
        assert 0.0 <= delay <= 0.05
        time.sleep(delay)
        for _ in engine.step():
            times.append(time.monotonic() - start)
    assert len(times) == 3
    for k, t in enumerate(times):
        assert t >= 0.05 * k
    assert times[-1] < 5.0


def test_requests_beyond_max_num_seqs_wait_and_stats_count_them():
    engine = mock(max_num_seqs=2, itl_s=1.0, num_blocks=100, block_size=16)
    for rid in ("a", "b", "c"):
        engine.add_request(req(rid, list(range(3, 23)), max_tokens=2))  # 20 tokens: 2 blocks
    stats = engine.get_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (2, 1)
    assert stats.kv_cache_usage == pytest.approx(0.04) and stats.num_free_blocks == 96
    assert {o.request_id for o in engine.step()} == {"a", "b"}
    engine._clock.now += 1.0
    assert all(o.finish_reason == "length" for o in engine.step())  # a, b done; c admitted
    stats = engine.get_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 0)
    out, = engine.step()
    assert out.request_id == "c" and out.num_cached_tokens == 16  # the full block a cached


def test_force_knobs_make_one_engine_disagree():
    assert mock(force_is_sleeping=True).is_sleeping()
    sleeper = mock(force_is_sleeping=False)
    sleeper.sleep()
    assert not sleeper.is_sleeping()
    assert mock(force_reset_prefix_cache=False).reset_prefix_cache() is False
    engine = mock(itl_s=1.0)
    assert engine.reset_prefix_cache() is True
    engine.add_request(req("a"))
    assert engine.reset_prefix_cache() is False
    assert engine.reset_prefix_cache(reset_running_requests=True) is True


def test_utilities_answer_in_wire_types():
    engine = mock(max_model_len=2048, num_blocks=512, block_size=32, max_num_seqs=8)
    ready = engine.ready_response(3)
    assert (ready.engine_index, ready.max_model_len, ready.num_gpu_blocks, ready.block_size,
            ready.dtype, ready.max_num_seqs, ready.supported_tasks) == (
        3, 2048, 512, 32, "mock", 8, ["generate"])
    wire = msgspec.msgpack.encode(ready)
    assert msgspec.msgpack.decode(wire, type=EngineCoreReadyResponse) == ready
    assert engine.get_supported_tasks() == ["generate"]
    msgspec.msgpack.encode([engine.get_stats(), engine.get_memory_usage(), engine.is_sleeping()])


def test_logprobs_have_the_samplers_layout():
    outs = run(mock(), req("a", max_tokens=3, logprobs=2))["a"]
    for out in outs:
        (ids, vals, ranks), = out.new_logprobs
        assert ids[0] == ids[1] == out.new_token_ids[0] and len(ids) == len(vals) == 3
        assert ranks == [1, 1, 2] and vals[0] == vals[1] > vals[2]
    assert run(mock(), req("b", max_tokens=1))["b"][0].new_logprobs is None


def _read_slowly(max_tokens: int) -> tuple[list[int], int, str]:
    """A raw client that asks one mock request and then does not read for 3 s (its
    event loop busy): its tokens, how many messages brought them, the finish reason."""
    import socket

    import zmq

    from engine.wire.core_server import EngineCoreServer
    from engine.core_messages import EngineCoreOutputs
    from engine.wire.protocol import ADD, HELLO, OUTPUTS, READY, Hello

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    server = EngineCoreServer(MockEngineCore(MockConfig(max_model_len=8192)), address).start()
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        dealer.setsockopt(zmq.IDENTITY, b"slow-reader")
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(address)
        dealer.send_multipart([HELLO, msgspec.msgpack.encode(
            Hello("slow-reader", PROTOCOL_VERSION))])
        assert dealer.recv_multipart()[0] == READY
        dealer.send_multipart([ADD, msgspec.msgpack.encode(
            req("long", max_tokens=max_tokens, ignore_eos=True))])  # one token a step
        time.sleep(3)  # not reading: the engine finishes meanwhile
        got, messages, finished = [], 0, None
        while finished is None:
            assert dealer.poll(10_000), f"outputs stopped after {len(got)} tokens"
            kind, payload = dealer.recv_multipart()
            assert kind == OUTPUTS
            messages += 1
            for out in msgspec.msgpack.decode(payload, type=EngineCoreOutputs).outputs:
                got += out.new_token_ids
                finished = out.finish_reason
        return got, messages, finished
    finally:
        dealer.close(linger=0)
        ctx.term()
        server.shutdown()


def test_outputs_wait_for_a_client_that_is_slow_to_read(monkeypatch):
    """A client that stops reading for a while (its event loop busy) finds every output
    afterwards: the engine's per-client queue must not drop messages at ZMQ's default
    high-water mark (1,000 messages a side), as a ROUTER does. Messages are not merged
    here (ENCODE_BATCH 1), so that 6,000 of them queue up."""
    import engine.wire.core_server as core_server
    monkeypatch.setattr(core_server, "ENCODE_BATCH", 1)
    tokens, messages, finished = _read_slowly(6000)
    assert (len(tokens), finished) == (6000, "length") and messages >= 6000


def test_queued_step_outputs_reach_a_client_merged_in_order(monkeypatch):
    """Steps that come faster than the encoder sends (the mock at zero model time)
    reach the client in far fewer messages, with the same tokens in the same order as
    one message a step."""
    import engine.wire.core_server as core_server
    merged, messages, finished = _read_slowly(6000)
    assert finished == "length" and messages < 1000, messages
    monkeypatch.setattr(core_server, "ENCODE_BATCH", 1)
    one_a_step, _, _ = _read_slowly(6000)
    assert merged == one_a_step
