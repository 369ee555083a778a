"""The KV connectors, one module each (engine/kv_transfer/registry.py lists them by
vLLM's `kv_connector` names)."""
