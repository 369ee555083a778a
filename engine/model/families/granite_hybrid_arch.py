"""The Granite 4.0-H family's declaration (no torch): Mamba-2 mixers beside attention
layers, a shared MLP, experts where num_local_experts is set, and Granite's scalings."""
from __future__ import annotations

from typing import Any

from engine.model.families.arch import Architecture, Family, ShapeFields
from engine.model.families.moe_arch import local_experts
from engine.model.shape_parts import MambaShape


def _mamba(cfg: Any) -> MambaShape:
    types = list(getattr(cfg, "layer_types", None) or [])
    low, high = tuple(getattr(cfg, "time_step_limit", None) or (0.0, float("inf")))
    return MambaShape(
        layers=tuple(i for i, t in enumerate(types) if t in ("linear_attention", "mamba")),
        num_heads=cfg.mamba_n_heads, head_dim=cfg.mamba_d_head, num_groups=cfg.mamba_n_groups,
        d_state=cfg.mamba_d_state, d_conv=cfg.mamba_d_conv, conv_bias=bool(cfg.mamba_conv_bias),
        proj_bias=bool(cfg.mamba_proj_bias), chunk_size=cfg.mamba_chunk_size,
        dt_min=float(low), dt_max=float(high))


def _granite_hybrid(cfg: Any) -> ShapeFields:
    return {
        # its dense MLP is the shared one; intermediate_size is an expert's
        "intermediate_size": cfg.shared_intermediate_size,
        "attention_scale": float(cfg.attention_multiplier),
        # no positions (NoPE) unless the config asks for RoPE
        "rope": getattr(cfg, "position_embedding_type", None) == "rope",
        "moe": local_experts(cfg) if cfg.num_local_experts else None,
        "mamba": _mamba(cfg),
    }


FAMILY = Family(module="granite_hybrid", architectures=(
    Architecture("GraniteMoeHybridForCausalLM", "granitemoehybrid", _granite_hybrid),))

__all__ = ["FAMILY"]
