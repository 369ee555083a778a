"""The optional parts of a ModelShape: a mixture of experts and a hybrid's Mamba mixers.

They sit below engine.model.shape so the families' declarations
(engine/model/families/*_arch.py) can build them without importing shape.py, which
asks those declarations (through the registry) how a config reads: one direction only.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoEShape:
    """A mixture-of-experts MLP: num_experts experts of width intermediate_size, top_k
    of them per token, their weights softmax probabilities renormalised over the chosen
    ones when `renormalize` (Mixtral always; Qwen2/3-MoE when norm_topk_prob). Layers in
    dense_layers keep an ordinary MLP of the model's intermediate_size. A shared expert
    (Qwen2-MoE) runs for every token beside the routed ones, scaled by a sigmoid gate."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    dense_layers: tuple[int, ...] = ()
    shared_intermediate_size: int = 0  # a shared expert every token runs (Qwen2-MoE)
    # gpt-oss: a bias on the router and on every expert's projections, and its clamped
    # SwiGLU, (up + 1) * g * sigmoid(alpha * g) with g <= limit and |up| <= limit
    biased: bool = False
    swiglu_alpha: float = 0.0  # 0: plain SwiGLU, silu(gate) * up
    swiglu_limit: float = 0.0


@dataclass(frozen=True)
class MambaShape:
    """The Mamba-2 mixers of a hybrid model (Granite 4.0-H): which layers they are, and
    their sizes. Each request keeps, per mixer layer, a convolution state (the last
    d_conv - 1 inputs of its conv_dim channels) and an SSM state [heads, head_dim,
    d_state], beside the attention layers' paged KV."""

    layers: tuple[int, ...]
    num_heads: int
    head_dim: int
    num_groups: int
    d_state: int
    d_conv: int
    conv_bias: bool
    proj_bias: bool
    chunk_size: int
    dt_min: float
    dt_max: float

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.num_groups * self.d_state

    @property
    def state_elements(self) -> int:
        """Elements of one request's state in one mixer layer (conv + SSM)."""
        return (self.d_conv - 1) * self.conv_dim + self.num_heads * self.head_dim * self.d_state


__all__ = ["MambaShape", "MoEShape"]
