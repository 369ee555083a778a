"""KVTransferConfig: vLLM's --kv-transfer-config (a JSON object), checked once at start.

Field names and defaults are vLLM 0.32's, so a vLLM command line carries over. What this
engine does not serve (an unknown key, a connector it lacks, a connector loaded from an
arbitrary module, vLLM's experimental HND->NHD permute) is refused by name when the
config is built, never accepted and ignored. kv_transfer_from_options also applies
vLLM's shorthand (--kv-offloading-size) the way vLLM does.

The connector name is checked against engine.kv_transfer.registry, imported only when a
name is checked: engine.config imports this module, so the registry must import no
connector (tests/test_import_graph.py), as spec_decode's registry names its classes.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Literal

import msgspec

from engine.errors import InvalidRequestError

ROLES = ("kv_producer", "kv_consumer", "kv_both")
FAILURE_POLICIES = ("fail", "recompute")
BUFFER_DEVICES = ("cpu", "cuda")
OFFLOADING_CONNECTOR = "OffloadingConnector"  # what kv_offloading_size configures
# vLLM's connectors that are known here and not served, with why (a short reason each)
VLLM_ONLY_CONNECTORS = {
    "NixlConnector": "a GPU-cluster transport: NIXL over RDMA",
    "LMCacheConnectorV1": "LMCache's GPU engine",
    "P2pNcclConnector": "a GPU-cluster transport: NCCL",
    "MooncakeConnector": "a GPU-cluster transport: Mooncake over RDMA",
    "MultiConnector": "it chains vLLM's connectors",
    "ExampleConnector": "vLLM's example for its own tests",
}
NOT_SERVED_DOC = "docs/serving.md"


def served_connector_names() -> list[str]:
    """The connectors this install serves: the registry's, by vLLM's names."""
    from engine.kv_transfer.registry import connector_names  # names only: no torch
    return list(connector_names())


def check_connector_name(name: str) -> None:
    """Refuse a kv_connector this engine does not serve, naming it and the served ones."""
    served = served_connector_names()
    if name in served:
        return
    listed = ", ".join(served)
    if name in VLLM_ONLY_CONNECTORS:
        raise InvalidRequestError(
            f"kv_transfer_config: kv_connector {name!r} is vLLM's, not served here "
            f"({VLLM_ONLY_CONNECTORS[name]}; see {NOT_SERVED_DOC}); served: {listed}")
    raise InvalidRequestError(f"kv_transfer_config: unknown kv_connector {name!r}; "
                              f"served: {listed}")


class KVTransferConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which connector moves this engine's KV blocks, and in which direction."""

    kv_connector: str  # the connector, by vLLM's name
    kv_role: Literal["kv_producer", "kv_consumer", "kv_both"]
    kv_connector_extra_config: dict[str, Any] = {}  # the connector's own options
    # a block that fails to load: the request fails, or its blocks are recomputed
    kv_load_failure_policy: Literal["fail", "recompute"] = "fail"
    # this engine's id among its peers; drawn once, when the config is built (as vLLM),
    # and kept by every copy of the config (asdict, replace, pickle, the Serve config)
    engine_id: str = msgspec.field(default_factory=lambda: str(uuid.uuid4()))
    kv_port: int = 14579  # the port a connector's peers reach it on
    kv_buffer_device: str = "cpu"  # where KV is staged for a transfer
    kv_connector_module_path: str | None = None  # vLLM's: refused when set
    enable_permute_local_kv: bool = False  # vLLM's experiment: refused when true

    def __post_init__(self) -> None:
        _check(msgspec.structs.asdict(self))

    @property
    def is_producer(self) -> bool:
        """This engine saves KV blocks for others (kv_producer or kv_both)."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        """This engine loads KV blocks others saved (kv_consumer or kv_both)."""
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        """How AppArgs (pydantic), which carries an EngineConfig, reads and dumps one: the
        value is taken as given, for EngineConfig.__post_init__ to parse together with
        kv_offloading_size (which may complete a partial config, as in vLLM), and dumped
        as its JSON object (the Serve config)."""
        from pydantic_core import core_schema
        return core_schema.no_info_plain_validator_function(
            lambda value: value, json_schema_input_schema=core_schema.dict_schema(),
            serialization=core_schema.plain_serializer_function_ser_schema(
                msgspec.to_builtins, return_schema=core_schema.dict_schema()))


FIELDS = KVTransferConfig.__struct_fields__


def _check(values: dict[str, Any]) -> None:
    """The value checks, on a mapping, so that they run before msgspec's type checks
    (whose words for a bad Literal name neither the choices nor the option)."""
    role = values.get("kv_role")
    policy = values.get("kv_load_failure_policy", "fail")
    device = values.get("kv_buffer_device", "cpu")
    port = values.get("kv_port", 14579)
    checks = [
        (role in ROLES, f"kv_transfer_config: kv_role must be one of {', '.join(ROLES)}, "
                        f"got {role!r}"),
        (policy in FAILURE_POLICIES, "kv_transfer_config: kv_load_failure_policy must be "
                                     f"fail or recompute, got {policy!r}"),
        (device in BUFFER_DEVICES, "kv_transfer_config: kv_buffer_device must be cpu or "
                                   f"cuda, got {device!r}"),
        (not isinstance(port, int) or isinstance(port, bool) or 0 < port < 65536,
         f"kv_transfer_config: kv_port must be a port number (1-65535), got {port!r}"),
        (values.get("kv_connector_module_path") is None,
         "kv_transfer_config: kv_connector_module_path: loading connectors from arbitrary "
         f"modules is not supported; Flotilla's connectors: "
         f"{', '.join(served_connector_names())}"),
        (values.get("enable_permute_local_kv") is not True,
         "kv_transfer_config: enable_permute_local_kv (vLLM's experimental HND->NHD "
         "transfer) is not served"),
    ]
    for ok, message in checks:
        if not ok:
            raise InvalidRequestError(message)
    if isinstance(values.get("kv_connector"), str):
        check_connector_name(values["kv_connector"])


def _decoded(value: Any) -> Any:
    """A JSON string (as the CLI gives it) decoded; anything else as it is."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"kv_transfer_config: not valid JSON ({exc.msg}, at "
                                  f"character {exc.pos})") from None


