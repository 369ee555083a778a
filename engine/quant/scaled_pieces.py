"""8-bit weights with a float scale per output row or per tensor (compressed-tensors' int8
and fp8 schemes, vLLM's `fp8` checkpoints), gathered from a checkpoint's tensors as the
loader meets them: a fused parameter (q/k/v, gate/up) is filled from several checkpoint
weights, each with its own `weight_scale` and, for static activations, `input_scale`.

On disk (per quantized linear `<prefix>`): `<prefix>.weight` int8 or float8_e4m3fn
[out, in], `<prefix>.weight_scale` [out, 1], [out], [1] or a scalar, optionally
`<prefix>.input_scale` and `<prefix>.weight_zero_point` (zeros: symmetric).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.errors import UnsupportedModelError, UnsupportedQuantizationError

SIDECARS = ("weight_scale", "input_scale", "weight_zero_point")  # tensors beside a weight
STORAGE = (torch.int8, torch.float8_e4m3fn)  # the weight dtypes gathered here


@dataclass
class ScaledWeight:
    """A fused parameter's whole weight: `weight` [rows, columns] int8 or e4m3, its float32
    scale per row, and the static input scale (0: dynamic)."""

    weight: torch.Tensor
    scales: torch.Tensor
    input_scale: float

    def decoded(self) -> torch.Tensor:
        """weight x scale in float32: what a layer without a kernel for it holds."""
        return self.weight.float() * self.scales[:, None]


@dataclass
class _Piece:
    weight: torch.Tensor | None = None
    sidecars: dict[str, torch.Tensor] = field(default_factory=dict)


class ScaledPieces:
    """The scaled 8-bit weights of a load by the fused parameter and row offset they fill;
    `weights` joins each parameter's pieces."""

    def __init__(self) -> None:
        self._pieces: dict[str, dict[int, _Piece]] = {}

    def _piece(self, target: str, offset: int | None) -> _Piece:
        return self._pieces.setdefault(target, {}).setdefault(offset or 0, _Piece())

    def add_weight(self, target: str, offset: int | None, weight: torch.Tensor) -> None:
        self._piece(target, offset).weight = weight

    def add_sidecar(self, target: str, offset: int | None, kind: str, tensor: Any,
                    rows: tuple[int, int] | None) -> None:
        """A scale or zero point of the weight `target` (the fused parameter's name);
        rows: the (start, length) a per-channel tensor is sliced to (tensor parallelism)."""
        t = tensor if isinstance(tensor, torch.Tensor) else tensor[...]  # scalars too
        if rows is not None and t.numel() > 1:
            t = t.reshape(-1)[rows[0]:rows[0] + rows[1]]
        self._piece(target, offset).sidecars[kind] = t

    def targets(self) -> list[str]:
        return list(self._pieces)

    def weights(self, shapes: dict[str, torch.Size]) -> dict[str, ScaledWeight]:
        """Each parameter's joined weight; raises UnsupportedModelError for a piece without
        its weight or scale, of the wrong shape, or of another dtype than its siblings."""
        out = {}
        for target, pieces in self._pieces.items():
            rows, cols = shapes[target]
            dtypes = {p.weight.dtype for p in pieces.values() if p.weight is not None}
            if len(dtypes) > 1:
                raise UnsupportedModelError(f"weight {target} mixes {sorted(map(str, dtypes))}")
            weight = torch.zeros(rows, cols, dtype=next(iter(dtypes), torch.int8))
            scales = torch.zeros(rows, dtype=torch.float32)
            input_scale = 0.0
            for offset, p in sorted(pieces.items()):
                if p.weight is None or "weight_scale" not in p.sidecars:
                    raise UnsupportedModelError(
                        f"quantized weight {target} at row {offset} lacks its "
                        f"{'weight' if p.weight is None else 'weight_scale'}")
                n = p.weight.shape[0]
                if offset + n > rows or p.weight.shape[1] != cols:
                    raise UnsupportedModelError(
                        f"quantized weight {target} has a piece of shape "
                        f"{tuple(p.weight.shape)} at row {offset}, for a parameter of "
                        f"{(rows, cols)}")
                zero = p.sidecars.get("weight_zero_point")
                if zero is not None and bool(zero.any()):
                    raise UnsupportedQuantizationError(
                        f"quantized weight {target} has non-zero zero points: asymmetric "
                        "weights are not served")
                scale = p.sidecars["weight_scale"].float().reshape(-1)
                if scale.numel() not in (1, n):
                    raise UnsupportedModelError(
                        f"quantized weight {target}: {scale.numel()} scales for {n} rows")
                weight[offset:offset + n] = p.weight
                scales[offset:offset + n] = scale.expand(n)
                if "input_scale" in p.sidecars:  # fused layers share the widest range
                    input_scale = max(input_scale, float(p.sidecars["input_scale"].max()))
            out[target] = ScaledWeight(weight, scales, input_scale)
        return out


__all__ = ["SIDECARS", "STORAGE", "ScaledPieces", "ScaledWeight"]
