"""The numbers of a checkpoint that the engine needs, read once from its Hugging Face config.

Every family reads into the same ModelShape: the KV cache, the scheduler, tensor
parallelism and the loaders need the attention and MLP sizes whatever the family; a
mixture-of-experts model adds its MoEShape, a hybrid its MambaShape
(engine.model.shape_parts). The fields every family names alike are read here; the
ones a family reads its own way its declaration says (engine/model/families/*_arch.py,
found through the registry), so no architecture is named in this module. Reading it
needs no torch, so configuration-only processes can check a model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import UnsupportedModelError
from engine.model.registry import family, resolve_architecture
from engine.model.shape_parts import MambaShape, MoEShape

# a config's hidden activation -> the gated MLP's name for it (ModelShape.mlp_activation)
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


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
        """The shared fields, then those the architecture's family reads its own way.
        Raises UnsupportedModelError for an architecture or activation no family serves."""
        arch = resolve_architecture(cfg)
        served = family(arch)
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
        if act != served.activation:
            raise UnsupportedModelError(
                f"hidden activation {act!r} is not supported for {arch} (only "
                f"{served.activation})")
        return cls(architecture=arch, **{**shared_fields(cfg),
                                         "mlp_activation": _ACTIVATIONS[served.activation],
                                         **served.shape_fields(arch, cfg)})


def shared_fields(cfg: Any) -> dict[str, Any]:
    """The fields every family names alike in its config: the attention and MLP sizes,
    biases (attention_bias: q/k/v and o; qkv_bias: q/k/v only), the norms' epsilon,
    tied embeddings and each layer's window. A family's own fields replace these."""
    heads = cfg.num_attention_heads
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        intermediate_size=cfg.intermediate_size,
        rms_norm_eps=cfg.rms_norm_eps,
        qkv_bias=attention_bias or bool(getattr(cfg, "qkv_bias", False)),
        o_bias=attention_bias,
        mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
        qk_norm=False,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        max_position_embeddings=cfg.max_position_embeddings,
        layer_windows=layer_windows(cfg),
    )


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

__all__ = ["FUSED_PROJECTIONS", "MambaShape", "ModelShape", "MoEShape", "fused_pieces",
           "layer_windows", "shared_fields"]
