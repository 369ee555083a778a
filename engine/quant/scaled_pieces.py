"""8-bit weights with a float scale per output row or per tensor (compressed-tensors' int8
and fp8 schemes, vLLM's `fp8` checkpoints), gathered from a checkpoint's tensors as the
loader meets them: a fused parameter (q/k/v, gate/up) is filled from several checkpoint
weights, each with its own `weight_scale` and, for static activations, `input_scale`.

On disk (per quantized linear `<prefix>`): `<prefix>.weight` int8 or float8_e4m3fn
[out, in], `<prefix>.weight_scale` [out, 1], [out], [1] or a scalar, optionally
`<prefix>.input_scale` and `<prefix>.weight_zero_point` (zeros: symmetric). Block-wise
fp8 (blocks of bn x bk): `<prefix>.weight_scale_inv` (vLLM's name; despite it, the
multiplier) or compressed-tensors' `weight_scale`, [ceil(out / bn), ceil(in / bk)].
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.errors import UnsupportedModelError, UnsupportedQuantizationError

# tensors beside a weight
SIDECARS = ("weight_scale", "weight_scale_inv", "input_scale", "weight_zero_point")
STORAGE = (torch.int8, torch.float8_e4m3fn)  # the weight dtypes gathered here


@dataclass
class ScaledWeight:
    """A fused parameter's whole weight: `weight` [rows, columns] int8 or e4m3, its float32
    scale per row ([rows, ceil(columns / block_k)] for block-wise weights: each row its
    block's scales), and the static input scale (0: dynamic)."""

    weight: torch.Tensor
    scales: torch.Tensor
    input_scale: float
    block_k: int = 0

    def decoded(self) -> torch.Tensor:
        """weight x scale in float32: what a layer without a kernel for it holds."""
        if self.block_k:
            columns = self.weight.shape[1]
            return self.weight.float() * self.scales.repeat_interleave(self.block_k, 1)[:, :columns]
        return self.weight.float() * self.scales[:, None]


@dataclass
class _Piece:
    weight: torch.Tensor | None = None
    sidecars: dict[str, torch.Tensor] = field(default_factory=dict)


class ScaledPieces:
    """The scaled 8-bit weights of a load by the fused parameter and row offset they fill;
    `weights` joins each parameter's pieces."""

    def __init__(self, block: tuple[int, int] | None = None) -> None:
        """block: (rows, columns) of a block-wise checkpoint's scale blocks."""
        self._pieces: dict[str, dict[int, _Piece]] = {}
        self.block = block

    def _piece(self, target: str, offset: int | None) -> _Piece:
        return self._pieces.setdefault(target, {}).setdefault(offset or 0, _Piece())

    def add_weight(self, target: str, offset: int | None, weight: torch.Tensor) -> None:
        self._piece(target, offset).weight = weight

    def add_sidecar(self, target: str, offset: int | None, kind: str, tensor: Any,
                    rows: tuple[int, int] | None) -> None:
        """A scale or zero point of the weight `target` (the fused parameter's name);
        rows: the (start, length) a per-channel tensor is sliced to (tensor parallelism)."""
        t = tensor if isinstance(tensor, torch.Tensor) else tensor[...]  # scalars too
        # block scales are whole: block-wise weights are not sliced (no tensor parallelism)
        if rows is not None and t.numel() > 1 and not (self.block and t.dim() == 2):
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
            runs = -(-cols // self.block[1]) if self.block else 0
            scales = torch.zeros((rows, runs) if self.block else (rows,), dtype=torch.float32)
            input_scale = 0.0
            for offset, p in sorted(pieces.items()):
                scale_name = "weight_scale_inv" if "weight_scale_inv" in p.sidecars \
                    else "weight_scale"
                if p.weight is None or scale_name not in p.sidecars:
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
                weight[offset:offset + n] = p.weight
                if self.block:
                    scales[offset:offset + n] = self._block_rows(
                        target, p.sidecars[scale_name].float(), n, cols)
                else:
                    scale = p.sidecars[scale_name].float().reshape(-1)
                    if scale.numel() not in (1, n):
                        raise UnsupportedModelError(
                            f"quantized weight {target}: {scale.numel()} scales for {n} rows")
                    scales[offset:offset + n] = scale.expand(n)
                if "input_scale" in p.sidecars:  # fused layers share the widest range
                    input_scale = max(input_scale, float(p.sidecars["input_scale"].max()))
            out[target] = ScaledWeight(weight, scales, input_scale,
                                       self.block[1] if self.block else 0)
        return out

    def _block_rows(self, target: str, grid: torch.Tensor, rows: int,
                    cols: int) -> torch.Tensor:
        """A piece's [ceil(rows / bn), ceil(cols / bk)] block scales, one row per weight row."""
        bn, bk = self.block
        want = (-(-rows // bn), -(-cols // bk))
        if tuple(grid.shape) != want:
            raise UnsupportedModelError(
                f"quantized weight {target}: block scales of shape {tuple(grid.shape)} for "
                f"{rows} x {cols} in blocks of {bn} x {bk} (expected {want})")
        return grid.repeat_interleave(bn, 0)[:rows]


__all__ = ["SIDECARS", "STORAGE", "ScaledPieces", "ScaledWeight"]
