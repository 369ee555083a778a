"""The fused element-wise CPU kernels against the torch code they replace, on every vector
path this host can build (the `kernels` fixture: native, and e.g. AVX2 and SSE2 on an
AVX-512 machine). Widths that are not a multiple of any vector width exercise the
scalar tails; bf16 must round where torch rounds."""
import platform

import pytest
import torch
import torch.nn.functional as F

from engine.model.layers.rotary import _rotate
from tests.conftest import cpu_flags

DTYPES = [torch.float32, torch.bfloat16]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # the same rounding points: where float math lands an intermediate one bf16 step
        err = (got.float() - want.float()).abs()  # apart (a tie), a product moves two at most
        assert (err <= want.float().abs() * 2 ** -6 + 1e-6).all(), err.max()
        assert (got == want).float().mean() > 0.97


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [576, 100])
def test_fused_add_rms_norm_matches_torch(kernels, dtype, cols):
    torch.manual_seed(0)
    x = torch.randn(7, cols).to(dtype)
    residual = torch.randn(7, cols).to(dtype)
    weight = (1 + 0.1 * torch.randn(cols)).to(dtype)
    want_residual = residual + x
    normed = F.rms_norm(want_residual.float(), (cols,), None, 1e-6)
    want = weight * normed.to(dtype) if dtype != torch.float32 else weight * normed
    kernels.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(residual, want_residual)
    _close(x, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 37])
def test_silu_and_mul_matches_torch(kernels, dtype, inter):
    torch.manual_seed(1)
    gate_up = (4 * torch.randn(9, 2 * inter)).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -30.0])  # exp at its clamps
    gate, up = gate_up.split(inter, dim=-1)
    _close(kernels.silu_and_mul(gate_up), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 20])
def test_rotary_inplace_matches_the_torch_rotation(kernels, dtype, head_dim):
    torch.manual_seed(2)
    heads, kv_heads, tokens, max_pos = 3, 1, 6, 50
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    cos, sin = torch.cat((freqs, freqs), -1).cos().to(dtype), torch.cat((freqs, freqs), -1).sin().to(dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    positions = torch.tensor([0, 1, 7, 8, 30, 49])
    rotated = (heads + kv_heads) * head_dim
    want = qkv.clone()
    x = qkv[:, :rotated].view(tokens, heads + kv_heads, head_dim)
    want[:, :rotated] = _rotate(x, cos[positions][:, None], sin[positions][:, None]).reshape(tokens, -1)
    kernels.rotary_inplace(qkv, positions, cos, sin, heads + kv_heads, head_dim)
    _close(qkv, want, dtype)
    assert torch.equal(qkv[:, rotated:], want[:, rotated:])  # values untouched


@pytest.mark.parametrize("cols", [49152, 1000, 5])
def test_argmax_rows_takes_the_first_maximum_and_nan_first(kernels, cols):
    torch.manual_seed(3)
    logits = torch.randn(6, cols)
    logits[1] = -1e30
    logits[2, cols // 3] = logits[2, cols - 1] = logits[2].max() + 1  # a tie: the first wins
    logits[3, cols - 1] = 50.0  # the last column, in the scalar tail where there is one
    logits[4, cols // 2] = float("nan")  # torch's rule: NaN is the maximum, the first one
    logits[4, cols - 1] = float("nan")
    logits[5, 0] = float("inf")
    got = kernels.argmax_rows(logits)
    assert torch.equal(got, logits.argmax(dim=-1))
    assert got[2].item() == cols // 3 and got[4].item() == cols // 2


def test_the_native_build_takes_the_widest_vectors_of_this_cpu():
    from engine.model.kernels import cpu_kernels
    flags = cpu_flags()
    native = cpu_kernels()
    if "avx512bw" in flags:
        assert (native.isa, native.lanes) == ("avx512", 16)
    elif "avx2" in flags and "fma" in flags:
        assert (native.isa, native.lanes) == ("avx2", 8)
    elif platform.machine() == "aarch64":
        assert (native.isa, native.lanes) == ("neon", 4)
