"""The KV connectors by vLLM's `kv_connector` names, and the one place a connector is
built for an engine's pool.

Why a registry: kv_transfer_config names a connector, and the config check, the engine
and the docs all need the same list; a connector is a module under connectors/ with a
`build(extra_config, context) -> Connector`. The builders are named, not imported, so
that checking a config (the CLI, the ingress) imports neither torch nor the engine core.
"""
from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.kv_transfer.base import Connector, ConnectorContext

CONNECTORS: dict[str, str] = {
    "OffloadingConnector": "engine.kv_transfer.connectors.offloading:build",
}


def connector_names() -> list[str]:
    return sorted(CONNECTORS)


def build_connector(name: str, extra_config: dict, context: "ConnectorContext") -> "Connector":
    """The named connector over the pool of `context` (its config was checked when the
    engine's config was made: the name is one of CONNECTORS)."""
    module, _, function = CONNECTORS[name].partition(":")
    return getattr(import_module(module), function)(dict(extra_config), context)


__all__ = ["CONNECTORS", "build_connector", "connector_names"]
