"""The tensor-parallel rendezvous: a torch.distributed Store behind a CURVE socket.

Why not `init_process_group(init_method="tcp://host:port")`: that makes rank 0 run
torch's TCPStore, which listens on every interface of the node (whatever host the URL
names) and answers anyone. Whoever reaches the port can read and write the keys the
ranks exchange while they form the group (each rank's gloo/NCCL socket address, NCCL's
unique id), take a rank's place, and so feed the workers the commands rank 0 broadcasts.

So rank 0 serves the store itself, on a ZMQ ROUTER socket that is a CURVE server
(engine.wire.curve_auth, the engine-core sockets' code): a fresh key pair for the
server and one client pair, made per engine, and a ZAP handler that admits only that
client key. The workers get the server's public key and the client pair inside their
WorkerArgs: through the Ray actor call (Ray's token authentication guards it) or on a
local worker's stdin, never in argv, and WorkerArgs' repr hides them. A peer without
the client key fails the CURVE handshake: its frames never reach the store.

What stays open: gloo's and NCCL's own data sockets listen on the node's address once
the group forms. Their addresses are published only through this store, and a rank
joins only with a peer that the store named.
"""
from __future__ import annotations

import itertools
import threading
import time
from datetime import timedelta

import msgspec
import torch.distributed as dist
import zmq

from engine.wire.curve_auth import ClientKeys, CurveServer, EngineKeys
from engine.wire.ports import free_port

# How often a blocked get/wait asks again (the rendezvous is a few dozen keys).
_POLL_S = 0.005


class RendezvousServer:
    """Rank 0's side: the key/value table and the CURVE socket in front of it, served
    on a daemon thread until stop()."""

    def __init__(self, host: str) -> None:
        self.keys = EngineKeys.generate()
        self._context = zmq.Context()
        self._curve = CurveServer(self._context, self.keys)
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.linger = 0
        self._curve.apply(self._socket)
        for attempt in range(5):
            port = free_port(host)
            try:
                self._socket.bind(f"tcp://{host}:{port}")
                break
            except zmq.ZMQError:  # taken between the check and the bind
                if attempt == 4:
                    raise
        self.address = f"tcp://{host}:{port}"
        self.table: dict[str, bytes] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="tp-rendezvous", daemon=True)
        self._thread.start()

    def client_keys(self) -> ClientKeys:
        return self.keys.for_clients()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stopping.is_set():
            if not poller.poll(100):
                continue
            ident, payload = self._socket.recv_multipart()
            seq, reply = self._answer(payload)
            self._socket.send_multipart([ident, msgspec.msgpack.encode([seq, reply])])

    def _answer(self, payload: bytes):
        try:
            seq, op, *args = msgspec.msgpack.decode(payload)
        except Exception:
            return -1, None
        t = self.table
        if op == "set":
            t[args[0]] = args[1]
            return seq, True
        if op == "get":
            return seq, t.get(args[0])
        if op == "add":
            value = int(t.get(args[0], b"0")) + args[1]
            t[args[0]] = str(value).encode()
            return seq, value
        if op == "check":
            return seq, all(k in t for k in args[0])
        if op == "delete":
            return seq, t.pop(args[0], None) is not None
        if op == "num_keys":
            return seq, len(t)
        if op == "compare_set":
            key, expected, desired = args
            current = t.get(key)
            if (current is None and not expected) or current == expected:
                t[key] = desired
                return seq, desired
            return seq, current if current is not None else expected
        return seq, None

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=5)
        self._socket.close(linger=0)
        self._curve.stop()
        self._context.term()


class RendezvousStore(dist.Store):
    """A rank's client of the RendezvousServer, as the Store init_process_group takes.

    One request at a time (a lock), each numbered so that a late answer to a request
    that timed out is never taken for the next one's."""

    def __init__(self, address: str, keys: ClientKeys, timeout_s: float = 120.0) -> None:
        super().__init__()
        self.address, self.timeout_s = address, timeout_s
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.linger = 0
        keys.apply(self._socket)
        self._socket.connect(address)
        self._lock = threading.Lock()
        self._seq = itertools.count()

    def _call(self, op: str, *args):
        with self._lock:
            seq = next(self._seq)
            self._socket.send(msgspec.msgpack.encode([seq, op, *args]))
            deadline = time.monotonic() + self.timeout_s
            while True:
                left_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
                if not self._socket.poll(left_ms):
                    raise TimeoutError(
                        f"the tensor-parallel rendezvous at {self.address} did not answer "
                        f"within {self.timeout_s:g} s")
                got, reply = msgspec.msgpack.decode(self._socket.recv())
                if got == seq:
                    return reply

    def _until(self, predicate, what: str):
        deadline = time.monotonic() + self.timeout_s
        while True:
            value = predicate()
            if value is not None and value is not False:
                return value
            if time.monotonic() >= deadline:
                raise TimeoutError(f"tensor-parallel rendezvous: {what} not set within "
                                   f"{self.timeout_s:g} s")
            time.sleep(_POLL_S)

    # ---- the Store interface torch.distributed calls ---------------------------------
    def set(self, key: str, value) -> None:
        self._call("set", key, _bytes(value))

    def get(self, key: str) -> bytes:
        return self._until(lambda: self._call("get", key), repr(key))

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, int(amount))

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", list(keys)))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._until(lambda: self.check(keys), ", ".join(keys))

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete", key))

    def num_keys(self) -> int:
        return self._call("num_keys")

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._call("compare_set", key, _bytes(expected), _bytes(desired))

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout_s = timeout.total_seconds()

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()


def _bytes(value) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


__all__ = ["RendezvousServer", "RendezvousStore"]
