"""Gemma 3, text (`Gemma3ForCausalLM`): the shared decoder with Gemma's changes.

- Interleaved local and global attention: the config's layer_types give each layer a
  sliding window (local) or none (global), and each kind its own RoPE (local: a 10k
  base; global: a 1M base, linear-scaled on the larger models).
- Four norms a layer: the attention's and the MLP's outputs are normalised before they
  join the residual stream (post-norms) as well as their inputs (pre-norms); q and k
  are RMS-normalised per head before the rotary, as Qwen3's.
- Gemma's RMSNorm multiplies by (1 + weight): the loader stores 1 + weight, so the
  shared norm layers and kernels apply it unchanged (exact in float32; in bf16 the
  sum is rounded once, where transformers adds in float32 each call).
- GeGLU: gelu (tanh approximation) of the gate times up.
- Embeddings scaled by sqrt(hidden_size), in the activation dtype as transformers does.
- Scores scaled by query_pre_attn_scalar ** -0.5 (ModelShape.attention_scale).

Logit soft-capping (Gemma 2's, off in every Gemma 3 config) and bidirectional
attention (Gemma 3 embedding variants) are refused.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from engine.errors import UnsupportedModelError
from engine.executor.parallel import ShardPlan, TPGroup
from engine.model.attention.base import AttentionMetadata
from engine.model.families.base import DecoderForCausalLM, DecoderLayer, GatedMLP
from engine.model.families.gemma3_arch import FAMILY
from engine.model.layers.norm import RMSNorm
from engine.model.layers.rotary import Rope, RotaryEmbedding
from engine.model.shape import ModelShape

_LOCAL, _GLOBAL = "sliding_attention", "full_attention"


class GemmaMLP(GatedMLP):
    def _activation(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.lora is not None:
            self.lora.add(self.layer_index, "gate_up_proj", x, gate_up)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class Gemma3DecoderLayer(DecoderLayer):
    def __init__(self, shape: ModelShape, plan: ShardPlan, tp: TPGroup | None,
                 kernels=None, mlp: nn.Module | None = None, layer: int = 0) -> None:
        super().__init__(shape, plan, tp, kernels, mlp, layer)
        eps = shape.rms_norm_eps
        self.pre_feedforward_layernorm = RMSNorm(shape.hidden_size, eps, kernels)
        self.post_feedforward_layernorm = RMSNorm(shape.hidden_size, eps, kernels)

    def forward(self, rope: Rope, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """As the shared layer's: x is the previous layer's (post-normed) output, added
        into the residual by this layer's input norm; returns the post-normed MLP output."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(rope, x, kv_cache, meta))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3ForCausalLM(DecoderForCausalLM):
    layer_class = Gemma3DecoderLayer
    stack_layout = False  # four norms a layer: the modules run it

    def __init__(self, shape: ModelShape, hf_config: PretrainedConfig, max_positions: int,
                 kernels=None, plan: ShardPlan | None = None, tp: TPGroup | None = None
                 ) -> None:
        for option in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(hf_config, option, None) is not None:
                raise UnsupportedModelError(f"Gemma 3 with {option} is not supported")
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise UnsupportedModelError(
                "Gemma 3 with use_bidirectional_attention is not supported (causal only)")
        super().__init__(shape, hf_config, max_positions, kernels, plan, tp)

    def make_mlp(self, layer: int, kernels) -> nn.Module:
        return GemmaMLP(self.shape, self.plan, self.tp, kernels)

    def make_rotary(self, hf_config: PretrainedConfig, max_positions: int,
                    device: torch.device | None = None) -> None:
        d = self.shape.head_dim
        self.rotary = RotaryEmbedding(hf_config, d, max_positions, _GLOBAL).to(device)
        self.local_rotary = RotaryEmbedding(hf_config, d, max_positions, _LOCAL).to(device)

    def layer_ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> list[Rope]:
        full = self.rotary.lookup(positions, dtype)
        local = self.local_rotary.lookup(positions, dtype)
        return [local if layer.self_attn.window else full for layer in self.layers]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(input_ids)
        return x * torch.tensor(self.shape.hidden_size ** 0.5, dtype=x.dtype)

    def load_family_tensor(self, name: str, tensor, loaded: set[str]) -> bool:
        """Every norm's weight as 1 + weight (Gemma's RMSNorm scale)."""
        if not name.endswith("norm.weight"):
            return False
        param = self.get_parameter(name)
        t = tensor if isinstance(tensor, torch.Tensor) else tensor[:]
        if t.shape != param.shape:
            raise UnsupportedModelError(f"checkpoint tensor {name!r} has shape "
                                        f"{tuple(t.shape)}, expected {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(t.float() + 1.0)
        loaded.add(f"{name}:None")
        return True


ARCHITECTURES = FAMILY.classes(Gemma3ForCausalLM)
