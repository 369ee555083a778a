"""RMSNorm computed in float32 like the reference implementations, cast back after.

Called with a residual it first adds x into the residual (vLLM's fused pattern):
returns (norm(residual + x), residual + x). With native kernels this is one pass,
in place.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class RMSNorm(torch.nn.Module):
    def __init__(self, size: int, eps: float, kernels=None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.eps = eps
        self.kernels = kernels

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            fused = getattr(self.kernels, "rms_norm", None)  # the Triton ops have one
            if fused is not None and x.is_contiguous() and x.dim() == 2:
                return fused(x, self.weight, self.eps)
            return self._norm(x)
        if self.kernels is not None and x.is_contiguous() and x.dim() == 2:
            self.kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        y = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * y.to(x.dtype)
