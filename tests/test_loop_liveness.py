"""Liveness that covers the whole core loop (issue 62, item 4).

Heartbeats carried the age of the running step (and utility call) only, so a core loop
stuck anywhere else, in an ADD (a LoRA load or a grammar compile inside add_request),
an abort, the stats it gathers, was never flagged: its io thread kept beating "0 s"
while it served nothing. The loop now restarts a watch at each unit of work it
completes and stops it while it waits for input; heartbeats carry the watch's reading,
the client routes new requests away past stalled_step_s and the replica's health
check fails past engine_step_timeout_s. A loop that keeps completing work, however
long it stays busy, is never flagged.

Bounds here are far apart from what the loop does (a wedge held until released
against a bound of about a second; units of work of 50 ms against the same bound):
nothing asserts how fast anything ran.
"""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import msgspec
import pytest

from engine.core_messages import EngineCoreOutputs
from engine.mock.config import MockConfig
from engine.mock.core import MockEngineCore
from engine.sampling_params import SamplingParams
from engine.wire.core_client import EngineClient
from engine.wire.core_server import EngineCoreServer
from tests.test_core_client import free_address
from tests.test_openai_app import tokenizer  # noqa: F401 - fixture

BOUND_S = 1.0  # the client's stalled_step_s and the replica's engine_step_timeout_s here
PARAMS = SamplingParams(max_tokens=2, ignore_eos=True)


def _replica(server: EngineCoreServer, timeout_s: float):
    """An engine replica (deployments/serve/engine_server.py) around a running server,
    its coordinator answering every heartbeat."""
    from deployments.config import AppArgs
    from deployments.serve import engine_server
    cls = engine_server.EngineServer.func_or_class
    cls = cls if "check_health" in vars(cls) else cls.__mro__[1]
    replica = object.__new__(cls)
    replica.server = server
    replica.args = AppArgs(model="mock", engine_step_timeout_s=timeout_s)
    replica.rank, replica.replica_id = 0, "x"

    async def heartbeat(*_):
        return True
    replica.coordinator = SimpleNamespace(heartbeat=SimpleNamespace(remote=heartbeat))
    return replica


async def _healthy(replica) -> bool:
    try:
        await replica.check_health()
    except RuntimeError:
        return False
    return True


