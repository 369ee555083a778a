"""Rotary position embedding with a precomputed cos/sin table.

The inverse frequencies come from transformers' own RoPE functions for the
scaled variants (linear, llama3, yarn, longrope, ...), so parity with HF holds for
every static scaling type; dynamic NTK changes with sequence length and is refused.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.errors import UnsupportedModelError

_SEQ_LEN_DEPENDENT = {"dynamic"}


def rope_inv_freq(hf_config: PretrainedConfig, head_dim: int,
                  max_positions: int | None = None,
                  layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale of the model's RoPE variant.

    LongRoPE (Phi-3) has two sets of factors, the short ones for contexts within the
    original training length and the long ones past it. Transformers switches per
    forward by the sequence's length, which a KV cache cannot follow (the keys were
    rotated when written), so the engine picks once, as vLLM does: the long factors
    when max_positions (max_model_len) passes the original length, else the short.

    layer_type: for configs whose rope_parameters are per layer type (Gemma 3: its local
    layers' base and its global layers' base and scaling), that type's."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if layer_type is not None:
        params = dict(params.get(layer_type) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModelError(
            f"partial_rotary_factor {params['partial_rotary_factor']} is not supported "
            "(RoPE rotates whole heads here)")
    if rope_type == "default":
        base = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu")
                              / head_dim))
        return inv.float(), 1.0
    if rope_type in _SEQ_LEN_DEPENDENT or rope_type not in ROPE_INIT_FUNCTIONS:
        raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported")
    if rope_type == "longrope":
        original = int(params.get("original_max_position_embeddings")
                       or getattr(hf_config, "original_max_position_embeddings", 0) or 0)
        long = max_positions is not None and max_positions > original
        inv, scale = ROPE_INIT_FUNCTIONS[rope_type](
            hf_config, torch.device("cpu"), seq_len=max_positions if long else None)
        return inv.float(), float(scale)
    # on the CPU even while the model is built on the meta device (transformers' own
    # functions make some of their tensors on the current device)
    with torch.device("cpu"):
        inv, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"),
                                                    layer_type=layer_type)
    return inv.float(), float(scale)


class RotaryEmbedding(torch.nn.Module):
    """Applies neox-style (rotate-half) RoPE to q and k given absolute positions."""

    def __init__(self, hf_config: PretrainedConfig, head_dim: int, max_positions: int,
                 layer_type: str | None = None) -> None:
        super().__init__()
        # on the CPU whatever device is current: the model is first built on the meta
        # device, where arange runs through torch's Python references, whose first call
        # imports torch._dynamo and inductor (1.7 s of every engine start)
        inv_freq, scale = rope_inv_freq(hf_config, head_dim, max_positions, layer_type)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float, device="cpu"),
                            inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> "Rope":
        """What every layer of a step needs to rotate its q and k."""
        return Rope(positions, self.cos[positions].unsqueeze(1).to(dtype),
                    self.sin[positions].unsqueeze(1).to(dtype), self.cos, self.sin)


@dataclass
class Rope:
    positions: torch.Tensor  # [T] int64
    cos: torch.Tensor  # [T, 1, D] rows for the positions (torch path)
    sin: torch.Tensor
    cos_table: torch.Tensor  # [max_positions, D] whole tables (native kernel)
    sin_table: torch.Tensor


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, D], k: [T, KVH, D] -> rotated copies (neox / rotate-half style)."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
