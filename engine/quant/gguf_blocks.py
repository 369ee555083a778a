"""GGUF's block quantization formats: their byte layouts, and a torch decoder for each.

A GGUF tensor stores each row as a run of fixed-size blocks. Every block holds a few
half-precision scales and packed small integers for a fixed number of weights (32 for
the legacy formats, 256 for the K-quants). This module says what the formats Flotilla
reads look like byte by byte and decodes them exactly (the values llama.cpp computes,
in float32). The decoder is the reference that packed kernels are tested against, and
what a layer without such a kernel uses.

Layouts (little-endian; "f16" is an IEEE half):
- Q8_0, 32 weights in 34 bytes: d f16, then 32 int8 q; w = d * q.
- Q4_0, 32 in 18: d f16, then 16 bytes whose low nibbles are weights 0-15 and high
  nibbles 16-31; w = d * (q - 8).
- Q4_1, 32 in 20: d f16, m f16, then 16 bytes as Q4_0; w = d * q + m.
- Q4_K, 256 in 144: d f16, dmin f16, 12 bytes of 6-bit scale and min for eight
  sub-blocks of 32, then 128 bytes of nibbles: bytes 32i..32i+31 carry sub-block 2i in
  their low nibbles and 2i+1 in their high ones; w = d * sc * q - dmin * mn.
- Q6_K, 256 in 210: 128 bytes of low nibbles, 64 bytes of high bit pairs, 16 int8
  scales (one per 16 weights), then d f16; w = d * scale * (q - 32), q 6 bits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class BlockFormat:
    name: str  # GGML's type name
    weights: int  # per block
    nbytes: int  # per block
    bits: float  # stored bits per weight, scales included
    decode: Callable[[torch.Tensor], torch.Tensor]  # [n, nbytes] uint8 -> [n, weights]


def _f16(raw: torch.Tensor, at: int) -> torch.Tensor:
    """The half at byte offset `at` of every block, as float32 [n, 1]."""
    return raw[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Low and high nibbles of uint8 bytes, as int32."""
    as_int = packed.to(torch.int32)
    return as_int & 0xF, as_int >> 4


def _decode_q8_0(raw: torch.Tensor) -> torch.Tensor:
    return _f16(raw, 0) * raw[:, 2:34].contiguous().view(torch.int8).float()


def _decode_q4_0(raw: torch.Tensor) -> torch.Tensor:
    low, high = _nibbles(raw[:, 2:18])
    return _f16(raw, 0) * (torch.cat((low, high), dim=1) - 8).float()


def _decode_q4_1(raw: torch.Tensor) -> torch.Tensor:
    low, high = _nibbles(raw[:, 4:20])
    return _f16(raw, 0) * torch.cat((low, high), dim=1).float() + _f16(raw, 2)


def q4_k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins of Q4_K blocks from their 12 packed bytes
    ([n, 12] uint8 -> two [n, 8] int32): sub-blocks 0-3 keep theirs in the low six bits
    of bytes 0-3 (scales) and 4-7 (mins); 4-7 take four bits from bytes 8-11 and their
    top two from the spare high bits of bytes 0-3 (scales) and 4-7 (mins)."""
    s = packed.to(torch.int32)
    low_sc, low_mn = s[:, 0:4] & 63, s[:, 4:8] & 63
    high_sc = (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)
    high_mn = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return torch.cat((low_sc, high_sc), dim=1), torch.cat((low_mn, high_mn), dim=1)


def _decode_q4_k(raw: torch.Tensor) -> torch.Tensor:
    n = raw.shape[0]
    scale, minimum = q4_k_scales(raw[:, 4:16])
    low, high = _nibbles(raw[:, 16:144].reshape(n, 4, 32))
    q = torch.stack((low, high), dim=2).reshape(n, 8, 32).float()  # sub-block order
    d, dmin = _f16(raw, 0), _f16(raw, 2)
    w = (d * scale.float()).unsqueeze(2) * q - (dmin * minimum.float()).unsqueeze(2)
    return w.reshape(n, 256)


def _decode_q6_k(raw: torch.Tensor) -> torch.Tensor:
    n = raw.shape[0]
    ql = raw[:, 0:128].to(torch.int32).reshape(n, 2, 64)  # two halves of 128 weights
    qh = raw[:, 128:192].to(torch.int32).reshape(n, 2, 1, 32)
    scales = raw[:, 192:208].contiguous().view(torch.int8).float().reshape(n, 2, 8)
    d = _f16(raw, 208).unsqueeze(2)
    # within a half, quarter j (32 weights) takes its low four bits from ql (quarters 0
    # and 1 the low nibbles of ql's two 32-byte rows, 2 and 3 their high nibbles) and its
    # top two from bits 2j..2j+1 of qh
    low = torch.stack((ql[:, :, :32] & 0xF, ql[:, :, 32:] & 0xF,
                       ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4), dim=2)
    top = (qh >> torch.arange(0, 8, 2, dtype=torch.int32).view(1, 1, 4, 1)) & 3
    q = ((low | (top << 4)) - 32).float()  # [n, 2, 4, 32]
    # a scale covers 16 weights: quarter j, weights 16h..16h+15 use scale 2j + h
    per16 = scales.reshape(n, 2, 4, 2).repeat_interleave(16, dim=3)
    return (d.unsqueeze(3) * per16 * q).reshape(n, 256)


BLOCK_FORMATS: dict[str, BlockFormat] = {f.name: f for f in (
    BlockFormat("Q8_0", 32, 34, 8.5, _decode_q8_0),
    BlockFormat("Q4_0", 32, 18, 4.5, _decode_q4_0),
    BlockFormat("Q4_1", 32, 20, 5.0, _decode_q4_1),
    BlockFormat("Q4_K", 256, 144, 4.5, _decode_q4_k),
    BlockFormat("Q6_K", 256, 210, 6.5625, _decode_q6_k),
)}
# stored as plain floats: read as they are
FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})


def dequantize(raw: torch.Tensor, format_name: str, columns: int) -> torch.Tensor:
    """Rows of blocks ([rows, bytes] uint8) -> float32 [rows, columns]."""
    fmt = BLOCK_FORMATS[format_name]
    if columns % fmt.weights:
        raise ValueError(f"{format_name}: {columns} columns are not whole blocks of "
                         f"{fmt.weights}")
    blocks = columns // fmt.weights
    if raw.dtype != torch.uint8 or raw.shape[-1] != blocks * fmt.nbytes:
        raise ValueError(f"{format_name}: {columns} columns take {blocks * fmt.nbytes} "
                         f"bytes a row, got {tuple(raw.shape)} {raw.dtype}")
    rows = raw.reshape(-1, fmt.nbytes)
    return fmt.decode(rows).reshape(*raw.shape[:-1], columns)


__all__ = ["BLOCK_FORMATS", "BlockFormat", "FLOAT_TYPES", "dequantize", "q4_k_scales"]
