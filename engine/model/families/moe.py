"""Mixture-of-experts decoders: Mixtral and Qwen3-MoE.

Their attention is the Llama family's (Qwen3-MoE with q/k norm, as Qwen3); the MLP of
each sparse layer is a router plus experts (engine.model.layers.moe), Qwen3-MoE's
mlp_only_layers keep a dense MLP. The checkpoints store each expert as separate
gate / up / down matrices (Mixtral names them w1 / w3 / w2, under block_sparse_moe);
the loader writes them into the stacked expert tensors, this rank's slice of each.

Quantized expert weights are refused by name: the experts' kernels take floats.
"""
from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from engine.errors import UnsupportedModelError, UnsupportedQuantizationError
from engine.model.families.llama import LlamaForCausalLM, _offsets, _read_slice
from engine.model.layers.moe import SparseMoeBlock

_MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MIXTRAL_EXPERT = re.compile(r"(layers\.\d+)\.block_sparse_moe\.(.*)")
_EXPERT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)")


class MoEForCausalLM(LlamaForCausalLM):
    """A Llama-family decoder whose sparse layers' MLPs are SparseMoeBlocks."""

    def make_mlp(self, layer: int, kernels) -> nn.Module | None:
        shape, moe = self.shape, self.shape.moe
        if not shape.is_sparse(layer):
            return None
        return SparseMoeBlock(shape.hidden_size, moe.num_experts, moe.top_k,
                              self.plan.expert_intermediate_size, moe.renormalize,
                              self.tp, kernels)

    def checkpoint_name(self, name: str) -> str:
        """Mixtral's block_sparse_moe.experts.E.w1 / w3 / w2 as mlp.experts.E.gate_proj /
        up_proj / down_proj, its router as mlp.gate."""
        m = _MIXTRAL_EXPERT.fullmatch(name)
        if m is None:
            return name
        rest = m.group(2).split(".")
        if len(rest) >= 3 and rest[0] == "experts":
            rest[2] = _MIXTRAL_NAMES.get(rest[2], rest[2])
        return f"{m.group(1)}.mlp.{'.'.join(rest)}"

    def load_family_tensor(self, name: str, tensor: Any, loaded: set[str]) -> bool:
        m = _EXPERT.fullmatch(name)
        if m is None:
            return False
        layer, expert, proj, kind = int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
        if kind != "weight" or not _is_float(tensor):
            raise UnsupportedQuantizationError(
                f"checkpoint tensor {name!r} ({_describe(tensor)}): "
                "quantized expert weights are not served; mixture-of-experts models are "
                "served from float16 / bfloat16 / float32 checkpoints")
        if layer >= len(self.layers) or not self.shape.is_sparse(layer):
            raise UnsupportedModelError(f"unexpected checkpoint tensor {name!r}")
        experts = self.layers[layer].mlp.experts
        if expert >= experts.w13.shape[0]:
            raise UnsupportedModelError(f"unexpected checkpoint tensor {name!r}")
        width, start = experts.intermediate, self.plan.rank * experts.intermediate
        if proj == "down_proj":
            piece, dst = _read_slice(tensor, (1, start, width)), experts.w2[expert]
        else:
            piece = _read_slice(tensor, (0, start, width))
            dst = experts.w13[expert].narrow(0, 0 if proj == "gate_proj" else width, width)
        if tuple(piece.shape) != tuple(dst.shape):
            raise UnsupportedModelError(
                f"checkpoint tensor {name!r} has shape {tuple(piece.shape)}, expected "
                f"{tuple(dst.shape)} for this rank")
        with torch.no_grad():
            dst.copy_(piece)
        loaded.add(_expert_key(layer, expert, proj))
        return True

    def expected_loads(self, params: dict, rules: dict) -> set[str]:
        keys = {f"{n}:{o}" for n in params if ".experts." not in n
                for o in _offsets(n, rules)}
        for layer in range(self.shape.num_layers):
            if self.shape.is_sparse(layer):
                keys.update(_expert_key(layer, e, p)
                            for e in range(self.shape.moe.num_experts)
                            for p in ("gate_proj", "up_proj", "down_proj"))
        return keys


def _is_float(tensor: Any) -> bool:
    """A torch tensor or lazy safetensors slice holding floats (not int8 / e4m3 / blocks)."""
    dtype = getattr(tensor, "dtype", None)
    if dtype is not None:
        return getattr(dtype, "is_floating_point", False) and dtype.itemsize >= 2
    get = getattr(tensor, "get_dtype", None)  # safetensors' slice: "BF16", "F32", ...
    return get is not None and get() in ("F32", "BF16", "F16")


def _describe(tensor: Any) -> str:
    dtype = getattr(tensor, "dtype", None)
    if dtype is None and hasattr(tensor, "get_dtype"):
        dtype = tensor.get_dtype()
    return str(dtype) if dtype is not None else type(tensor).__name__


def _expert_key(layer: int, expert: int, proj: str) -> str:
    return f"layers.{layer}.mlp.experts.{expert}.{proj}"


ARCHITECTURES = {"MixtralForCausalLM": MoEForCausalLM, "Qwen3MoeForCausalLM": MoEForCausalLM}
