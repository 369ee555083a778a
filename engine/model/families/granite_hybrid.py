"""Granite 4.0-H (`GraniteMoeHybridForCausalLM`): Mamba-2 layers and attention layers.

Each layer mixes with either a Mamba-2 mixer (engine.model.layers.mamba; its state
lives in the request's state block of the paged cache) or the shared attention (without
positions unless position_embedding_type is "rope": Granite 4.0-H uses none, served
here as an identity rotation), then runs a dense SwiGLU MLP (the checkpoint's
shared_mlp) plus, in the MoE variants, routed experts. Granite's scalings: embeddings
times embedding_multiplier, each block's output times residual_multiplier before it
joins the residual stream, scores times attention_multiplier, logits divided by
logits_scaling.

Served on one rank, without LoRA, prefix caching or an fp8 KV cache (engine_core says
so when asked for them).
"""
from __future__ import annotations

import re
from typing import Any, Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from engine.errors import UnsupportedModelError
from engine.executor.parallel import ShardPlan, TPGroup
from engine.model.attention.base import AttentionMetadata
from engine.model.families.base import Attention, DecoderForCausalLM, GatedMLP
from engine.model.families.granite_hybrid_arch import FAMILY
from engine.model.families.loading import read_slice
from engine.model.families.moe import _is_float, copy_stacked, stacked_expected_loads
from engine.model.layers.mamba import MambaMixer, state_views
from engine.model.layers.moe import SparseMoeBlock
from engine.model.layers.norm import RMSNorm
from engine.model.layers.rotary import Rope
from engine.model.shape import ModelShape

_RENAMES = {"mamba.conv1d.weight": "mamba.conv1d_weight", "mamba.conv1d.bias": "mamba.conv1d_bias",
            "mamba.norm.weight": "mamba.norm_weight",
            "block_sparse_moe.router.weight": "mlp.moe.gate.weight",
            "block_sparse_moe.router.layer.weight": "mlp.moe.gate.weight",  # Granite's own
            "shared_mlp.output_linear.weight": "mlp.shared.down_proj.weight"}
_LAYER = re.compile(r"(layers\.\d+)\.(.*)")
# the experts, stacked: transformers' names, or the Granite checkpoints' own (the same
# layouts: gate rows then up rows [E, 2I, H]; down [E, H, I])
_EXPERTS = re.compile(r"layers\.(\d+)\.block_sparse_moe\.(experts\.gate_up_proj|input_linear\.weight"
                      r"|experts\.down_proj|output_linear\.weight)")
_GATE_UP = ("experts.gate_up_proj", "input_linear.weight")


class GraniteMLP(nn.Module):
    """The dense SwiGLU MLP every token runs, plus the routed experts where the model
    has them."""

    def __init__(self, shape: ModelShape, plan: ShardPlan, tp: TPGroup | None, kernels) -> None:
        super().__init__()
        self.shared = GatedMLP(shape, plan, tp, kernels)
        moe = shape.moe
        self.moe = SparseMoeBlock(shape.hidden_size, moe.num_experts, moe.top_k,
                                  plan.expert_intermediate_size, moe.renormalize, tp,
                                  kernels) if moe is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.shared(x)
        return out + self.moe(x) if self.moe is not None else out


