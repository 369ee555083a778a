"""FP8 weights (e4m3, one float scale per output channel, per tensor or per block of
rows x columns): vLLM's `fp8` checkpoints and compressed-tensors' FP8 schemes
(engine/quant/compressed_tensors.py).

Two ways to multiply them, neither a decode at load:
- CPU (Fp8Weight): engine/model/kernels/fp8_linear.cpp widens the bytes to float in
  registers; x stays in the activation dtype, not rounded to fp8 (a CPU has no fp8
  arithmetic: the cost is the weight read, one byte a weight against bf16's two).
- CUDA (Fp8ScaledMM, the Triton backend): torch._scaled_mm, fp8 x fp8 on the tensor
  cores, x quantized to e4m3 per token at each call (dynamic) or at the checkpoint's
  static input scale, the weight scale per output column. Block-wise weights are decoded
  there (the loader logs it): _scaled_mm's row-wise scaling cannot hold them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

from engine.errors import UnsupportedQuantizationError
from engine.quant.dummy import tiled
from engine.quant.method import QuantFormat, config_dict

E4M3_MAX = 448.0  # the largest finite e4m3 value


def to_e4m3(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """x / scale saturated at +-448, in e4m3 (the bare conversion would make values past
    448 NaN): _scaled_mm's inputs, an fp8 KV cache's keys and values."""
    return (x.float() / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def check_fp8_config(qc: dict, model: str) -> None:
    """Refuse a vLLM `fp8` quantization_config this module does not serve, naming the
    part: e5m2, block sizes that are not two positive integers, static activations over
    block-wise weights (vLLM's block fp8 is dynamic)."""
    def refuse(what: str) -> UnsupportedQuantizationError:
        return UnsupportedQuantizationError(
            f"model {model!r} is fp8 with {what}; Flotilla serves fp8 checkpoints of e4m3 "
            "weights with one scale per output channel, per tensor or per block "
            "(weight_block_size), activations dynamic or (not over blocks) static")

    block = qc.get("weight_block_size")
    if block is not None:
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and b > 0 for b in block)):
            raise refuse(f"weight_block_size {block!r}")
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            raise refuse(f"block-wise weights and activation_scheme "
                         f"{qc.get('activation_scheme')!r}")
    if qc.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
        raise refuse(f"activation_scheme {qc.get('activation_scheme')!r}")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise refuse(f"fmt {qc.get('fmt')!r}")


class Fp8Format(QuantFormat):
    """vLLM's `fp8` checkpoints: e4m3 weights, scales per channel, tensor or block."""

    needs_quantized_tensors = True

    def __init__(self) -> None:
        super().__init__("fp8", ("e4m3 weights per channel, tensor or block "
                                 "(weight_block_size), activations dynamic or static",))

    def check(self, hf_config: Any, model: str) -> None:
        check_fp8_config(config_dict(hf_config), model)

    def scheme(self, hf_config: Any, model: str) -> tuple[int, int] | None:
        """The scale blocks' (rows, columns) of weight_block_size, else None."""
        block = config_dict(hf_config).get("weight_block_size")
        return (int(block[0]), int(block[1])) if block else None

    def scale_block(self, scheme: tuple[int, int] | None) -> tuple[int, int] | None:
        return scheme

    def read(self, weights: Iterable[tuple[str, Any]], scheme: Any
             ) -> Iterable[tuple[str, Any]]:
        return current_kv_scale_names(weights)

    def dummy_config(self, group_size: int = 128) -> dict[str, Any]:
        return {"quant_method": "fp8", "activation_scheme": "dynamic"}

    def dummy_linear(self, out: int, inp: int, scheme: Any, generator: torch.Generator,
                     device: torch.device) -> dict[str, torch.Tensor]:
        """Random e4m3 bytes but NaN's (0x7F, 0xFF), one scale a tensor."""
        raw = tiled(out, lambda n: torch.randint(0, 255, (n, inp), generator=generator,
                                                 device=device, dtype=torch.uint8))
        raw = torch.where(raw == 0x7F, 0x7E, raw)
        return {"weight": raw.view(torch.float8_e4m3fn),
                "weight_scale": torch.tensor(1e-3 / E4M3_MAX, device=device)}


