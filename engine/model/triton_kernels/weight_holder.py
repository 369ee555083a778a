"""TritonHolder: the Triton backend's WeightHolder (engine.quant.held), what the weight
loader holds a quantized checkpoint's weights with on CUDA.

Why a holder of its own: the GPU multiplies fewer formats as stored than the CPU's
native kernels: Q4_1 blocks (GGUF files' Q4_1 tensors, AWQ and GPTQ checkpoints read as
such) by the int4 kernel (int4_linear.py), and fp8 weights with a scale per channel or
tensor by torch._scaled_mm (engine.quant.fp8.Fp8ScaledMM). Every other weight (other GGUF
types, the GGUF embedding, int8 W8A8, block-wise fp8, shapes _scaled_mm refuses) it
declines, and the loader decodes it to the activation dtype.
"""
from __future__ import annotations

import torch

from engine.model.triton_kernels.int4_linear import Int4Weight
from engine.quant.fp8 import Fp8ScaledMM


class TritonHolder:
    """Int4Weight for Q4_1 linears, Fp8ScaledMM for fp8; None for the rest."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def hold_blocks(self, pieces: list, rows: int, embedding: bool) -> Int4Weight | None:
        """The Q4_1 weight of `rows` rows from (row offset, GGUFBlocks) pieces that tile
        it (rows past the last are zero blocks: vocabulary padding); None for an
        embedding (its lookups decode rows: no GPU kernel does) or any other type."""
        if embedding or any(p.format != "Q4_1" for _, p in pieces):
            return None
        pieces = sorted(pieces, key=lambda p: p[0])
        raws, at = [], 0
        for offset, p in pieces:
            if offset != at:
                return None
            raws.append(p.raw)
            at += p.raw.shape[0]
        if at < rows:
            raws.append(torch.zeros(rows - at, raws[0].shape[1], dtype=torch.uint8))
        return Int4Weight.from_q4_1(torch.cat(raws), pieces[0][1].columns, self.device)

    def hold_scaled(self, weight) -> Fp8ScaledMM | None:
        """fp8 through torch._scaled_mm (None where it cannot take the weight); int8
        W8A8 has no GPU kernel here."""
        if weight.weight.dtype == torch.int8:
            return None
        return Fp8ScaledMM.of(weight, self.device)


__all__ = ["TritonHolder"]
