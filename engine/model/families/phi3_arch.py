"""The Phi-3 family's declaration (no torch): Phi-3 and Phi-4, the Llama shape read
whole; its loader splits fused float tensors, so quantized checkpoints are refused."""
from __future__ import annotations

from engine.model.families.arch import Architecture, Family

FAMILY = Family(module="phi3", architectures=(Architecture("Phi3ForCausalLM", "phi3"),),
                # the quantized formats' per-tensor pieces are not split at load
                quantized_refusal="a Phi-3 model (fused qkv_proj / gate_up_proj)")

__all__ = ["FAMILY"]
