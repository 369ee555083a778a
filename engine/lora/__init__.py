"""LoRA adapters: PEFT adapters read into the fused layers (adapter), the device slots
and batched low-rank products (slots), and which adapter is in which slot (manager)."""
from engine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
