"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE and Qwen3-MoE.

Their attention is the shared decoder's (Qwen2-MoE with q/k/v biases, as Qwen2; Qwen3-MoE
with q/k norm, as Qwen3); the MLP of each sparse layer is a router plus experts
(engine.model.layers.moe), Qwen2-MoE's with a gated shared expert beside them; the
Qwen MoEs' mlp_only_layers keep a dense MLP. The checkpoints store each expert as separate
gate / up / down matrices (Mixtral names them w1 / w3 / w2, under block_sparse_moe);
the loader writes them into the stacked expert tensors, this rank's slice of each.

Quantized expert weights are refused by name: the experts' kernels take floats.
"""
from __future__ import annotations

import re
from typing import Any, Iterable

import torch
from torch import nn

from engine.errors import UnsupportedModelError, UnsupportedQuantizationError
from engine.model.families.base import DecoderForCausalLM
from engine.model.families.loading import offsets, read_slice
from engine.model.families.moe_arch import FAMILY
from engine.model.layers.moe import SparseMoeBlock

_MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MIXTRAL_EXPERT = re.compile(r"(layers\.\d+)\.block_sparse_moe\.(.*)")
_EXPERT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(?P<expert>\d+)\."
                     r"(?P<proj>gate_proj|up_proj|down_proj)\.(?P<kind>\w+)")
_SHARED = re.compile(r"layers\.(\d+)\.mlp\.shared_expert\."
                     r"(?P<proj>gate_proj|up_proj|down_proj)\.(?P<kind>\w+)")


class MoEForCausalLM(DecoderForCausalLM):
    """The shared decoder whose sparse layers' MLPs are SparseMoeBlocks."""

    def make_mlp(self, layer: int, kernels) -> nn.Module | None:
        shape, moe = self.shape, self.shape.moe
        if not shape.is_sparse(layer):
            return None
        return SparseMoeBlock(shape.hidden_size, moe.num_experts, moe.top_k,
                              self.plan.expert_intermediate_size, moe.renormalize,
                              self.tp, kernels, self.plan.shared_intermediate_size,
                              moe.biased, (moe.swiglu_alpha, moe.swiglu_limit))

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
        m = _EXPERT.fullmatch(name) or _SHARED.fullmatch(name)
        if m is None:
            return False
        layer, proj, kind = int(m.group(1)), m.group("proj"), m.group("kind")
        expert = int(m.group("expert")) if "expert" in m.groupdict() else None
        if kind != "weight" or not _is_float(tensor):
            raise UnsupportedQuantizationError(
                f"checkpoint tensor {name!r} ({_describe(tensor)}): "
                "quantized expert weights are not served; mixture-of-experts models are "
                "served from float16 / bfloat16 / float32 checkpoints")
        block = self.layers[layer].mlp if layer < len(self.layers) else None
        if not isinstance(block, SparseMoeBlock) or (
                expert is None and block.shared_expert is None) or (
                expert is not None and expert >= block.experts.num_experts):
            raise UnsupportedModelError(f"unexpected checkpoint tensor {name!r}")
        if expert is None:  # the shared expert: this rank's columns of its linears
            shared = block.shared_expert
            width = shared.intermediate
            gate_up, down = shared.gate_up_proj.weight, shared.down_proj.weight
        else:
            width = block.experts.intermediate
            gate_up, down = block.experts.w13[expert], block.experts.w2[expert]
        start = self.plan.rank * width
        if proj == "down_proj":
            piece, dst = read_slice(tensor, (1, start, width)), down
        else:
            piece = read_slice(tensor, (0, start, width))
            dst = gate_up.narrow(0, 0 if proj == "gate_proj" else width, width)
        if tuple(piece.shape) != tuple(dst.shape):
            raise UnsupportedModelError(
                f"checkpoint tensor {name!r} has shape {tuple(piece.shape)}, expected "
                f"{tuple(dst.shape)} for this rank")
        with torch.no_grad():
            dst.copy_(piece)
        loaded.add(_expert_key(layer, expert, proj))
        return True

    def expected_loads(self, params: dict, rules: dict) -> set[str]:
        keys = {f"{n}:{o}" for n in params
                if ".experts." not in n and ".shared_expert." not in n
                for o in offsets(n, rules)}
        moe, projs = self.shape.moe, ("gate_proj", "up_proj", "down_proj")
        for layer in range(self.shape.num_layers):
            if self.shape.is_sparse(layer):
                keys.update(_expert_key(layer, e, p)
                            for e in range(moe.num_experts) for p in projs)
                if moe.shared_intermediate_size:
                    keys.update(_expert_key(layer, None, p) for p in projs)
        return keys


def copy_stacked(name: str, value: torch.Tensor, dst: torch.Tensor, source: torch.Tensor) -> None:
    """This rank's slice of a checkpoint's stacked experts tensor (`source`, all experts
    in one) into its parameter; a slice of another shape is refused by name."""
    if value.shape != dst.shape:
        raise UnsupportedModelError(f"checkpoint tensor {name!r} has shape "
                                    f"{tuple(source.shape)}, not this model's experts")
    with torch.no_grad():
        dst.copy_(value)


def stacked_expected_loads(params: dict, rules: dict, layers: Iterable[int],
                           parts: tuple[str, ...]) -> set[str]:
    """What a model whose experts come stacked must have loaded: every parameter outside
    the experts, and each layer's stacked tensors (noted as layers.<i>.experts.<part>)."""
    keys = {f"{n}:{o}" for n in params if ".experts." not in n for o in offsets(n, rules)}
    keys.update(f"layers.{i}.experts.{part}" for i in layers for part in parts)
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


def _expert_key(layer: int, expert: int | None, proj: str) -> str:
    """What load_weights notes for an expert's (None: the shared expert's) matrix."""
    if expert is None:
        return f"layers.{layer}.mlp.shared_expert.{proj}"
    return f"layers.{layer}.mlp.experts.{expert}.{proj}"


ARCHITECTURES = FAMILY.classes(MoEForCausalLM)
