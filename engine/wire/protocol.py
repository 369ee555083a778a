"""The engine-core transport: frame kinds, the protocol version and the handshake.

The engine-core server (core_server.py) and its clients (core_client.py, the
coordinator's probe) exchange ZMQ multipart messages; this module says how a message is
framed. The payloads are the engine core's own messages (engine/core_messages.py),
msgpack-encoded (nothing is ever pickled); only the handshake's Hello is the wire's own.

Frames (ZMQ multipart, after the ROUTER's routing id on the engine side):
  client -> engine: [type byte, msgpack payload]
    ADD            EngineCoreRequest
    ABORT          list[str]: request ids (one message may abort many)
    START_DP_WAVE  StartDPWave
    UTILITY        UtilityRequest
    HELLO          Hello (first frame of every connection)
    PING           empty: the client is alive (every CLIENT_PING_S); an engine aborts the
                   requests of a client it has not heard from for its client timeout
  engine -> client: [type byte, msgpack payload]
    READY          EngineCoreReadyResponse (answer to HELLO; the server stamps its
                   protocol_version with PROTOCOL_VERSION)
    OUTPUTS        EngineCoreOutputs (kv_events: prefix-cache changes, to every client)
"""
from __future__ import annotations

import msgspec

PROTOCOL_VERSION = 2  # 2: clients PING; an engine drops a silent client's requests

# client -> engine request types (docs/architecture.md, "The wire contract")
ADD = b"\x00"
ABORT = b"\x01"
START_DP_WAVE = b"\x02"
UTILITY = b"\x03"
PING = b"\x04"
HELLO = b"\x10"
# engine -> client frame types
READY = b"\x20"
OUTPUTS = b"\x21"


class Hello(msgspec.Struct, omit_defaults=True):
    """First message of a connection; the engine answers with READY."""

    client_id: str
    # absent on the wire means 1: a version-1 peer left out its own default (a default of
    # PROTOCOL_VERSION would read an old peer as a current one); senders always set it
    protocol_version: int = 1
