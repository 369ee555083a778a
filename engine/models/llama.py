"""Llama-family decoder (Llama, SmolLM, Mistral, Qwen2, Qwen3) over a paged KV cache.

One implementation covers the family: the variants differ only in flags read
from the Hugging Face config (qkv bias for Qwen2, q/k RMSNorm for Qwen3, tied
embeddings, RoPE scaling). q/k/v and gate/up projections are fused into one
matmul each; the loader slices the checkpoint's separate tensors into them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from engine.errors import UnsupportedModelError
from engine.layers.attention import AttentionMetadata, paged_attention
from engine.layers.linear import Linear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import Rope, RotaryEmbedding, apply_rotary

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM")


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a checkpoint that the engine needs, read once from its config."""

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
    sliding_window: int | None

    @classmethod
    def from_hf_config(cls, cfg: PretrainedConfig) -> "ModelShape":
        archs = list(getattr(cfg, "architectures", None) or [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            fallback = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                        "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
            arch = fallback.get(getattr(cfg, "model_type", ""))
        if arch is None:
            raise UnsupportedModelError(
                f"architecture {archs or cfg.model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        heads = cfg.num_attention_heads
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        window = getattr(cfg, "sliding_window", None)
        if is_qwen2 and not getattr(cfg, "use_sliding_window", False):
            window = None
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only silu)")
        return cls(
            architecture=arch,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            intermediate_size=cfg.intermediate_size,
            rms_norm_eps=cfg.rms_norm_eps,
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            max_position_embeddings=cfg.max_position_embeddings,
            sliding_window=window,
        )


class LlamaAttention(nn.Module):
    def __init__(self, shape: ModelShape, kernels=None) -> None:
        super().__init__()
        self.kernels = kernels
        self.num_heads, self.num_kv_heads, self.head_dim = (
            shape.num_heads, shape.num_kv_heads, shape.head_dim)
        self.q_size = shape.num_heads * shape.head_dim
        self.kv_size = shape.num_kv_heads * shape.head_dim
        self.qkv_proj = Linear(shape.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=shape.qkv_bias)
        self.o_proj = Linear(self.q_size, shape.hidden_size, bias=shape.o_bias)
        self.q_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps) if shape.qk_norm else None
        self.k_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps) if shape.qk_norm else None
        self.scale = shape.head_dim ** -0.5

    def forward(self, rope: Rope, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        native_rope = self.kernels is not None and self.q_norm is None
        if native_rope:  # rotate q and k heads in place inside the fused qkv rows
            self.kernels.rotary_inplace(qkv, rope.positions, rope.cos_table, rope.sin_table,
                                        self.num_heads + self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if not native_rope:
            q, k = apply_rotary(q, k, rope.cos, rope.sin)
        o = paged_attention(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, shape: ModelShape, kernels=None) -> None:
        super().__init__()
        self.kernels = kernels
        self.intermediate = shape.intermediate_size
        self.gate_up_proj = Linear(shape.hidden_size, 2 * shape.intermediate_size,
                                      bias=shape.mlp_bias)
        self.down_proj = Linear(shape.intermediate_size, shape.hidden_size,
                                   bias=shape.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.kernels is not None:
            return self.down_proj(self.kernels.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, shape: ModelShape, kernels=None) -> None:
        super().__init__()
        eps = shape.rms_norm_eps
        self.input_layernorm = RMSNorm(shape.hidden_size, eps, kernels)
        self.self_attn = LlamaAttention(shape, kernels)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, eps, kernels)
        self.mlp = LlamaMLP(shape, kernels)

    def forward(self, rope: Rope, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Takes the previous layer's output and the running residual stream."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """The decoder stack plus LM head; forward returns hidden states of every token."""

    def __init__(self, shape: ModelShape, hf_config: PretrainedConfig, max_positions: int,
                 kernels=None) -> None:
        """kernels: the compiled CPU ops module (engine.kernels), or None for torch ops."""
        super().__init__()
        self.shape = shape
        self.rotary = RotaryEmbedding(hf_config, shape.head_dim, max_positions)
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(shape, kernels)
                                    for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, kernels)
        self.lm_head = Linear(shape.hidden_size, shape.vocab_size, bias=False)
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """kv_caches: [num_layers, 2, KVH, num_blocks, block_size, D]."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary.lookup(positions, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(rope, x, residual, kv_cache, meta)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the fused parameters.

        Raises UnsupportedModelError naming any parameter the checkpoint left unset.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        s = self.shape
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        fused = {"q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, kv),
                 "v_proj": ("qkv_proj", q + kv, kv),
                 "gate_proj": ("gate_up_proj", 0, s.intermediate_size),
                 "up_proj": ("gate_up_proj", s.intermediate_size, s.intermediate_size)}
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name.startswith("model."):
                name = name[len("model."):]
            if name == "lm_head.weight" and s.tie_word_embeddings:
                continue
            parts = name.split(".")
            target, offset, size = name, None, None
            if len(parts) >= 2 and parts[-2] in fused:
                fused_name, offset, size = fused[parts[-2]]
                target = ".".join(parts[:-2] + [fused_name, parts[-1]])
            param = params.get(target)
            if param is None:
                raise UnsupportedModelError(f"unexpected checkpoint tensor {name!r}")
            with torch.no_grad():
                dst = param if offset is None else param.narrow(0, offset, size)
                if dst.shape != tensor.shape:
                    raise UnsupportedModelError(
                        f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(dst.shape)}")
                dst.copy_(tensor)
            loaded.add(f"{target}:{offset}")
        expected = {f"{n}:{o}" for n in params for o in _slices(n, fused)}
        missing = sorted(expected - loaded)
        if missing:
            raise UnsupportedModelError(f"checkpoint is missing tensors for {missing[:5]}")


def _slices(param_name: str, fused: dict) -> list:
    kind = param_name.split(".")[-2]
    offsets = [off for (target, off, _) in fused.values() if target == kind]
    return offsets or [None]
