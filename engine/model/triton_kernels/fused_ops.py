"""A decoder layer's element-wise work in Triton, one launch for what torch does in
several: residual add + RMSNorm, rotary embedding of q and k plus the write of k and v
into the paged cache, and SiLU(gate) x up.

A decode step of a small model is bound by kernel count as much as by bytes: on the
H200, 1B at batch 64 spent 16 % of its step in about 300 small torch kernels
(docs/benchmarks.md). These bring a layer to about 10 launches, all inside the
captured CUDA graph.

Arithmetic is float32 inside each kernel; values are rounded to the activation dtype
where the torch path rounds them (the residual sum, the normalised row before the
weight), so the two paths agree to the dtype's precision.

TritonLayerOps gathers them behind the interface the model's layers call for fused
work (the CPU kernels' names: fused_add_rms_norm, silu_and_mul; and rms_norm, which
the CPU kernels leave to torch), so the layers run on either without knowing which. The
rotary is not among them: on this backend the attention layer hands its fused qkv to
TritonPagedAttention, whose rope_write_kv rotates and writes the cache in one launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r,
                        stride_o, eps, N: tl.constexpr, BLOCK: tl.constexpr,
                        HAS_RESIDUAL: tl.constexpr):
    """Grid (rows,). With a residual: residual += x, then out = norm(residual) * weight;
    without: out = norm(x) * weight."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_ptr + row * stride_r + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0)
    y = (xf * inv).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


# e4m3's largest finite value: an fp8 cache saturates there (the conversion alone would
# make values past it NaN)
FP8_MAX = tl.constexpr(448.0)


