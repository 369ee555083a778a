"""Linear layers whose weights are packed once at load on CPU.

Two packings, the first that fits:
- the native kernels' own (engine/model/kernels/linear.cpp; float32 everywhere, bf16
  where the CPU has AVX512_BF16): a matmul that streams the next weight panel in while
  it multiplies one, 1.1-2x oneDNN's packed matmul from 1 to 512 rows (docs/benchmarks.md);
- oneDNN's blocked layout, where the native kernels are missing or lack the dtype:
  torch's CPU matmul reorders the weight into it on every call, and at decode batch
  sizes packing once made SmolLM2's 64-row matmuls 15-35 % faster, bitwise identical.
On CUDA the layers are plain nn.Linear.

A layer may instead hold its weight quantized (set_quantized): as a GGUF file's blocks
(engine.quant.gguf_linear) or int8 W8A8 (engine.quant.int8_w8a8), multiplied by the
native kernels as stored.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.cpu_features import cpu_has_native_bf16

_PACK_BATCH_HINT = 64  # the decode batch oneDNN picks its blocking for; any M works


def native_packs(kernels, dtype: torch.dtype) -> bool:
    """Whether the native kernel module `kernels` (or None) has a linear for dtype."""
    return kernels is not None and str(dtype).removeprefix("torch.") in kernels.linear_dtypes()


def can_pack(device: torch.device, dtype: torch.dtype, kernels=None) -> bool:
    """Whether linears of dtype on device can be packed: by the native kernels
    `kernels` (a module from engine.model.kernels.cpu_kernels, or None) or by oneDNN."""
    if device.type != "cpu":
        return False
    if native_packs(kernels, dtype):
        return True
    return onednn_packs(dtype)


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs (and runs) linears of dtype on this CPU. bf16 needs native
    bf16 dot products (engine.cpu_features, held like the kernels): torch's own check
    also passes on AVX-512 parts without them, where oneDNN emulates bf16 slower than
    float32, and on AVX2-only parts its reorder raises from inside the kernel."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return cpu_has_native_bf16() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


class Linear(nn.Linear):
    """nn.Linear plus pack(): afterwards forward runs on the prepacked weight."""

    packed_weight: torch.Tensor | None = None
    _native_linear = None  # kernels.linear when packed_weight is in the native layout
    # Set by the owner when the output is [gate | up] halves (the MLP's gate_up_proj):
    # the native packing then pairs them, and forward_glu writes silu(gate) * up.
    glu_halves = False
    _paired = False
    # a GGUFWeight, Int8Weight or Int4Weight once set_quantized replaced the weight
    quant = None
    # GPTQ act-order: the quantized weight's columns are x's in this order (a gather first)
    input_order: torch.Tensor | None = None

    def set_quantized(self, weight) -> None:
        """Serve the weight quantized (a GGUFWeight, Int8Weight or Int4Weight, each with
        matmul, nbytes and packing); the dense one is released."""
        self.quant = weight
        del self.weight
        self.register_parameter("weight", None)

    def pack(self, keep_dense: bool = False, kernels=None) -> None:
        """Prepack the weight: for the native kernels `kernels` when they have this
        dtype, else for oneDNN. keep_dense keeps the dense tensor (a tied embedding still
        reads it); otherwise it is released, so packing costs no memory. Where neither
        runs the dtype on this CPU (bf16 without native bf16), the weight stays dense."""
        weight = self.weight.detach()
        if not native_packs(kernels, weight.dtype) and not onednn_packs(weight.dtype):
            return
        if native_packs(kernels, weight.dtype):
            self._paired = self.glu_halves and self.out_features % 2 == 0
            self.packed_weight = kernels.pack_linear(weight, paired=self._paired)
            self._native_linear = kernels.linear
        else:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight,
                                                                         _PACK_BATCH_HINT)
        if not keep_dense:
            del self.weight
            self.register_parameter("weight", None)

    def packed_bytes(self) -> int:
        if self.quant is not None:
            return self.quant.nbytes
        w = self.packed_weight
        return 0 if w is None else w.numel() * w.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            if self.input_order is not None:
                x = x.index_select(-1, self.input_order)
            return self.quant.matmul(x, self.bias)
        if self._native_linear is not None:
            return self._native_linear(x, self.packed_weight, self.bias, self.out_features,
                                       paired=self._paired)
        if self.packed_weight is not None:  # the resolved overload: no per-call lookup
            return torch.ops.mkldnn._linear_pointwise.default(x, self.packed_weight, self.bias,
                                                              "none", [], "")
        return F.linear(x, self.weight, self.bias)

    @property
    def fuses_glu(self) -> bool:
        """Whether forward_glu runs (a glu_halves layer packed for the native kernels)."""
        return self._paired

    def forward_glu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this layer's [gate | up] output, in the matmul's own pass
        (rounded as the kernels' silu_and_mul rounds). Needs fuses_glu."""
        if not self._paired:
            raise RuntimeError("forward_glu needs a glu_halves layer packed for the native "
                               "kernels")
        return self._native_linear(x, self.packed_weight, self.bias, self.out_features,
                                   paired=True, glu=True)

    def forward_float(self, x: torch.Tensor, dense_rows: int | None = None) -> torch.Tensor:
        """forward(x).float() in one pass where the native kernel runs it (the LM head: it
        writes float32 logits holding the dtype-rounded values, with no bf16 copy between)."""
        if self.quant is not None:  # dense_rows: GGUF's int8 products up to that many rows
            from engine.quant.gguf_linear import DECODE_DENSE_ROWS
            if self.input_order is not None:
                x = x.index_select(-1, self.input_order)
            return self.quant.matmul(x, self.bias, float_out=True,
                                    dense_rows=DECODE_DENSE_ROWS if dense_rows is None
                                    else dense_rows)
        if self._native_linear is not None:
            return self._native_linear(x, self.packed_weight, self.bias, self.out_features,
                                       float_out=True, paired=self._paired)
        return self(x).float()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, packed={self.packing()}")

    def packing(self) -> str | None:
        """Which layout forward runs on: "native", "onednn", "gguf:<formats>", "int8",
        "int4-triton" or None (dense)."""
        if self.quant is not None:
            return self.quant.packing()
        if self.packed_weight is None:
            return None
        return "native" if self._native_linear is not None else "onednn"


def pack_linears(model: nn.Module, keep_dense: set[int] | None = None, kernels=None) -> int:
    """Pack every Linear of model in place; returns how many were packed.
    keep_dense: id()s of weights other modules share (tied embeddings); kernels: the
    native kernel module to pack for where it has the dtype (else oneDNN)."""
    keep_dense = keep_dense or set()
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.packed_weight is None and module.quant is None:
            module.pack(keep_dense=id(module.weight) in keep_dense, kernels=kernels)
            count += module.packing() is not None
        elif not isinstance(module, Linear) and hasattr(module, "pack_weights"):
            module.pack_weights(kernels)  # a layer with matrices of its own (MoE experts)
    return count
