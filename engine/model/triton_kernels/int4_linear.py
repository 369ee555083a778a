"""4-bit weights with a scale and a min per run of 32 input columns (GGUF's Q4_1, which
AWQ and GPTQ checkpoints are read into: engine/quant/int4_groups.py), multiplied on the
GPU by a Triton kernel that unpacks them in registers: y = x W^T with W = q * d + m.

Why: a decode step reads every weight once, so 4.5 bits a weight (4 + a half scale and a
half min per 32) is a 3.6x smaller read than bf16's 16; dequantizing at load would
forfeit that.

Layout (Int4Weight.from_q4_1): `packed` int32 [K / 8, N], nibble i of row j holding input
column 8j + i (GPTQ's order, so a tile of K rows is a tile of packed rows); `d` and `m`
half [K / 32, N]. The kernel's K tile is one run of 32, so each tile has one d and one m
per column.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

RUN = 32  # input columns sharing a d and an m


@triton.jit
def int4_linear_kernel(x_ptr, packed_ptr, d_ptr, m_ptr, bias_ptr, y_ptr, M, N, K,
                       stride_xm, stride_ym, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """Grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)). float32 accumulation of x's dtype
    products: each K tile of 32 is unpacked from 4 packed rows, scaled by its run's d
    and shifted by its m, then multiplied with tl.dot (PRECISION "ieee" for float32 x:
    the GPU's default tf32 rounds its products to 10 mantissa bits)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, 32)
    m_ok = rm < M
    n_ok = rn < N
    shifts = (rk % 8) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for run in range(0, K // 32):
        k0 = run * 32
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + (k0 + rk)[None, :],
                    mask=m_ok[:, None], other=0.0)
        words = tl.load(packed_ptr + ((k0 + rk) // 8)[:, None].to(tl.int64) * N + rn[None, :],
                        mask=n_ok[None, :], other=0)
        q = (words >> shifts[:, None]) & 0xF
        d = tl.load(d_ptr + run * N + rn, mask=n_ok, other=0.0).to(tl.float32)
        mn = tl.load(m_ptr + run * N + rn, mask=n_ok, other=0.0).to(tl.float32)
        w = q.to(tl.float32) * d[None, :] + mn[None, :]
        acc += tl.dot(x, w.to(x.dtype), out_dtype=tl.float32, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@dataclass
class Int4Weight:
    """A [rows, columns] Q4_1 weight in the kernel's layout, on its device."""

    packed: torch.Tensor  # int32 [K / 8, N]
    d: torch.Tensor  # half [K / 32, N]
    m: torch.Tensor  # half [K / 32, N]
    rows: int
    columns: int

    @classmethod
    def from_q4_1(cls, raw: torch.Tensor, columns: int, device: torch.device) -> "Int4Weight":
        """From Q4_1 blocks ([N, K / 32 x 20] uint8: d, m, then 16 bytes of nibbles: low
        ones weights 0-15 of the run, high ones 16-31)."""
        n, k = raw.shape[0], columns
        blocks = raw.view(n, k // RUN, 20)
        d = blocks[..., 0:2].contiguous().view(torch.float16).view(n, k // RUN)
        m = blocks[..., 2:4].contiguous().view(torch.float16).view(n, k // RUN)
        qs = blocks[..., 4:].to(torch.int32)
        q = torch.cat((qs & 0xF, qs >> 4), dim=-1).reshape(n, k)  # [N, K]
        q = q.t().reshape(k // 8, 8, n)  # rows 8j + i
        packed = torch.zeros(k // 8, n, dtype=torch.int64)
        for i in range(8):
            packed |= q[:, i].to(torch.int64) << (4 * i)
        packed = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)
        return cls(packed.to(device), d.t().contiguous().to(device),
                   m.t().contiguous().to(device), n, k)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * 4 + (self.d.numel() + self.m.numel()) * 2

    def describe(self) -> str:
        return "int4-triton"

    def packing(self) -> str:
        """What Linear.packing reports for a layer holding it."""
        return "int4-triton"

    def stack_segments(self) -> None:
        """None: a GPU holder, which the CPU decoder stack does not call."""
        return None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None, float_out: bool = False,
               dense_rows: int | None = None) -> torch.Tensor:
        """x @ W.T (+ bias); float_out: float32 holding x-dtype-rounded values."""
        shape = x.shape
        x2 = x.reshape(-1, self.columns).contiguous()
        y = torch.empty(x2.shape[0], self.rows, dtype=x.dtype, device=x.device)
        if x2.shape[0]:
            block_m = 16 if x2.shape[0] <= 16 else 64
            grid = (triton.cdiv(x2.shape[0], block_m), triton.cdiv(self.rows, 64))
            int4_linear_kernel[grid](x2, self.packed, self.d, self.m,
                                     bias if bias is not None else self.d, y, x2.shape[0],
                                     self.rows, self.columns, x2.stride(0), y.stride(0),
                                     HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=64,
                                     PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
        y = y.reshape(*shape[:-1], self.rows)
        return y.float() if float_out else y


__all__ = ["Int4Weight", "int4_linear_kernel"]
