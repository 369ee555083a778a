"""Authenticated, encrypted engine-core sockets (ZMQ CURVE).

An engine's port is bound on its node's address, and whoever reaches it could call
`sleep`, `reset_prefix_cache` or `add_lora`, read every stream, or send requests past
the ingress's API keys. So an engine started under Serve makes two key pairs at start:
its own (the CURVE server's) and one for its clients. The clients' pair and the
server's public key travel only through Ray, with the engine's address, in the
coordinator's registry; an engine's ZAP handler admits no other client key. A peer
without them gets no READY, sends no frame that reaches the engine, and a network
reader sees only ciphertext.

Why CURVE and not a shared secret in HELLO: a secret in the first frame goes over the
wire in the clear, so anyone who can read the network can replay it, and nothing after
the handshake would be authenticated (a ZMQ routing id can be reused). CURVE
authenticates every connection, encrypts what follows, and libzmq (bundled with
pyzmq's wheels, libsodium included) does it below the protocol, on ZMQ's own I/O
threads. Its cost, `bench/frontend.py --curve` against two zero-latency mock engines,
64 streams (Intel Xeon with AMX, 2 cores): 73.6-77.2k streamed tokens/s against
75.6-82.2k in the clear, the client's CPU per token unchanged (11.2 us).

Keys are Z85 text (40 characters), as ZMQ takes them. Without keys (EngineCoreServer /
EngineClient.connect given none: tests, a server run by hand on a trusted host) the
socket is plain, as before.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

ZAP_DOMAIN = "flotilla-engine"


@dataclass(frozen=True)
class ClientKeys:
    """What a client needs to connect to one engine: the engine's public key and the
    client key pair it admits. Plain strings, so it crosses Ray as a dict."""

    server_public: str
    client_public: str
    client_secret: str = field(repr=False)  # a logged ClientKeys shows no secret

    def as_dict(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, str]) -> "ClientKeys":
        return cls(**data)

    def apply(self, socket: zmq.Socket) -> None:
        """Make `socket` (before connect) a CURVE client of this engine."""
        socket.curve_serverkey = self.server_public.encode()
        socket.curve_publickey = self.client_public.encode()
        socket.curve_secretkey = self.client_secret.encode()


@dataclass(frozen=True)
class EngineKeys:
    """An engine's CURVE key pair and the one client pair it admits."""

    server_public: str
    server_secret: str = field(repr=False)
    client_public: str
    client_secret: str = field(repr=False)

    @classmethod
    def generate(cls) -> "EngineKeys":
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public.decode(), server_secret.decode(),
                   client_public.decode(), client_secret.decode())

    @classmethod
    def load(cls, path: str) -> "EngineKeys":
        """Keys from a JSON file holding this class's four fields (a server run by hand:
        `flotilla serve-engine --curve-keys`, `flotilla mock-engine --curve-keys`)."""
        return cls(**json.loads(Path(path).read_text()))

    def for_clients(self) -> ClientKeys:
        return ClientKeys(self.server_public, self.client_public, self.client_secret)


def client_keys(by_address: dict[str, dict[str, str]]) -> dict[str, ClientKeys]:
    """address -> ClientKeys, from the dicts the coordinator hands out."""
    return {address: ClientKeys.from_dict(keys) for address, keys in by_address.items()}


class _AdmitOne:
    """ZAP credentials callback: only the engine's client public key passes."""

    def __init__(self, client_public: str) -> None:
        self._key = client_public.encode()

    def callback(self, domain: str, key: bytes) -> bool:
        return domain == ZAP_DOMAIN and key == self._key


class CurveServer:
    """The ZAP handler of one engine's ZMQ context (started before the socket binds,
    stopped before the context ends) and the options that make its socket a CURVE
    server."""

    def __init__(self, context: zmq.Context, keys: EngineKeys) -> None:
        self.keys = keys
        self._auth = ThreadAuthenticator(context)
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_AdmitOne(
            keys.client_public))

    def apply(self, socket: zmq.Socket) -> None:
        """Make `socket` (before bind) a CURVE server that asks the ZAP handler."""
        socket.curve_server = True
        socket.curve_publickey = self.keys.server_public.encode()
        socket.curve_secretkey = self.keys.server_secret.encode()
        socket.zap_domain = ZAP_DOMAIN.encode()

    def stop(self) -> None:
        self._auth.stop()


__all__ = ["ClientKeys", "CurveServer", "EngineKeys", "client_keys"]
