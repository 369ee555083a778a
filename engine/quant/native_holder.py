"""NativeHolder: the CPU kernel module (engine/model/kernels) as a load's WeightHolder.

Why apart from the kernels: the loader (engine.quant.holding) asks a holder for each
quantized weight and never which kernels it has; this one holds every format the native
kernels multiply as stored: GGUF blocks (AWQ and GPTQ read as Q4_1 blocks) for linears
and the embedding, int8 W8A8 and fp8 weights (per channel, tensor or block).
"""
from __future__ import annotations

from typing import Any

import torch

from engine.quant.fp8 import Fp8Weight
from engine.quant.gguf_linear import GGUFWeight
from engine.quant.int8_w8a8 import Int8Weight


class NativeHolder:
    """The native kernels' held weights; none is declined."""

    def __init__(self, kernels: Any) -> None:
        self.kernels = kernels

    def hold_blocks(self, pieces: list, rows: int, embedding: bool) -> GGUFWeight:
        """GGUF blocks as stored (GGUFWeight.rows serves the embedding's lookups)."""
        return GGUFWeight.fuse(pieces, rows, self.kernels)

    def hold_scaled(self, weight) -> Int8Weight | Fp8Weight:
        if weight.weight.dtype == torch.int8:
            return Int8Weight.of(weight, self.kernels)
        return Fp8Weight.of(weight, self.kernels)


__all__ = ["NativeHolder"]
