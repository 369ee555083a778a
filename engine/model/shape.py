"""The numbers of a checkpoint that the engine needs, read once from its Hugging Face config.

Every family reads into the same ModelShape: the KV cache, the scheduler, tensor
parallelism and the loaders need the attention and MLP sizes whatever the family; a
mixture-of-experts model adds its MoEShape. Reading it needs no torch (the registry
names the family by strings), so configuration-only processes can check a model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import UnsupportedModelError
from engine.model.registry import resolve_architecture


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


@dataclass(frozen=True)
class ModelShape:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    # each layer's sliding window: a query sees itself and the window - 1 keys before it
    # (0: the whole context)
    layer_windows: tuple[int, ...] = ()
    moe: MoEShape | None = None
    attention_scale: float = 0.0  # the scores' scale (0: head_dim ** -0.5)
    attention_sinks: bool = False  # a learned logit per head in every softmax (gpt-oss)
    rope: bool = True  # False: attention without positions (NoPE, Granite 4.0-H)
    mamba: MambaShape | None = None  # a hybrid's state-space mixers
    mlp_activation: str = "silu"  # the gated MLP's: silu, or gelu_tanh (Gemma's GeGLU)

    def is_mamba(self, layer: int) -> bool:
        return self.mamba is not None and layer in self.mamba.layers

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    def is_sparse(self, layer: int) -> bool:
        """Whether a layer's MLP is the mixture of experts."""
        return self.moe is not None and layer not in self.moe.dense_layers

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "ModelShape":
        """Raises UnsupportedModelError for an architecture or activation no family serves."""
        arch = resolve_architecture(cfg)
        heads = cfg.num_attention_heads
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        gemma = arch == "Gemma3ForCausalLM"
        granite = arch == "GraniteMoeHybridForCausalLM"
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
        if act != ("gelu_pytorch_tanh" if gemma else "silu"):
            raise UnsupportedModelError(
                f"hidden activation {act!r} is not supported for {arch} (only "
                f"{'gelu_pytorch_tanh' if gemma else 'silu'})")
        return cls(
            architecture=arch,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            # Granite 4.0-H: its dense MLP is the shared one; intermediate_size is an expert's
            intermediate_size=cfg.shared_intermediate_size if granite else cfg.intermediate_size,
            rms_norm_eps=cfg.rms_norm_eps,
            qkv_bias=is_qwen2 or attention_bias or bool(getattr(cfg, "qkv_bias", False)),
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            max_position_embeddings=cfg.max_position_embeddings,
            layer_windows=layer_windows(cfg),
            moe=_moe_shape(arch, cfg),
            attention_scale=(float(cfg.query_pre_attn_scalar) ** -0.5 if gemma
                             else float(cfg.attention_multiplier) if granite else 0.0),
            mlp_activation="gelu_tanh" if gemma else "silu",
            attention_sinks=arch == "GptOssForCausalLM",
            rope=not granite or getattr(cfg, "position_embedding_type", None) == "rope",
            mamba=_mamba_shape(cfg) if granite else None,
        )


def _mamba_shape(cfg: Any) -> MambaShape:
    types = list(getattr(cfg, "layer_types", None) or [])
    low, high = tuple(getattr(cfg, "time_step_limit", None) or (0.0, float("inf")))
    return MambaShape(
        layers=tuple(i for i, t in enumerate(types) if t in ("linear_attention", "mamba")),
        num_heads=cfg.mamba_n_heads, head_dim=cfg.mamba_d_head, num_groups=cfg.mamba_n_groups,
        d_state=cfg.mamba_d_state, d_conv=cfg.mamba_d_conv, conv_bias=bool(cfg.mamba_conv_bias),
        proj_bias=bool(cfg.mamba_proj_bias), chunk_size=cfg.mamba_chunk_size,
        dt_min=float(low), dt_max=float(high))


def layer_windows(cfg: Any) -> tuple[int, ...]:
    """Each layer's sliding window from the config: `layer_types` where the config has
    them (Gemma 3, gpt-oss, Qwen2's max_window_layers), else `sliding_window` for every
    layer (Mistral); Qwen's use_sliding_window switches it off."""
    window = getattr(cfg, "sliding_window", None) or 0
    if not getattr(cfg, "use_sliding_window", True):
        window = 0
    types = getattr(cfg, "layer_types", None)
    if types is None:
        return (int(window),) * cfg.num_hidden_layers
    # linear_attention / mamba: a hybrid's state-space layers (no window: not attention)
    unknown = set(types) - {"sliding_attention", "full_attention", "attention",
                            "linear_attention", "mamba"}
    if unknown:
        raise UnsupportedModelError(f"layer types {sorted(unknown)} are not supported "
                                    "(full_attention, sliding_attention, and Mamba layers)")
    return tuple(int(window) if t == "sliding_attention" else 0 for t in types)


def _moe_shape(arch: str, cfg: Any) -> MoEShape | None:
    """The experts of a mixture-of-experts config, in each family's own field names."""
    if arch == "MixtralForCausalLM":
        return MoEShape(num_experts=cfg.num_local_experts, top_k=cfg.num_experts_per_tok,
                        intermediate_size=cfg.intermediate_size, renormalize=True)
    if arch in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):
        step = getattr(cfg, "decoder_sparse_step", 1) or 1
        only_mlp = set(getattr(cfg, "mlp_only_layers", None) or ())
        dense = tuple(i for i in range(cfg.num_hidden_layers)
                      if i in only_mlp or cfg.num_experts == 0 or (i + 1) % step)
        return MoEShape(num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                        intermediate_size=cfg.moe_intermediate_size,
                        renormalize=bool(getattr(cfg, "norm_topk_prob", False)),
                        dense_layers=dense,
                        shared_intermediate_size=int(
                            getattr(cfg, "shared_expert_intermediate_size", 0) or 0))
    if arch == "GraniteMoeHybridForCausalLM":
        if not cfg.num_local_experts:
            return None
        return MoEShape(num_experts=cfg.num_local_experts, top_k=cfg.num_experts_per_tok,
                        intermediate_size=cfg.intermediate_size, renormalize=True)
    if arch == "GptOssForCausalLM":
        return MoEShape(num_experts=cfg.num_local_experts, top_k=cfg.num_experts_per_tok,
                        intermediate_size=cfg.intermediate_size, renormalize=True,
                        biased=True, swiglu_alpha=float(cfg.swiglu_alpha),
                        swiglu_limit=float(cfg.swiglu_limit))
    return None


def fused_pieces(shape: ModelShape, fused: str) -> tuple[tuple[str, int, int], ...]:
    """(module, first row, rows) of each piece of a checkpoint's fused projection (Phi-3's
    qkv_proj: q, k, v; gate_up_proj: gate, up), for the loader and LoRA adapters alike."""
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    if fused == "qkv_proj":
        return ("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)
    if fused == "gate_up_proj":
        i = shape.intermediate_size
        return ("gate_proj", 0, i), ("up_proj", i, i)
    raise KeyError(fused)


FUSED_PROJECTIONS = ("qkv_proj", "gate_up_proj")

__all__ = ["FUSED_PROJECTIONS", "MambaShape", "ModelShape", "MoEShape", "fused_pieces"]
