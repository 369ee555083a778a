"""HeldWeight: what every weight a layer holds quantized offers it; WeightHolder: who
makes them for a load.

Why protocols: a Linear (engine.model.layers.linear), the embedding
(engine.model.layers.embedding), the runner's memory count and the decoder stack
(engine.model.stack) serve a quantized weight without knowing its format; each held
weight (GGUFWeight, Int8Weight, Fp8Weight, Fp8ScaledMM, Int4Weight) shares these
members. And the loader (engine.quant.holding) holds a load's pieces without asking
which device or backend multiplies them: the runner hands it a WeightHolder (the CPU's
NativeHolder, the Triton backend's TritonHolder), which makes each HeldWeight or
declines it (the piece is then decoded to floats). tests/test_quant_held.py checks that
none drifts from them.
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


@runtime_checkable
class WeightHolder(Protocol):
    """The kernels one load's quantized weights are multiplied by, as a maker of HeldWeights.
    Each method answers None for a weight its kernels do not multiply: the loader then
    decodes that weight into its float parameter."""

    def hold_blocks(self, pieces: list, rows: int, embedding: bool) -> HeldWeight | None:
        """A weight of `rows` rows from (row offset, GGUFBlocks) pieces that tile it (rows
        past the last piece are vocabulary padding, zero); embedding: it is the token
        embedding, whose HeldWeight must also serve rows(ids, dtype)."""

    def hold_scaled(self, weight) -> HeldWeight | None:
        """An 8-bit weight with its scales (engine.quant.scaled_pieces.ScaledWeight: int8
        or e4m3)."""


__all__ = ["HeldWeight", "WeightHolder"]
