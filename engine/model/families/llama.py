"""Llama-family decoder (Llama, SmolLM, Mistral, Qwen2, Qwen3) over a paged KV cache.

The shared decoder (engine.model.families.base) as it is: the variants differ only in
flags their declaration reads from the Hugging Face config (engine/model/families/
llama_arch.py: qkv bias for Qwen2, q/k RMSNorm for Qwen3), and in what every family
reads alike (tied embeddings, sliding windows, RoPE scaling).
"""
from __future__ import annotations

from engine.model.families.base import DecoderForCausalLM
from engine.model.families.llama_arch import FAMILY


class LlamaForCausalLM(DecoderForCausalLM):
    """The decoder stack plus LM head; forward returns hidden states of every token."""


# the architectures this family serves (its declaration's, which the registry lists)
ARCHITECTURES = FAMILY.classes(LlamaForCausalLM)

__all__ = ["ARCHITECTURES", "LlamaForCausalLM"]