async def _until(check, timeout: float = 15.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return True
        await asyncio.sleep(0.05)
    return check()


def _wedge(core: MockEngineCore, method: str, inside: threading.Event,
           release: threading.Event) -> None:
    """Make core.<method> block until released (abort and add: for a request whose id
    says "wedge"; step: once it has a request to run)."""
    real = getattr(core, method)

    def wedged(*args, **kwargs):
        first = args[0] if args else None
        ids = [first.request_id] if hasattr(first, "request_id") else (first or [])
        if (method == "reset_prefix_cache" or any("wedge" in str(i) for i in ids)
                or (method == "step" and core.has_unfinished_requests())):
            inside.set()
            release.wait(30)
        return real(*args, **kwargs)
    setattr(core, method, wedged)


@pytest.mark.parametrize("method", ["step", "add_request", "abort_requests",
                                    "reset_prefix_cache"])
def test_a_wedged_loop_is_flagged(tokenizer, method):  # noqa: F811
    """Engine 0's loop wedged in a step, an ADD, an ABORT or a utility call: its
    heartbeats say so (the client sees it past BOUND_S), new requests go to engine 1,
    the replica's health check fails; once released, everything is back (0, healthy,
    routed to). Before, the ADD and the ABORT were never flagged: heartbeats said 0
    (issue 40 had covered the step alone)."""
    cores = [MockEngineCore(MockConfig(vocab_size=len(tokenizer), itl_s=0.001))
             for _ in range(2)]
    inside, release = threading.Event(), threading.Event()
    _wedge(cores[0], method, inside, release)
    taken: list[str] = []
    real_add = cores[1].add_request
    cores[1].add_request = lambda req: (taken.append(req.request_id), real_add(req))[1]
    addresses = [free_address(), free_address()]
    servers = [EngineCoreServer(c, a, i, heartbeat_interval_s=0.2).start()
               for i, (c, a) in enumerate(zip(cores, addresses))]
    replica = _replica(servers[0], BOUND_S)

    async def main():
        client = await EngineClient.connect(addresses, tokenizer, handshake_timeout_s=10,
                                            routing="round_robin", stalled_step_s=BOUND_S)
        wedged = None
        try:
            if method in ("add_request", "step"):
                wedged = asyncio.ensure_future(client.generate(
                    "wedge", [5, 6, 7], PARAMS, data_parallel_rank=0).__anext__())
            elif method == "abort_requests":
                stream = client.generate("wedge", [5, 6, 7], SamplingParams(
                    max_tokens=100_000, ignore_eos=True), data_parallel_rank=0)
                await stream.__anext__()
                await client.abort(["wedge"])
            else:
                wedged = asyncio.ensure_future(client.call_utility("reset_prefix_cache"))
            assert await asyncio.get_running_loop().run_in_executor(None, inside.wait, 10)
            assert await _until(lambda: client.engines[0].step_running_s >= BOUND_S)
            assert not await _healthy(replica)
            for i in range(4):  # round robin would send two of these to engine 0
                async for out in client.generate(f"n{i}", [5, 6, 7], PARAMS):
                    pass
                assert out.finished
            assert len(taken) == 4 and not release.is_set()
            release.set()
            if wedged is not None:
                await asyncio.wait_for(wedged, 10)
            assert await _until(lambda: client.engines[0].step_running_s == 0.0)
            assert await _healthy(replica)
        finally:
            release.set()
            await client.shutdown()

    try:
        asyncio.run(main())
    finally:
        replica.server = None  # nothing for its __del__ to drain
        for s in servers:
            s.shutdown()


def test_a_loop_busy_but_progressing_is_not_flagged(tokenizer):  # noqa: F811
    """Steps and utility calls of 50 ms back to back for several times BOUND_S: the
    loop never waits, yet completes work all along, so neither the client nor the
    health check flags it (a clock since the loop last waited would have)."""
    core = MockEngineCore(MockConfig(vocab_size=len(tokenizer), itl_s=0.0))
    real_step, real_reset = core.step, core.reset_prefix_cache

    def slow_step():
        time.sleep(0.05)
        return real_step()

    def slow_reset(*args, **kwargs):
        time.sleep(0.05)
        return real_reset(*args, **kwargs)
    core.step, core.reset_prefix_cache = slow_step, slow_reset
    address = free_address()
    server = EngineCoreServer(core, address, heartbeat_interval_s=0.1).start()
    replica = _replica(server, BOUND_S)

    async def main():
        client = await EngineClient.connect([address], tokenizer, handshake_timeout_s=10,
                                            stalled_step_s=BOUND_S)
        seen, healthy = [], []
        try:
            async def busy():
                long = SamplingParams(max_tokens=80, ignore_eos=True)
                streams = [client.generate(f"s{i}", [5, 6, 7], long) for i in range(2)]
                utilities = [client.call_utility("reset_prefix_cache") for _ in range(20)]

                async def drain(stream):
                    async for _ in stream:
                        pass
                await asyncio.gather(*(drain(s) for s in streams), *utilities)
            work = asyncio.ensure_future(busy())
            while not work.done():  # 80 steps and 20 calls of 50 ms: seconds
                seen.append(client.engines[0].step_running_s)
                seen.append(server.loop_watch.busy_for())
                healthy.append(await _healthy(replica))
                await asyncio.sleep(0.05)
            await work
            assert max(seen) > 0  # it was busy, and it showed
            assert max(seen) < BOUND_S and all(healthy)
        finally:
            await client.shutdown()

    try:
        asyncio.run(main())
    finally:
        replica.server = None
        server.shutdown()


def test_an_idle_loop_reads_zero():
    """Waiting for input is not being stuck: an engine idle for longer than any bound
    reads 0, and a stopped loop too (alive() says it stopped)."""
    core = MockEngineCore(MockConfig(vocab_size=100))
    server = EngineCoreServer(core, free_address()).start()
    try:
        deadline = time.monotonic() + 10
        while server.loop_watch.busy_for() != 0.0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.loop_watch.busy_for() == 0.0
    finally:
        server.shutdown()
    assert server.loop_watch.busy_for() == 0.0


class _V2Outputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """EngineCoreOutputs as a peer built before issue 62 declared it (its field types
    loosened to Any: only the positions matter here)."""

    engine_index: int = 0
    outputs: list = []
    utility_output: object = None
    timestamp: float = 0.0
    scheduler_stats: object = None
    wave_complete: int | None = None
    kv_events: object = None
    step_running_s: float = 0.0


def test_the_loops_age_round_trips_and_old_peers_read_it():
    """The age rides in the slot that carried the step's age (protocol 2): it round-trips,
    a peer of before reads it as the age it already acted on, and what such a peer
    sends is read the same way, so the wider meaning needs no PROTOCOL_VERSION bump."""
    beat = EngineCoreOutputs(3, timestamp=1.5, step_running_s=12.25)
    wire = msgspec.msgpack.encode(beat)
    assert msgspec.msgpack.decode(wire, type=EngineCoreOutputs).step_running_s == 12.25
    assert msgspec.msgpack.decode(wire, type=_V2Outputs).step_running_s == 12.25
    old = msgspec.msgpack.encode(_V2Outputs(3, timestamp=1.5, step_running_s=7.0))
    assert msgspec.msgpack.decode(old, type=EngineCoreOutputs).step_running_s == 7.0
    # a loop output leaves it out (0): the client reads "it moved"
    quiet = msgspec.msgpack.decode(msgspec.msgpack.encode(EngineCoreOutputs(3)),
                                   type=EngineCoreOutputs)
    assert quiet.step_running_s == 0.0