# 1.5 x 2^23: adding and subtracting it rounds a float32 below 2^22 to an integer, to
# nearest even
_RNE_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _e4m3_grid(y):
    """y (float32, within +-448) rounded to nearest even on e4m3's grid: 3 mantissa bits
    below y's power of two, steps of 2^-9 below 2^-6 (the subnormals). The cast of the
    result to e4m3 is then exact. Done by hand because Triton's interpreter converts to
    e4m3 wrongly where rounding carries into the exponent (124.0 became 64.0) and
    flushes subnormals, so CPU runs would hold other values than a GPU's."""
    size = tl.abs(y)
    exponent = tl.maximum(((size.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    step = ((exponent + 124) << 23).to(tl.float32, bitcast=True)  # 2^(exponent - 3)
    inverse = ((130 - exponent) << 23).to(tl.float32, bitcast=True)  # 2^(3 - exponent)
    rounded = ((size * inverse + _RNE_MAGIC) - _RNE_MAGIC) * step
    return tl.where(y.to(tl.int32, bitcast=True) < 0, -rounded, rounded)  # -0.0 too


@triton.jit
def _cache_value(x, scale, FP8: tl.constexpr, cache_type: tl.constexpr):
    """x as the cache stores it: unchanged in its dtype, or x / scale saturated in e4m3."""
    if FP8:
        # div_rn: the correctly rounded quotient (a GPU's `/` is approximate), so the
        # bytes are torch's on every device
        y = tl.minimum(tl.maximum(tl.math.div_rn(x.to(tl.float32), scale), -FP8_MAX), FP8_MAX)
        return _e4m3_grid(y).to(cache_type)
    return x.to(cache_type)


@triton.jit
def rope_write_kv_kernel(qkv_ptr, positions_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr,
                         slots_ptr, k_scale, v_scale, stride_t, stride_cos, stride_kh,
                         stride_ks, stride_vh, stride_vs, NUM_HEADS: tl.constexpr,
                         NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr,
                         KV_PAD: tl.constexpr, FP8: tl.constexpr):
    """Grid (tokens,). Rotates (neox, rotate-half) the q and k heads of one token's fused
    qkv row in place, then stores its k and v heads at the token's cache slot.
    cos / sin: the tables [max_positions, D] whose two halves repeat. FP8: the cache is
    e4m3, and holds k / k_scale and v / v_scale saturated to +-448 (the rotated k first
    rounded to the activation dtype, as the torch path and the CPU kernel round it)."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    half = HEAD_DIM // 2
    i = tl.arange(0, HALF_PAD)
    i_ok = i < half
    cos = tl.load(cos_ptr + pos * stride_cos + i, mask=i_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cos + i, mask=i_ok, other=0.0).to(tl.float32)
    h = tl.arange(0, HEADS_PAD)
    ok = (h < NUM_HEADS + NUM_KV_HEADS)[:, None] & i_ok[None, :]
    row = qkv_ptr + t * stride_t + h[:, None] * HEAD_DIM + i[None, :]
    x1 = tl.load(row, mask=ok, other=0.0)
    x2 = tl.load(row + half, mask=ok, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    y1 = (a * cos[None, :] - b * sin[None, :]).to(x1.dtype)
    y2 = (b * cos[None, :] + a * sin[None, :]).to(x1.dtype)
    tl.store(row, y1, mask=ok)
    tl.store(row + half, y2, mask=ok)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    kv = (h - NUM_HEADS).to(tl.int64)  # the k heads' rows, as kv head indices
    k_ok = ((h >= NUM_HEADS) & (h < NUM_HEADS + NUM_KV_HEADS))[:, None] & i_ok[None, :]
    k_at = k_cache_ptr + kv[:, None] * stride_kh + slot * stride_ks + i[None, :]
    tl.store(k_at, _cache_value(y1, k_scale, FP8, k_cache_ptr.dtype.element_ty), mask=k_ok)
    tl.store(k_at + half, _cache_value(y2, k_scale, FP8, k_cache_ptr.dtype.element_ty),
             mask=k_ok)
    g = tl.arange(0, KV_PAD).to(tl.int64)
    d = tl.arange(0, 2 * HALF_PAD)
    v_ok = (g < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    v_src = (qkv_ptr + t * stride_t + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM
             + g[:, None] * HEAD_DIM + d[None, :])
    v = tl.load(v_src, mask=v_ok, other=0.0)
    tl.store(v_cache_ptr + g[:, None] * stride_vh + slot * stride_vs + d[None, :],
             _cache_value(v, v_scale, FP8, v_cache_ptr.dtype.element_ty), mask=v_ok)


@triton.jit
def silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Grid (rows, column blocks): out = silu(x[:, :N]) * x[:, N:]."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + N + cols, mask=ok, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty),
             mask=ok)


_SILU_BLOCK = 1024


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """norm(x) * weight into out (default a new tensor; x itself works: a program reads
    its row before writing it); with a residual, residual += x first (in place) and the
    norm is of that sum. x, residual: [T, N] with contiguous rows."""
    out = torch.empty_like(x) if out is None else out
    if x.shape[0] == 0:
        return out
    n = x.shape[-1]
    res = residual if residual is not None else x
    add_rms_norm_kernel[(x.shape[0],)](
        x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), eps,
        N=n, BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=residual is not None)
    return out


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
                  sin_table: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                  k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Rotate the q and k heads of qkv [T, (H + 2 KVH) * D] in place and store each
    token's k and v at slots[t] of the cache (k_cache, v_cache [KVH, slots, D]); an e4m3
    cache stores them divided by k_scale / v_scale (its per-layer scales)."""
    t = qkv.shape[0]
    if t == 0:
        return
    rope_write_kv_kernel[(t,)](
        qkv, positions, cos_table, sin_table, k_cache, v_cache, slots, float(k_scale),
        float(v_scale), qkv.stride(0), cos_table.stride(0), k_cache.stride(0),
        k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HALF_PAD=triton.next_power_of_2(head_dim // 2),
        HEADS_PAD=triton.next_power_of_2(num_heads + num_kv_heads),
        KV_PAD=triton.next_power_of_2(num_kv_heads),
        FP8=k_cache.dtype == torch.float8_e4m3fn)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x = [gate | up] ([T, 2N], contiguous rows) -> [T, N]."""
    n = x.shape[-1] // 2
    out = x.new_empty(x.shape[0], n)
    if x.shape[0]:
        block = min(_SILU_BLOCK, triton.next_power_of_2(n))
        silu_and_mul_kernel[(x.shape[0], triton.cdiv(n, block))](
            x, out, x.stride(0), out.stride(0), N=n, BLOCK=block)
    return out


class TritonLayerOps:
    """The fused operations a decoder layer asks its `kernels` for, in Triton."""

    @staticmethod
    def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> None:
        """In place, as the CPU kernel: residual += x; x = norm(residual) * weight."""
        rms_norm(x, weight, eps, residual, out=x)

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
