"""gpt-oss (`GptOssForCausalLM`), from bf16 / fp16 / fp32 checkpoints.

A mixture of experts (engine.model.families.moe) with:
- attention sinks: a learned logit per query head that joins every softmax's
  denominator (each backend of engine.model.attention);
- local and global layers in turn (layer_types), the local ones with a 128-token window;
- biases on q/k/v/o, on the router and on every expert's products, and the clamped
  SwiGLU (engine.model.layers.moe);
- YaRN RoPE (engine.model.layers.rotary, from transformers' own functions).

Its checkpoints store the experts stacked: gate_up_proj [E, H, 2I] with gate and up in
alternate columns, down_proj [E, I, H], each with its bias; the loader de-interleaves
them into the engine's [E, 2I, H] gate-then-up layout, this rank's columns of each.
The released MXFP4 checkpoints are quantized and refused by name (quantization's work).
"""
from __future__ import annotations

import re
from typing import Any

import torch

from engine.errors import UnsupportedQuantizationError
from engine.model.families.moe import (MoEForCausalLM, _describe, _is_float, copy_stacked,
                                       stacked_expected_loads)
from engine.model.families.gpt_oss_arch import FAMILY

_ROUTER = re.compile(r"(layers\.\d+\.mlp)\.router\.(weight|bias)")
_EXPERTS = re.compile(r"layers\.(\d+)\.mlp\.experts\."
                      r"(?P<part>gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)")
_PARTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
_SINKS = re.compile(r"layers\.(\d+)\.self_attn\.sinks")


class GptOssForCausalLM(MoEForCausalLM):
    def checkpoint_name(self, name: str) -> str:
        """The router (mlp.router) is the MoE block's gate."""
        m = _ROUTER.fullmatch(name)
        return f"{m.group(1)}.gate.{m.group(2)}" if m else name

    def load_family_tensor(self, name: str, tensor: Any, loaded: set[str]) -> bool:
        m = _SINKS.fullmatch(name)
        if m is not None:
            attn = self.layers[int(m.group(1))].self_attn
            start = self.plan.head_start
            with torch.no_grad():
                attn.sinks.copy_(_whole(tensor)[start:start + attn.num_heads])
            loaded.add(f"{name}:None")
            return True
        m = _EXPERTS.fullmatch(name)
        if m is None:
            return False
        if not _is_float(tensor):
            raise UnsupportedQuantizationError(
                f"checkpoint tensor {name!r} ({_describe(tensor)}): quantized experts are "
                "not served; serve a bf16 / fp16 / fp32 gpt-oss checkpoint")
        layer, part = int(m.group(1)), m.group("part")
        experts = self.layers[layer].mlp.experts
        width = experts.intermediate
        cols = slice(self.plan.rank * width, (self.plan.rank + 1) * width)
        t = _whole(tensor)
        if part == "gate_up_proj":  # [E, H, 2I], gate / up in alternate columns
            pieces = [t[:, :, 0::2][:, :, cols], t[:, :, 1::2][:, :, cols]]
            dst, pieces = experts.w13, [p.transpose(1, 2) for p in pieces]
        elif part == "gate_up_proj_bias":  # [E, 2I]
            dst, pieces = experts.b13, [t[:, 0::2][:, cols], t[:, 1::2][:, cols]]
        elif part == "down_proj":  # [E, I, H]
            dst, pieces = experts.w2, [t[:, cols, :].transpose(1, 2)]
        else:  # down_proj_bias [E, H]: added by rank 0 alone
            dst, pieces = experts.b2, [t]
        if dst is not None:
            value = torch.cat(pieces, dim=-2 if dst.dim() == 3 else -1)
            copy_stacked(name, value, dst, t)
        loaded.add(f"layers.{layer}.experts.{part}")
        return True

    def expected_loads(self, params: dict, rules: dict) -> set[str]:
        return stacked_expected_loads(params, rules, range(self.shape.num_layers), _PARTS)


def _whole(tensor: Any) -> torch.Tensor:
    return tensor if isinstance(tensor, torch.Tensor) else tensor[:]


ARCHITECTURES = FAMILY.classes(GptOssForCausalLM)
