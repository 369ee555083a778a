"""Small Triton kernels that expose a jitted helper of the engine's kernels to tests
(a kernel must be defined at module level to see the helpers it calls)."""
from __future__ import annotations

import triton
import triton.language as tl

from engine.model.triton_kernels.fused_ops import _cache_value


@triton.jit
def e4m3_store_kernel(x_ptr, y_ptr, N: tl.constexpr):
    """y = x as the fp8 cache write stores it (scale 1): saturated, rounded to e4m3."""
    i = tl.arange(0, N)
    tl.store(y_ptr + i, _cache_value(tl.load(x_ptr + i), 1.0, True, y_ptr.dtype.element_ty))
