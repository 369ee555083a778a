"""int8 W8A8 checkpoints in the compressed-tensors format (vLLM's `compressed-tensors`
quantization, as its CPU backend serves them): a linear's weight is int8 with a float
scale per output channel (or one per tensor), and its input is quantized to int8 at each
call, per token with a dynamic scale (or with the checkpoint's static `input_scale`).

Why int8 and not a decode to bf16 at load: the products are exact integers summed over
all of K and scaled once per output (engine/model/kernels/int8_linear.cpp, AMX int8 or
VNNI where the CPU has them), and a step reads half of bf16's weight bytes.

On disk (per quantized linear `<prefix>`): `<prefix>.weight` int8 [out, in],
`<prefix>.weight_scale` [out, 1] or [1], optionally `<prefix>.input_scale` (static
activations) and `<prefix>.weight_zero_point` (zeros: symmetric). The config's
`quantization_config` names the scheme; the schemes read here are checked by
`check_scheme`, every other one is refused naming what differs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.errors import UnsupportedModelError, UnsupportedQuantizationError

SIDECARS = ("weight_scale", "input_scale", "weight_zero_point")  # tensors beside a weight
_FORMATS = ("int-quantized", "naive-quantized")  # int8 values stored as int8


def check_scheme(qc: dict, model: str) -> None:
    """Raise UnsupportedQuantizationError naming the part of a compressed-tensors
    `quantization_config` Flotilla does not serve. What the weights need past that (static
    input scales, the modules left in float) the checkpoint's tensors say: an `input_scale`
    beside a weight, an int8 weight or a float one."""
    def refuse(what: str) -> UnsupportedQuantizationError:
        return UnsupportedQuantizationError(
            f"model {model!r} is compressed-tensors with {what}; Flotilla serves its int8 "
            "W8A8 schemes: int8 symmetric weights per channel or per tensor, with int8 "
            "symmetric activations per token (dynamic) or per tensor (static)")

    fmt = qc.get("format")
    if fmt not in _FORMATS:
        raise refuse(f"format {fmt!r}")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise refuse(f"{len(groups)} config groups")
    group = next(iter(groups.values()))
    w, a = group.get("weights") or {}, group.get("input_activations")
    if w.get("num_bits") != 8 or w.get("type", "int") != "int":
        raise refuse(f"{w.get('num_bits')}-bit {w.get('type')} weights")
    if not w.get("symmetric", True) or w.get("strategy") not in ("channel", "tensor"):
        raise refuse(f"{'asymmetric ' if not w.get('symmetric', True) else ''}weights by "
                     f"{w.get('strategy')!r}")
    if not a:
        raise refuse("weight-only int8 (no input_activations)")
    if a.get("num_bits") != 8 or a.get("type", "int") != "int" or not a.get("symmetric", True):
        raise refuse(f"{a.get('num_bits')}-bit {'asymmetric ' if not a.get('symmetric', True) else ''}"
                     f"{a.get('type')} activations")
    dynamic = bool(a.get("dynamic"))
    if (a.get("strategy"), dynamic) not in (("token", True), ("tensor", False)):
        raise refuse(f"{'dynamic' if dynamic else 'static'} activations by {a.get('strategy')!r}")
    if group.get("output_activations"):
        raise refuse("quantized output activations")
    if qc.get("kv_cache_scheme"):
        raise refuse("a kv_cache_scheme")
    targets = group.get("targets") or []
    if targets != ["Linear"]:
        raise refuse(f"targets {targets}")



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
    def of(cls, weight: torch.Tensor, scales: torch.Tensor, input_scale: float,
           kernels) -> "Int8Weight":
        packed, comp = kernels.int8_pack(weight.contiguous())
        return cls(packed, comp, scales.float().contiguous(), weight.shape[0], weight.shape[1],
                   input_scale, kernels)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales.numel() * 4

    def describe(self) -> str:
        return "int8"

    def packing(self) -> str:
        """What Linear.packing reports for a layer holding it."""
        return "int8"

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None, float_out: bool = False,
               dense_rows: int | None = None) -> torch.Tensor:
        """x @ (W * scales).T (+ bias), x quantized per token; dense_rows is GGUF's and has
        no meaning here (every row takes the int8 products)."""
        return self.kernels.int8_linear(x, self.packed, self.comp, self.scales, bias, self.rows,
                                        self.input_scale, float_out)


@dataclass
class _Piece:
    weight: torch.Tensor | None = None
    sidecars: dict[str, torch.Tensor] = field(default_factory=dict)


class Int8Pieces:
    """The int8 weights and their scales of a checkpoint as the loader meets them, by the
    fused parameter and row offset they fill; `weights` joins each parameter's pieces."""

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
        t = tensor if isinstance(tensor, torch.Tensor) else tensor[:]
        if rows is not None and t.numel() > 1:
            t = t[rows[0]:rows[0] + rows[1]]
        self._piece(target, offset).sidecars[kind] = t

    def targets(self) -> list[str]:
        return list(self._pieces)

    def weights(self, shapes: dict[str, torch.Size], kernels
                ) -> dict[str, "Int8Weight | torch.Tensor"]:
        """Each parameter's int8 weight (kernels given), or the weight decoded to float32
        (no kernel: the caller copies it into the parameter)."""
        out = {}
        for target, pieces in self._pieces.items():
            rows, cols = shapes[target]
            weight = torch.zeros(rows, cols, dtype=torch.int8)
            scales = torch.zeros(rows, dtype=torch.float32)
            input_scale = 0.0
            for offset, p in sorted(pieces.items()):
                if p.weight is None or "weight_scale" not in p.sidecars:
                    raise UnsupportedModelError(
                        f"int8 weight {target} at row {offset} lacks its "
                        f"{'weight' if p.weight is None else 'weight_scale'}")
                n = p.weight.shape[0]
                if offset + n > rows or p.weight.shape[1] != cols:
                    raise UnsupportedModelError(
                        f"int8 weight {target} has a piece of shape {tuple(p.weight.shape)} "
                        f"at row {offset}, for a parameter of {(rows, cols)}")
                zero = p.sidecars.get("weight_zero_point")
                if zero is not None and bool(zero.any()):
                    raise UnsupportedQuantizationError(
                        f"int8 weight {target} has non-zero zero points: asymmetric weights "
                        "are not served")
                scale = p.sidecars["weight_scale"].float().reshape(-1)
                if scale.numel() not in (1, n):
                    raise UnsupportedModelError(
                        f"int8 weight {target}: {scale.numel()} scales for {n} rows")
                weight[offset:offset + n] = p.weight
                scales[offset:offset + n] = scale.expand(n)
                if "input_scale" in p.sidecars:  # fused layers share the widest range
                    input_scale = max(input_scale, float(p.sidecars["input_scale"].max()))
            if kernels is None:
                out[target] = weight.float() * scales[:, None]
            else:
                out[target] = Int8Weight.of(weight, scales, input_scale, kernels)
        return out


__all__ = ["Int8Pieces", "Int8Weight", "SIDECARS", "check_scheme"]
