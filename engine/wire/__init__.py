"""The engine-core wire: the frames, protocol version and handshake (protocol), the ZMQ
server around an engine core (core_server), the client the frontend uses to reach one or
many engines (core_client), and the rules that aggregate utility results across
data-parallel engines. The messages it carries are the engine core's own
(engine/core_messages.py). See docs/architecture.md."""
