"""Linear layers whose weights can be prepacked once for oneDNN on CPU.

torch's CPU matmul (bf16 and fp32 alike) reorders the weight into oneDNN's blocked
layout on every call. At decode batch sizes that reorder is a large share of the
matmul: packing once at load made the 64-row matmuls of SmolLM2 15-35% faster,
bitwise identical in bf16 (docs/benchmarks.md). Packing is CPU-only; on CUDA the
layers are plain nn.Linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_PACK_BATCH_HINT = 64  # the decode batch oneDNN picks its blocking for; any M works


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN prepacked linears are available for this device and dtype."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


class Linear(nn.Linear):
    """nn.Linear plus pack(): afterwards forward runs on the prepacked weight."""

    packed_weight: torch.Tensor | None = None

    def pack(self, keep_dense: bool = False) -> None:
        """Prepack the weight. keep_dense keeps the dense tensor (a tied embedding
        still reads it); otherwise it is released, so packing costs no memory."""
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(
            self.weight.detach(), _PACK_BATCH_HINT)
        if not keep_dense:
            del self.weight
            self.register_parameter("weight", None)

    def packed_bytes(self) -> int:
        w = self.packed_weight
        return 0 if w is None else w.numel() * w.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:  # the resolved overload: no per-call lookup
            return torch.ops.mkldnn._linear_pointwise.default(x, self.packed_weight, self.bias,
                                                              "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, packed={self.packed_weight is not None}")


def pack_linears(model: nn.Module, keep_dense: set[int] | None = None) -> int:
    """Pack every Linear of model in place; returns how many were packed.
    keep_dense: id()s of weights other modules share (tied embeddings)."""
    keep_dense = keep_dense or set()
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.packed_weight is None:
            module.pack(keep_dense=id(module.weight) in keep_dense)
            count += 1
    return count
