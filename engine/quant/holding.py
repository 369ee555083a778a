"""Where a model's quantized weights go as the loader reads them: the pieces a
checkpoint's tensors give (GGUF blocks, int8 weights and their scales, GPTQ's act-order)
gathered by the fused parameter they fill, then held by its layer (a Linear's
set_quantized, the embedding's GGUF rows) or decoded into the parameter.

Why apart from the model: the model's loader knows names, fused parameters and tensor
parallel slices; this knows the pieces a format's tensors give and hands each whole
weight to the load's WeightHolder (engine.quant.held: the native CPU kernels'
NativeHolder, the Triton backend's TritonHolder), which makes its HeldWeight or declines
it; a declined weight, or every weight of a load without a holder, is decoded to floats
(which the runner logs).
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from engine.errors import UnsupportedModelError, UnsupportedQuantizationError
from engine.quant.gguf_weights import GGUFBlocks
from engine.quant.held import WeightHolder
from engine.quant.int4_groups import INPUT_ORDER
from engine.quant.scaled_pieces import SIDECARS, STORAGE, ScaledPieces

logger = logging.getLogger(__name__)


class QuantizedPieces:
    """One load's quantized pieces. holder: who makes their HeldWeights, or None (every
    piece decoded)."""

    def __init__(self, holder: WeightHolder | None, tensor_parallel: bool,
                 fp8_block: tuple[int, int] | None = None) -> None:
        """fp8_block: (rows, columns) of a block-wise fp8 checkpoint's scale blocks."""
        if fp8_block is not None and tensor_parallel:
            raise UnsupportedQuantizationError(
                "block-wise fp8 (weight_block_size) is not served under tensor parallelism")
        self.holder = holder
        self.tensor_parallel = tensor_parallel
        self.blocks: dict[str, list[tuple[int, GGUFBlocks]]] = {}
        self.scaled = ScaledPieces(fp8_block)  # int8 and fp8 weights with their scales
        self.orders: dict[str, list[torch.Tensor]] = {}  # GPTQ act-order: input orders

    def take_sidecar(self, kind: str, target: str, offset: int | None, src, tensor: Any,
                     params: dict) -> bool:
        """A tensor that is not a parameter's own: an 8-bit weight's scale (sliced as its
        rows are) or an act-order input order. False: not one of those."""
        if kind == INPUT_ORDER:  # fused pieces share their input, so their order
            if self.tensor_parallel:
                raise UnsupportedQuantizationError(
                    "GPTQ act-order (desc_act) is not served under tensor parallelism")
            self.orders.setdefault(target[:-len(kind)] + "weight", []).append(tensor)
            return True
        if kind not in SIDECARS:
            return False
        weight_target = target[:-len(kind)] + "weight"
        if weight_target not in params:
            raise UnsupportedModelError(f"unexpected checkpoint tensor {target!r}")
        rows = (src[1], src[2]) if src is not None and src[0] == 0 else None
        self.scaled.add_sidecar(weight_target, offset, kind, tensor, rows)
        return True

    def take_weight(self, name: str, kind: str, target: str, offset: int | None, piece: Any,
                    param: torch.Tensor) -> bool:
        """A parameter's quantized piece kept for finish(); False: the caller copies it
        (a float tensor, or blocks it should decode: there is no kernel)."""
        if isinstance(piece, torch.Tensor) and piece.dtype in STORAGE:
            if kind != "weight":
                raise UnsupportedModelError(f"checkpoint tensor {name!r} is {piece.dtype}")
            self.scaled.add_weight(target, offset, piece)
            return True
        if isinstance(piece, GGUFBlocks) and self.holder is not None and kind == "weight":
            rows = param.shape[0] if offset is None else piece.shape[0]
            if piece.shape[1] != param.shape[1] or piece.shape[0] > rows:
                raise UnsupportedModelError(
                    f"checkpoint tensor {name!r} has shape {tuple(piece.shape)}, "
                    f"expected {(rows, param.shape[1])}")
            self.blocks.setdefault(target, []).append((offset or 0, piece))
            return True
        return False

    def count(self) -> int:
        """How many quantized weights (8-bit or GGUF blocks) the load held or decoded."""
        return len(self.scaled.targets()) + len(self.blocks)

    def finish(self, model: nn.Module, params: dict, tied_embeddings: bool) -> None:
        """Hold (or decode) every kept piece in `model`, whose parameters are `params`."""
        shapes = {t: params[t].shape for t in self.scaled.targets()}
        decoded_blocks = 0
        for target, weight in self.scaled.weights(shapes).items():
            held = None if self.holder is None else self.holder.hold_scaled(weight)
            if held is None:  # no kernel for it: decoded (the runner says so)
                with torch.no_grad():
                    params[target].copy_(weight.decoded())
                decoded_blocks += int(self.holder is not None and weight.block_k > 0)
            else:
                model.get_submodule(target.rsplit(".", 1)[0]).set_quantized(held)
        if decoded_blocks:
            logger.warning("%d block-wise fp8 weights decoded to floats: this device's "
                           "kernels cannot hold their block scales (torch._scaled_mm's "
                           "row-wise scaling; the CPU kernel reads them as stored)",
                           decoded_blocks)
        for target, pieces in self.blocks.items():
            module = model.get_submodule(target.rsplit(".", 1)[0])
            held = self.holder.hold_blocks(pieces, params[target].shape[0],
                                           embedding=target == "embed_tokens.weight")
            if held is None:
                _copy_decoded(params[target], pieces)
            else:
                module.set_quantized(held)
        for target, held in self.orders.items():
            if any(not torch.equal(o, held[0]) for o in held[1:]):
                raise UnsupportedQuantizationError(
                    f"GPTQ act-order: the fused pieces of {target} order their input "
                    "columns differently")
            if self.holder is None:  # decoded: back to the input's own order
                with torch.no_grad():
                    params[target].copy_(params[target][:, torch.argsort(held[0])])
            else:
                model.get_submodule(target.rsplit(".", 1)[0]).input_order = held[0]
        if tied_embeddings and model.embed_tokens.quant is not None:
            model.lm_head.set_quantized(model.embed_tokens.quant)  # the one held weight


def _copy_decoded(param: torch.Tensor, pieces: list[tuple[int, GGUFBlocks]]) -> None:
    """Blocks decoded into a parameter (rows past the pieces zero)."""
    with torch.no_grad():
        param.zero_()
        for offset, piece in pieces:
            param.narrow(0, offset, piece.shape[0]).copy_(piece.dequantize())


__all__ = ["QuantizedPieces"]
