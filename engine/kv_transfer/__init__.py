"""KV connectors: KV-cache blocks moved out of an engine's cache and back, between
engines or to a shared tier, as vLLM's --kv-transfer-config configures them.

config.py holds the option (vLLM's kv_transfer_config and its kv_offloading_size
shorthand, checked once at start), base.py the connector interface (a scheduler half in
the engine core, a worker half beside the model runner), registry.py the connectors by
vLLM's names (which the config checks a name against), connectors/ the connectors, and
tier.py the storage of the shared KV tier.
"""
