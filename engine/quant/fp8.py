"""FP8 weights (e4m3, one float scale per output channel or per tensor): vLLM's `fp8`
checkpoints and compressed-tensors' FP8 schemes (engine/quant/compressed_tensors.py).

Two ways to multiply them, neither a decode at load:
- CPU (Fp8Weight): engine/model/kernels/fp8_linear.cpp widens the bytes to float in
  registers; x stays in the activation dtype, not rounded to fp8 (a CPU has no fp8
  arithmetic: the cost is the weight read, one byte a weight against bf16's two).
- CUDA (Fp8ScaledMM, the Triton backend): torch._scaled_mm, fp8 x fp8 on the tensor
  cores, x quantized to e4m3 per token at each call (dynamic) or at the checkpoint's
  static input scale, the weight scale per output column.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import UnsupportedQuantizationError

E4M3_MAX = 448.0  # the largest finite e4m3 value


def check_fp8_config(qc: dict, model: str) -> None:
    """Refuse a vLLM `fp8` quantization_config this module does not serve, naming the
    part: block-wise scales (DeepSeek's and Qwen's 128 x 128 `weight_scale_inv`), e5m2."""
    def refuse(what: str) -> UnsupportedQuantizationError:
        return UnsupportedQuantizationError(
            f"model {model!r} is fp8 with {what}; Flotilla serves fp8 checkpoints of e4m3 "
            "weights with one scale per output channel or per tensor, activations dynamic "
            "or static")

    if qc.get("weight_block_size"):
        raise refuse(f"block-wise scales (weight_block_size {qc['weight_block_size']})")
    if qc.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
        raise refuse(f"activation_scheme {qc.get('activation_scheme')!r}")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise refuse(f"fmt {qc.get('fmt')!r}")


@dataclass
class Fp8Weight:
    """A [rows, columns] e4m3 weight with a float32 scale per row, packed for
    engine/model/kernels/fp8_linear.cpp."""

    packed: torch.Tensor
    scales: torch.Tensor  # float32 [rows]
    rows: int
    columns: int
    kernels: object

    @classmethod
    def of(cls, weight, kernels) -> "Fp8Weight":
        """From a ScaledWeight (engine.quant.scaled_pieces) of e4m3 values; its static input
        scale is not used (x is not rounded to fp8 on CPU)."""
        return cls(kernels.fp8_pack(weight.weight), weight.scales.float().contiguous(),
                   weight.weight.shape[0], weight.weight.shape[1], kernels)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales.numel() * 4

    def describe(self) -> str:
        return "fp8"

    def packing(self) -> str:
        return "fp8"

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None, float_out: bool = False,
               dense_rows: int | None = None) -> torch.Tensor:
        """x @ (W * scales).T (+ bias); dense_rows is GGUF's and has no meaning here."""
        return self.kernels.fp8_linear(x, self.packed, self.scales, bias, self.rows, float_out)


@dataclass
class Fp8ScaledMM:
    """A [rows, columns] e4m3 weight on its device, multiplied by torch._scaled_mm with
    row-wise scales: x's per token, the weight's per output column."""

    weight_t: torch.Tensor  # [columns, rows]: the row-major weight's transpose (column-major)
    scales: torch.Tensor  # float32 [1, rows]
    rows: int
    columns: int
    input_scale: float  # 0: dynamic per token

    @classmethod
    def of(cls, weight, device: torch.device) -> "Fp8ScaledMM | None":
        """From a ScaledWeight of e4m3 values; None where _scaled_mm cannot take its shape
        (both sides a multiple of 16): the loader then decodes it."""
        rows, columns = weight.weight.shape
        if rows % 16 or columns % 16:
            return None
        return cls(weight.weight.to(device).t(), weight.scales.float().reshape(1, -1).to(device),
                   rows, columns, weight.input_scale)

    @property
    def nbytes(self) -> int:
        return self.rows * self.columns + self.rows * 4

    def describe(self) -> str:
        return "fp8"

    def packing(self) -> str:
        return "fp8-scaled-mm"

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None, float_out: bool = False,
               dense_rows: int | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.columns)
        xf = x2.float()
        if self.input_scale > 0:
            sx = torch.full((x2.shape[0], 1), self.input_scale, device=x.device)
        else:
            sx = xf.abs().amax(-1, keepdim=True).clamp_min(1e-12) / E4M3_MAX
        q = (xf / sx).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        # row-wise scaling takes a bf16 output (CUDA's only one for it)
        y = torch._scaled_mm(q, self.weight_t, scale_a=sx, scale_b=self.scales,
                             out_dtype=torch.bfloat16)
        y = y.float() if float_out else y.to(x.dtype)
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.rows)


__all__ = ["E4M3_MAX", "Fp8ScaledMM", "Fp8Weight", "check_fp8_config"]
