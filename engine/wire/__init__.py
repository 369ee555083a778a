"""The engine-core wire: msgspec message types (protocol), the ZMQ server around an
engine core (core_server), the client the frontend uses to reach one or many engines
(core_client), the model-free mock engine, and the rules that aggregate utility results
across data-parallel engines. See docs/architecture.md."""
