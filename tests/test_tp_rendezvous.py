"""The tensor-parallel rendezvous (engine.executor.rendezvous) admits only the client
keys rank 0 hands its workers: a peer without them, or with other keys, fails the
CURVE handshake and never reads or writes the store; WorkerArgs and the keys' repr show
no secret."""
from __future__ import annotations

import msgspec
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from engine.executor.rendezvous import RendezvousServer, RendezvousStore
from engine.executor.tp_executor import WorkerArgs
from engine.wire.curve_auth import ClientKeys, EngineKeys

FAILED = {zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
          zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL}


@pytest.fixture
def server():
    s = RendezvousServer("127.0.0.1")
    yield s
    s.stop()


def _handshake(address: str, keys: ClientKeys | None) -> int:
    """Connect a DEALER (a CURVE client with `keys`, or plain without) and return the
    first handshake event its monitor reports: succeeded or one of FAILED."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.linger = 0
    if keys is not None:
        keys.apply(sock)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_ALL)
    try:
        sock.connect(address)
        # a request that an admitted peer would get answered
        sock.send(msgspec.msgpack.encode([0, "set", "intruder", b"x"]))
        while True:
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED or event in FAILED:
                return event
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
        context.term()


def test_the_handed_out_keys_form_the_store(server):
    store = RendezvousStore(server.address, server.client_keys(), timeout_s=30)
    try:
        store.set("rank1/addr", b"10.0.0.2:4000")
        assert store.get("rank1/addr") == b"10.0.0.2:4000"
        assert store.add("count", 2) == 2 and store.add("count", 1) == 3
        assert store.check(["rank1/addr", "count"]) and not store.check(["absent"])
        assert store.compare_set("k", b"", b"v1") == b"v1"
        assert store.compare_set("k", b"other", b"v2") == b"v1"
        assert store.num_keys() == 3
        assert store.delete_key("k") and not store.delete_key("k")
    finally:
        store.close()
    assert _handshake(server.address, server.client_keys()) == zmq.EVENT_HANDSHAKE_SUCCEEDED


def test_a_peer_without_the_keys_is_refused(server):
    plain = _handshake(server.address, None)
    assert plain in FAILED
    # CURVE, the right server key, but a client pair the server never made
    other = EngineKeys.generate()
    stranger = ClientKeys(server.keys.server_public, other.client_public, other.client_secret)
    assert _handshake(server.address, stranger) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    # neither request reached the table
    assert "intruder" not in server.table


def test_a_store_with_other_keys_gets_no_answer(server):
    other = EngineKeys.generate()
    stranger = ClientKeys(server.keys.server_public, other.client_public, other.client_secret)
    store = RendezvousStore(server.address, stranger, timeout_s=0.5)
    try:
        with pytest.raises(TimeoutError, match="did not answer"):
            store.set("rank1/addr", b"evil")
    finally:
        store.close()
    assert server.table == {}


def test_worker_args_and_keys_hide_their_secrets(server):
    keys = server.client_keys()
    args = WorkerArgs({}, 1, 2, server.address, keys.as_dict(), 128, 1)
    for text in (repr(args), str(args), repr(keys), repr(server.keys)):
        assert keys.client_secret not in text
        assert server.keys.server_secret not in text
    assert server.address in repr(args)
    # the keys still travel: msgpack (stdin, the Ray actor call) carries them
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(args), type=WorkerArgs)
    assert ClientKeys.from_dict(decoded.rendezvous_keys) == keys