class GraniteHybridLayer(nn.Module):
    residual_multiplier = 1.0

    def __init__(self, shape: ModelShape, plan: ShardPlan, tp: TPGroup | None, kernels=None,
                 mlp: nn.Module | None = None, layer: int = 0) -> None:
        super().__init__()
        eps = shape.rms_norm_eps
        self.input_layernorm = RMSNorm(shape.hidden_size, eps, kernels)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, eps, kernels)
        self.mamba = self.self_attn = None
        if shape.is_mamba(layer):
            self.mamba = MambaMixer(shape.hidden_size, shape.mamba, eps)
        else:
            self.self_attn = Attention(shape, plan, tp, kernels, shape.window(layer))
        self.mlp = mlp

    def forward(self, rope: Rope, x: torch.Tensor, residual: torch.Tensor | None,
                cache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """cache: the attention layer's (keys, values) views, or the mixer's state views."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        if self.mamba is not None:
            x = self.mamba(x, cache, meta.state)
        else:
            x = self.self_attn(rope, x, cache, meta)
        x, residual = self.post_attention_layernorm(x * self.residual_multiplier, residual)
        return self.mlp(x) * self.residual_multiplier, residual


class GraniteHybridForCausalLM(DecoderForCausalLM):
    layer_class = GraniteHybridLayer
    stack_layout = False

    def __init__(self, shape: ModelShape, hf_config: PretrainedConfig, max_positions: int,
                 kernels=None, plan: ShardPlan | None = None, tp: TPGroup | None = None
                 ) -> None:
        super().__init__(shape, hf_config, max_positions, kernels, plan, tp)
        self.embedding_multiplier = float(hf_config.embedding_multiplier)
        self.logits_scaling = float(hf_config.logits_scaling)
        for layer in self.layers:
            layer.residual_multiplier = float(hf_config.residual_multiplier)

    def make_mlp(self, layer: int, kernels) -> nn.Module:
        return GraniteMLP(self.shape, self.plan, self.tp, kernels)

    def make_rotary(self, hf_config: PretrainedConfig, max_positions: int,
                    device: torch.device | None = None) -> None:
        """Without positions (the default): an identity rotation (cos 1, sin 0), so
        every attention path runs unchanged."""
        super().make_rotary(hf_config, max_positions, device)
        if not self.shape.rope:
            self.rotary.cos.fill_(1.0)
            self.rotary.sin.zero_()

    def state_views(self, layer: int, layer_cache: torch.Tensor, num_blocks: int):
        """A mixer layer's (conv, ssm) state views of its cache tensor; None for attention
        layers."""
        if not self.shape.is_mamba(layer):
            return None
        return state_views(layer_cache, num_blocks, self.shape.mamba)

    def attach_lora(self, slots) -> None:
        raise UnsupportedModelError("LoRA adapters are not served on hybrid models yet")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return super().compute_logits(hidden / self.logits_scaling)

    def load_weights(self, weights: Iterable[tuple[str, Any]], holder: Any = None,
                     fp8_block: tuple[int, int] | None = None) -> int:
        return super().load_weights(self._renamed(weights), holder, fp8_block)

    def _renamed(self, weights: Iterable[tuple[str, Any]]):
        """Checkpoint names in this module's terms; shared_mlp.input_linear (gate rows,
        then up rows) as the dense MLP's gate_proj and up_proj."""
        for name, tensor in weights:
            m = _LAYER.fullmatch(name.removeprefix("model."))
            if m is None:
                yield name, tensor
                continue
            layer, rest = m.groups()
            if rest == "shared_mlp.input_linear.weight":
                half = self.shape.intermediate_size
                yield f"{layer}.mlp.shared.gate_proj.weight", tensor[:half]
                yield f"{layer}.mlp.shared.up_proj.weight", tensor[half:2 * half]
                continue
            yield f"{layer}.{_RENAMES.get(rest, rest)}", tensor

    def load_family_tensor(self, name: str, tensor: Any, loaded: set[str]) -> bool:
        m = _EXPERTS.fullmatch(name)
        if m is None:
            return False
        layer = int(m.group(1))
        part = "gate_up_proj" if m.group(2) in _GATE_UP else "down_proj"
        moe = self.layers[layer].mlp.moe
        if moe is None or not _is_float(tensor):
            raise UnsupportedModelError(f"unexpected checkpoint tensor {name!r}")
        experts = moe.experts
        width = experts.intermediate
        start = self.plan.rank * width
        whole = self.shape.moe.intermediate_size
        t = read_slice(tensor, None)
        if part == "gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
            value = torch.cat([t[:, start:start + width], t[:, whole + start:whole + start + width]],
                              dim=1)
            dst = experts.w13
        else:  # down_proj [E, H, I]
            value, dst = t[:, :, start:start + width], experts.w2
        copy_stacked(name, value, dst, t)
        loaded.add(f"layers.{layer}.experts.{part}")
        return True

    def expected_loads(self, params: dict, rules: dict) -> set[str]:
        layers = range(self.shape.num_layers) if self.shape.moe is not None else ()
        return stacked_expected_loads(params, rules, layers, ("gate_up_proj", "down_proj"))


ARCHITECTURES = FAMILY.classes(GraniteHybridForCausalLM)