def parse_kv_transfer_config(
        value: str | dict[str, Any] | KVTransferConfig | None) -> KVTransferConfig | None:
    """The config from a JSON string, a dict or a config; None when none is given."""
    value = _decoded(value)
    if value is None or isinstance(value, KVTransferConfig):
        return value
    if not isinstance(value, dict):
        raise InvalidRequestError("kv_transfer_config must be a JSON object, got "
                                  f"{type(value).__name__}")
    unknown = sorted(set(value) - set(FIELDS))
    if unknown:
        raise InvalidRequestError(f"kv_transfer_config: unknown key(s) {', '.join(unknown)}"
                                  f" (accepted: {', '.join(FIELDS)})")
    if value.get("kv_connector") is None:
        raise InvalidRequestError("kv_transfer_config needs a kv_connector (served: "
                                  f"{', '.join(served_connector_names())})")
    if value.get("kv_role") is None:
        raise InvalidRequestError("kv_transfer_config: kv_role is required with a "
                                  f"kv_connector ({', '.join(ROLES)})")
    if value.get("engine_id", ...) is None:  # vLLM's null: an id drawn here
        value = {k: v for k, v in value.items() if k != "engine_id"}
    _check(value)
    try:
        return msgspec.convert(value, KVTransferConfig)
    except msgspec.ValidationError as exc:  # a wrong type: msgspec names the field
        raise InvalidRequestError(
            f"kv_transfer_config: {str(exc).replace('`$.', '`')}") from None


def kv_transfer_from_options(value: str | dict[str, Any] | KVTransferConfig | None,
                             kv_offloading_size: float | None,
                             kv_offloading_backend: str = "native") -> KVTransferConfig | None:
    """The effective kv_transfer_config of EngineConfig's three options.

    kv_offloading_size (GiB) is vLLM's shorthand for OffloadingConnector, kv_both, with
    cpu_bytes_to_use in its extra config. Given beside a kv_transfer_config, vLLM writes
    those three into it; here they are written where the config leaves them unset or
    agrees, and refused where vLLM would overwrite what the config says (its connector,
    say). The result satisfies the shorthand again, so a copy of an EngineConfig that
    carries both options (asdict, replace) builds the same config.
    """
    if kv_offloading_backend == "lmcache":
        raise InvalidRequestError(
            "kv_offloading_backend lmcache is not served: LMCache's engine does not run on "
            "a CPU engine here; use native (OffloadingConnector)")
    if kv_offloading_backend != "native":
        raise InvalidRequestError(f"kv_offloading_backend must be native, got "
                                  f"{kv_offloading_backend!r}")
    if kv_offloading_size is None:
        return parse_kv_transfer_config(value)
    if (not isinstance(kv_offloading_size, (int, float)) or isinstance(kv_offloading_size, bool)
            or not kv_offloading_size > 0):
        raise InvalidRequestError(f"kv_offloading_size must be > 0 (GiB), got "
                                  f"{kv_offloading_size!r}")
    cpu_bytes = int(kv_offloading_size * 2 ** 30)
    given = _decoded(value)
    if isinstance(given, KVTransferConfig):
        given = msgspec.to_builtins(given)
    given = dict(given or {})
    extra = given.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        return parse_kv_transfer_config(given)  # refused there, naming the field
    for key, wanted, said in (("kv_connector", OFFLOADING_CONNECTOR, given.get("kv_connector")),
                              ("kv_role", "kv_both", given.get("kv_role")),
                              ("cpu_bytes_to_use", cpu_bytes, extra.get("cpu_bytes_to_use"))):
        if said is not None and said != wanted:
            raise InvalidRequestError(
                f"kv_offloading_size sets kv_transfer_config's {key} to {wanted!r}; "
                f"kv_transfer_config gives {said!r}: give one or the other")
    return parse_kv_transfer_config({
        **given, "kv_connector": OFFLOADING_CONNECTOR, "kv_role": "kv_both",
        "kv_connector_extra_config": {**extra, "cpu_bytes_to_use": cpu_bytes}})


__all__ = ["KVTransferConfig", "parse_kv_transfer_config", "kv_transfer_from_options",
           "check_connector_name", "served_connector_names", "VLLM_ONLY_CONNECTORS"]
