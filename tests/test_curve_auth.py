"""Engine-core sockets under CURVE (issue 40, finding 8): an engine's port was open to
anyone on the network (sleep, add_lora, every stream). An engine given keys admits only
clients holding its client key pair; the others get no READY and reach nothing."""
from __future__ import annotations

import asyncio
import threading

import pytest
import zmq

from engine.mock.config import MockConfig
from engine.mock.core import MockEngineCore
from engine.sampling_params import SamplingParams
from engine.wire.core_client import EngineClient, HandshakeError
from engine.wire.core_server import EngineCoreServer
from engine.wire.curve_auth import ClientKeys, EngineKeys
from tests.test_core_client import free_address, tokenizer  # noqa: F401 - fixture


async def _tokens(client: EngineClient, request_id: str) -> list[int]:
    out = []
    async for o in client.generate(request_id, [5, 6, 7], SamplingParams(
            max_tokens=4, ignore_eos=True)):
        out += o.outputs[0].token_ids  # deltas
    return out


def test_only_clients_with_the_engines_keys_are_served(tokenizer):  # noqa: F811
    keys = EngineKeys.generate()
    address = free_address()
    core = MockEngineCore(MockConfig(vocab_size=len(tokenizer), itl_s=0.001))
    server = EngineCoreServer(core, address, keys=keys).start()
    stranger_public, stranger_secret = (k.decode() for k in zmq.curve_keypair())
    wrong = ClientKeys(keys.server_public, stranger_public, stranger_secret)
    auth_threads = {t.name for t in threading.enumerate()}

    async def main():
        good = await EngineClient.connect([address], tokenizer, handshake_timeout_s=5,
                                          keys={address: keys.for_clients()})
        try:
            assert len(await _tokens(good, "a")) == 4
            for bad in (None, wrong):  # in the clear, and with another client key pair
                with pytest.raises(HandshakeError, match="did not answer"):
                    await EngineClient.connect([address], tokenizer, handshake_timeout_s=1.5,
                                               keys={address: bad} if bad else None)
            assert len(await _tokens(good, "b")) == 4  # still served
            assert core.get_stats().num_running_reqs == 0
        finally:
            await good.shutdown()

    try:
        asyncio.run(main())
        assert len(server._clients) == 1  # only the client with the keys was welcomed
    finally:
        server.shutdown()
    # the ZAP handler's thread ends with the server
    assert not any(t.is_alive() and t.name not in auth_threads
                   for t in threading.enumerate())


def test_client_keys_cross_ray_as_a_dict():
    keys = EngineKeys.generate().for_clients()
    assert ClientKeys.from_dict(keys.as_dict()) == keys
    assert len(keys.server_public) == 40 and keys.server_public != keys.client_public
