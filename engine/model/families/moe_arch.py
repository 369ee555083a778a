"""The mixture-of-experts family's declaration (no torch): Mixtral, Qwen2-MoE and
Qwen3-MoE, each naming its experts in its own config fields."""
from __future__ import annotations

from typing import Any

from engine.model.families.arch import Architecture, Family, ShapeFields
from engine.model.families.llama_arch import qk_normed
from engine.model.shape_parts import MoEShape


def local_experts(cfg: Any, **extra: Any) -> MoEShape:
    """Experts in Mixtral's config fields (num_local_experts, num_experts_per_tok, each
    intermediate_size wide), renormalised over the chosen ones; gpt-oss and Granite
    4.0-H name theirs the same way. extra: the MoEShape fields a family adds."""
    return MoEShape(num_experts=cfg.num_local_experts, top_k=cfg.num_experts_per_tok,
                    intermediate_size=cfg.intermediate_size, renormalize=True, **extra)


def _mixtral(cfg: Any) -> ShapeFields:
    return {"moe": local_experts(cfg)}


def _qwen_moe(cfg: Any) -> ShapeFields:
    """Qwen2/3-MoE: experts every decoder_sparse_step-th layer except mlp_only_layers
    (dense MLPs there), renormalised when norm_topk_prob; Qwen2-MoE's shared expert."""
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    only_mlp = set(getattr(cfg, "mlp_only_layers", None) or ())
    dense = tuple(i for i in range(cfg.num_hidden_layers)
                  if i in only_mlp or cfg.num_experts == 0 or (i + 1) % step)
    return {"moe": MoEShape(num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                            intermediate_size=cfg.moe_intermediate_size,
                            renormalize=bool(getattr(cfg, "norm_topk_prob", False)),
                            dense_layers=dense,
                            shared_intermediate_size=int(
                                getattr(cfg, "shared_expert_intermediate_size", 0) or 0))}


def _qwen3_moe(cfg: Any) -> ShapeFields:
    return {**_qwen_moe(cfg), **qk_normed(cfg)}


FAMILY = Family(module="moe", architectures=(
    Architecture("MixtralForCausalLM", "mixtral", _mixtral),
    Architecture("Qwen2MoeForCausalLM", "qwen2_moe", _qwen_moe),
    Architecture("Qwen3MoeForCausalLM", "qwen3_moe", _qwen3_moe),
))

__all__ = ["FAMILY", "local_experts"]
