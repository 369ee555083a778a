"""The Triton int4 kernel (engine/model/triton_kernels/int4_linear.py) against the Q4_1
blocks' exact decoder: compiled on a GPU, under Triton's interpreter without one."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from engine.model.triton_kernels import availability
from engine.quant.gguf_blocks import dequantize

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(availability(DEVICE) is not None,
                                reason=f"Triton kernels: {availability(DEVICE)}")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k", [(1, 72, 64), (5, 64, 96), (40, 130, 32)])
def test_int4_kernel_matches_the_decoded_blocks(dtype, m, n, k):
    from engine.model.triton_kernels.int4_linear import Int4Weight
    rng = np.random.default_rng(m + n + k)
    raw = torch.from_numpy(np.ascontiguousarray(quants.quantize(
        rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType.Q4_1)))
    w = dequantize(raw, "Q4_1", k)
    weight = Int4Weight.from_q4_1(raw, k, DEVICE)
    assert weight.nbytes == n * k // 2 + n * k // 32 * 4
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    bias = torch.randn(n)
    want = x.float() @ w.to(dtype).float().t() + bias
    got = weight.matmul(x.to(DEVICE), bias.to(DEVICE).to(dtype))
    assert got.dtype == dtype and got.shape == (m, n)
    scale = want.abs().max()
    assert (got.float().cpu() - want).abs().max() <= TOL[dtype] * scale * 4
    assert torch.equal(weight.matmul(x[:0].to(DEVICE), None).cpu(), torch.empty(0, n, dtype=dtype))
