"""The attention_backend option's values, without torch: the configuration checks the
option against them in processes that never load a model (engine.config); registry.py
maps each to its backend class and checks it holds these names."""
from __future__ import annotations

# in the order the option's help and its error message name them
BACKEND_NAMES = ("native", "flex", "triton", "torch")

__all__ = ["BACKEND_NAMES"]