def current_kv_scale_names(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """A checkpoint's tensors, an fp8 cache's scales under their current names: older
    fp8 checkpoints (AutoFP8's, llm-compressor's first) wrote them as
    self_attn.k_proj / v_proj.output_scale, now self_attn.k_scale / v_scale, which the
    loader reads."""
    for name, tensor in weights:
        head, _, last = name.rpartition(".")
        prefix, _, module = head.rpartition(".")
        if last == "output_scale" and module in ("k_proj", "v_proj"):
            name = f"{prefix}.{module[0]}_scale"
        yield name, tensor


VECTOR_ROWS = 16  # fp8_linear.cpp's vectors: output rows that share a block scale


@dataclass
class Fp8Weight:
    """A [rows, columns] e4m3 weight with a float32 scale per row, or per block (a scale
    per 16-row vector and run of block_k columns), packed for
    engine/model/kernels/fp8_linear.cpp."""

    packed: torch.Tensor
    scales: torch.Tensor  # float32 [rows] (ones for block-wise weights)
    rows: int
    columns: int
    kernels: object
    block_scales: torch.Tensor | None = None  # float32 [vectors, ceil(columns / block_k)]
    block_k: int = 0

    @classmethod
    def of(cls, weight, kernels) -> "Fp8Weight":
        """From a ScaledWeight (engine.quant.scaled_pieces) of e4m3 values; its static input
        scale is not used (x is not rounded to fp8 on CPU). Raises
        UnsupportedQuantizationError for block scales that change within a 16-row vector."""
        rows, columns = weight.weight.shape
        packed = kernels.fp8_pack(weight.weight)
        if not weight.block_k:
            return cls(packed, weight.scales.float().contiguous(), rows, columns, kernels)
        return cls(packed, torch.ones(rows), rows, columns, kernels,
                   vector_block_scales(weight.scales, weight.block_k), weight.block_k)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.block_scales is None else self.block_scales.numel() * 4
        return self.packed.numel() + self.scales.numel() * 4 + extra

    def describe(self) -> str:
        return "fp8"

    def packing(self) -> str:
        return "fp8"

    def stack_segments(self) -> list[tuple]:
        """The weight as the decoder stack calls it (engine.model.stack)."""
        extras = [self.scales] if self.block_scales is None else \
            [self.scales, self.block_scales, torch.tensor([self.block_k])]
        return [("fp8", self.packed, "", self.rows, extras, 0.0)]

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None, float_out: bool = False,
               dense_rows: int | None = None) -> torch.Tensor:
        """x @ (W * scales).T (+ bias); dense_rows is GGUF's and has no meaning here."""
        return self.kernels.fp8_linear(x, self.packed, self.scales, bias, self.rows, float_out,
                                       self.block_scales, self.block_k)


def vector_block_scales(row_scales: torch.Tensor, block_k: int) -> torch.Tensor:
    """[rows, runs] block scales (each row its block's) as the kernel reads them: one row
    per 16-row vector (padding rows past the last take its scale: their weights are
    zero). Raises UnsupportedQuantizationError where
    a vector's rows differ (blocks of rows not a multiple of 16, or fused pieces whose
    blocks do not start on a vector)."""
    rows, runs = row_scales.shape
    vectors = -(-rows // VECTOR_ROWS)
    padded = torch.zeros(vectors * VECTOR_ROWS, runs)
    padded[:rows] = row_scales
    padded[rows:] = row_scales[-1]  # the last vector's padding rows are never read
    grouped = padded.view(vectors, VECTOR_ROWS, runs)
    if not torch.equal(grouped, grouped[:, :1].expand_as(grouped)):
        raise UnsupportedQuantizationError(
            f"block-wise fp8 weight ({rows} rows, columns in runs of {block_k}): its scale "
            f"blocks change within a run of {VECTOR_ROWS} output rows; Flotilla's CPU kernel "
            f"serves blocks of a multiple of {VECTOR_ROWS} rows")
    return grouped[:, 0].contiguous()


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
        (both sides a multiple of 16) or its scales (block-wise): the loader then decodes
        it."""
        rows, columns = weight.weight.shape
        if rows % 16 or columns % 16 or weight.block_k:
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

    def stack_segments(self) -> None:
        """None: a CUDA holder, which the CPU decoder stack does not call."""
        return None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None, float_out: bool = False,
               dense_rows: int | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.columns)
        xf = x2.float()
        if self.input_scale > 0:
            sx = torch.full((x2.shape[0], 1), self.input_scale, device=x.device)
        else:
            sx = xf.abs().amax(-1, keepdim=True).clamp_min(1e-12) / E4M3_MAX
        q = to_e4m3(xf, sx)
        # row-wise scaling takes a bf16 output (CUDA's only one for it)
        y = torch._scaled_mm(q, self.weight_t, scale_a=sx, scale_b=self.scales,
                             out_dtype=torch.bfloat16)
        y = y.float() if float_out else y.to(x.dtype)
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.rows)


__all__ = ["E4M3_MAX", "Fp8Format", "Fp8ScaledMM", "Fp8Weight", "VECTOR_ROWS", "check_fp8_config",
           "current_kv_scale_names", "to_e4m3", "vector_block_scales"]
