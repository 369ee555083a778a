"""Engines learn when a client is gone (issue 40, finding 2): an ingress replica that is
OOM-killed or downscaled left its requests running on the engines, holding KV blocks and
slots until max_tokens, and every reconnect added a client that got KV events for ever.
Clients now PING every engine each second; an engine aborts the requests of a client it
has not heard from for client_timeout_s and forgets it. A client that shuts down (a
retired one) aborts what it still has running first."""
from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

from engine.mock.config import MockConfig
from engine.mock.core import MockEngineCore
from engine.sampling_params import SamplingParams
from engine.wire.core_server import EngineCoreServer
from tests.test_core_client import free_address
from tests.test_openai_app import tokenizer  # noqa: F401 - fixture

_CLIENT = """
import asyncio, sys
from engine.model.loader import load_tokenizer, resolve_model
from engine.sampling_params import SamplingParams
from engine.wire.core_client import EngineClient

async def main():
    client = await EngineClient.connect([sys.argv[1]], load_tokenizer(resolve_model("default")))
    params = SamplingParams(max_tokens=100000, ignore_eos=True)
    streams = [client.generate(f"r{i}", [5, 6, 7], params) for i in range(5)]
    for s in streams:
        await s.__anext__()
    print("streaming", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def _serve(tokenizer, client_timeout_s: float):
    core = MockEngineCore(MockConfig(vocab_size=len(tokenizer), itl_s=0.01,
                                     max_model_len=200_000))
    address = free_address()
    server = EngineCoreServer(core, address, heartbeat_interval_s=0.2,
                              client_timeout_s=client_timeout_s).start()
    return core, server, address


def _wait_until(check, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.05)
    return check()


def test_a_killed_clients_requests_are_aborted_and_the_client_forgotten(tokenizer):  # noqa: F811
    core, server, address = _serve(tokenizer, client_timeout_s=1.5)
    proc = subprocess.Popen([sys.executable, "-c", _CLIENT, address], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "streaming"
        assert len(core._running) == 5 and len(server._clients) == 1
        time.sleep(2.5)  # alive and pinging: nothing is dropped while it is there
        assert len(core._running) == 5
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed = time.monotonic()
        assert _wait_until(lambda: not core._running, 10)
        assert time.monotonic() - killed < 1.5 + 2.0  # the timeout, plus a poll or two
        assert _wait_until(lambda: not server._clients, 2)
    finally:
        proc.kill()
        server.shutdown()


def test_a_client_that_shuts_down_aborts_what_it_still_runs(tokenizer):  # noqa: F811
    """A retired client used to cancel its abort loop, then fail its streams: what
    they ran went on at the engines."""
    from engine.wire.core_client import EngineClient
    core, server, address = _serve(tokenizer, client_timeout_s=600)
    try:
        async def main():
            client = await EngineClient.connect([address], tokenizer)
            params = SamplingParams(max_tokens=100000, ignore_eos=True)
            streams = [client.generate(f"r{i}", [5, 6], params) for i in range(3)]
            for s in streams:
                await s.__anext__()
            running = len(core._running)
            await client.shutdown()
            return running
        assert asyncio.run(main()) == 3
        assert _wait_until(lambda: not core._running, 2)
    finally:
        server.shutdown()


def test_a_forgotten_client_that_speaks_again_is_served_again(tokenizer):  # noqa: F811
    """Silent past the timeout, a client is forgotten; its next frame (a PING) brings it
    back: heartbeats and KV events reach it again."""
    import msgspec
    import zmq

    from engine.wire.protocol import HELLO, OUTPUTS, PING, PROTOCOL_VERSION, READY, Hello
    core, server, address = _serve(tokenizer, client_timeout_s=0.5)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    try:
        raw.connect(address)
        raw.send_multipart([HELLO, msgspec.msgpack.encode(Hello("raw", PROTOCOL_VERSION))])
        assert raw.poll(5000) and raw.recv_multipart()[0] == READY
        assert _wait_until(lambda: len(server._clients) == 1, 2)
        assert _wait_until(lambda: not server._clients, 5)  # silent: forgotten
        while raw.poll(300):
            raw.recv_multipart()  # what was sent before it was forgotten
        raw.send_multipart([PING, b""])
        assert _wait_until(lambda: len(server._clients) == 1, 2)
        assert raw.poll(2000) and raw.recv_multipart()[0] == OUTPUTS  # a heartbeat again
    finally:
        raw.close(linger=0)
        ctx.term()
        server.shutdown()


def test_an_engine_that_stalled_itself_judges_no_client_silent(tokenizer):  # noqa: F811
    """After the engine's own io thread stalled (its process stopped, a VM paused), the
    clients' PINGs may still be queued: nobody is declared gone on that pass."""
    core = MockEngineCore(MockConfig(vocab_size=len(tokenizer)))
    server = EngineCoreServer(core, free_address(), client_timeout_s=10)
    now = time.monotonic()
    server._client_seen = {b"a": now - 100}
    server._io_pass_at = now - 100  # the io thread itself was away
    server._forget_silent_clients()
    assert server._inputs.empty() and server._client_seen[b"a"] >= now
    server._client_seen = {b"a": now - 100}  # a normal pass: a silent client is gone
    server._forget_silent_clients()
    assert server._inputs.get_nowait()[:2] == (b"a", b"gone")


def test_peers_of_another_protocol_version_are_refused(tokenizer):  # noqa: F811
    """A version-1 peer leaves the version out of its HELLO / READY (its default): read
    as 1, not as the current version, and refused; it would not PING."""
    import msgspec
    import zmq

    from engine.core_messages import EngineCoreReadyResponse
    from engine.wire.protocol import HELLO, PROTOCOL_VERSION, Hello
    assert msgspec.msgpack.decode(msgspec.msgpack.encode({"client_id": "old"}),
                                  type=Hello).protocol_version == 1
    old_ready = msgspec.msgpack.encode({"engine_index": 0, "max_model_len": 8,
                                        "num_gpu_blocks": 1, "block_size": 16,
                                        "dtype": "x", "version": "0"})
    assert msgspec.msgpack.decode(old_ready, type=EngineCoreReadyResponse).protocol_version \
        == 1 != PROTOCOL_VERSION
    core, server, address = _serve(tokenizer, client_timeout_s=30)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    try:
        raw.connect(address)
        raw.send_multipart([HELLO, msgspec.msgpack.encode({"client_id": "old"})])
        assert not raw.poll(1000)  # no READY for it
        assert not server._clients
    finally:
        raw.close(linger=0)
        ctx.term()
        server.shutdown()
