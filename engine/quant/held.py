"""HeldWeight: what every weight a linear holds quantized offers its layer.

Why a protocol: a Linear (engine.model.layers.linear), the runner's memory count and the
decoder stack (engine.model.stack) serve a quantized weight without knowing its format;
each held weight (GGUFWeight, Int8Weight, Fp8Weight, Fp8ScaledMM, Int4Weight) shares
these members, and tests/test_quant_held.py checks that none drifts from them.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class HeldWeight(Protocol):
    """A [rows, columns] weight held in its format's own bytes, multiplied as stored."""

    @property
    def nbytes(self) -> int:
        """Bytes it holds (the runner's count of the model's weight memory)."""

    def describe(self) -> str:
        """Its format in a word or two ("Q4_K+Q6_K", "int8", "fp8")."""

    def packing(self) -> str:
        """What Linear.packing reports for a layer holding it."""

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None, float_out: bool = False,
               dense_rows: int | None = None) -> torch.Tensor:
        """x @ W.T (+ bias); float_out: float32 holding x-dtype-rounded values;
        dense_rows: GGUF's rows up to which the int8 products run (others ignore it)."""

    def stack_segments(self) -> list[tuple] | None:
        """Its linear as the native decoder stack calls it: [(kind, data, format, rows,
        extras, input_scale), ...], or None where the stack cannot (a GPU holder)."""


__all__ = ["HeldWeight"]
