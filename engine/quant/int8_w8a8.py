"""int8 W8A8 checkpoints in the compressed-tensors format (vLLM's `compressed-tensors`
quantization, as its CPU backend serves them): a linear's weight is int8 with a float
scale per output channel (or one per tensor), and its input is quantized to int8 at each
call, per token with a dynamic scale (or with the checkpoint's static `input_scale`).

Why int8 and not a decode to bf16 at load: the products are exact integers summed over
all of K and scaled once per output (engine/model/kernels/int8_linear.cpp, AMX int8 or
VNNI where the CPU has them), and a step reads half of bf16's weight bytes.

The schemes served are checked by engine/quant/compressed_tensors.py; the weights and
their scales are gathered by engine/quant/scaled_pieces.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

@dataclass
class Int8Weight:
    """A [rows, columns] int8 weight with a float32 scale per row, packed for
    engine/model/kernels/int8_linear.cpp."""

    packed: torch.Tensor
    comp: torch.Tensor
    scales: torch.Tensor  # float32 [rows]
    rows: int
    columns: int
    input_scale: float  # 0: dynamic per token
    kernels: object

    @classmethod
    def of(cls, weight, kernels) -> "Int8Weight":
        """From a ScaledWeight (engine.quant.scaled_pieces) of int8 values."""
        packed, comp = kernels.int8_pack(weight.weight.contiguous())
        return cls(packed, comp, weight.scales.float().contiguous(), weight.weight.shape[0],
                   weight.weight.shape[1], weight.input_scale, kernels)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales.numel() * 4

    def describe(self) -> str:
        return "int8"

    def packing(self) -> str:
        """What Linear.packing reports for a layer holding it."""
        return "int8"

    def stack_segments(self) -> list[tuple]:
        """The weight as the decoder stack calls it (engine.model.stack)."""
        return [("int8", self.packed, "", self.rows, [self.comp, self.scales], self.input_scale)]

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None, float_out: bool = False,
               dense_rows: int | None = None) -> torch.Tensor:
        """x @ (W * scales).T (+ bias), x quantized per token; dense_rows is GGUF's and has
        no meaning here (every row takes the int8 products)."""
        return self.kernels.int8_linear(x, self.packed, self.comp, self.scales, bias, self.rows,
                                        self.input_scale, float_out)


__all__ = ["Int8Weight"]
