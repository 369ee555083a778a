"""A layer's weight held as GGUF blocks, multiplied by the native kernels as it is.

A fused layer (q/k/v, gate/up) takes its rows from several checkpoint tensors, and a
GGUF file may store them in different formats (Q4_K_M files keep some v projections in
Q6_K): the weight is a list of row segments, each one format, and a product is one
kernel call per segment. Neighbouring segments of one format are joined into one.

Where the build has them (AVX-512 VNNI, or AVX2 + FMA + F16C: `kernels.gguf_regroups()`),
Q4_0, Q4_1 and Q8_0 segments are regrouped once at load: the same bytes, 16 rows
interleaved per run of 32 weights, which the kernels of
engine/model/kernels/quant_regrouped.cpp (VNNI's vpdpbusd) and quant_regrouped_avx2.h
(AVX2's vpmaddubsw + vpmaddwd) multiply several times faster than the file's row-by-row
layout (quant_linear.cpp, every format and CPU; SSE2 and NEON builds keep it).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from engine.cpu_features import cpu_flags
from engine.errors import UnsupportedModelError
from engine.quant.gguf_weights import GGUFBlocks


def _decode_crossover() -> int:
    """Rows of a decode-only step up to which the int8 products run, by CPU. With AMX the
    decoded panels' bf16 tiles win past 64 rows (Xeon, 2 threads: 64-128 rows for a
    layer's linears, past 64 for the 49152-row LM head). With AVX-512 VNNI and no AMX
    (Zen 4, session 32) the regrouped blocks won at every batch measured (a layer: 1,559
    against 2,849 us at 128 rows, 3,130 against 5,004 at 256), and so did AVX2's against
    the float32 panels (Zen 4 held to x86-64-v3: a layer 2,914 against 7,198 us at 128
    rows, 5,853 against 11,931 at 256; the Q8_0 LM head 78 against 159 ms at 256).
    Elsewhere 64, unmeasured."""
    flags = cpu_flags()
    if "amx_bf16" in flags:
        return 64
    avx2_only = {"avx2", "fma", "f16c"} <= flags and "avx512f" not in flags
    return 256 if "avx512_vnni" in flags or avx2_only else 64


# Rows of x up to which the kernels multiply the blocks with int8 dot products; past
# it they decode the weight a panel at a time and use oneDNN's matmul, exact but for
# float rounding. A step with prompt tokens takes the decoded path past DENSE_ROWS rows,
# so a prompt's keys and values carry no int8 rounding of activations; a step of decodes
# only takes the int8 products up to DECODE_DENSE_ROWS rows, the measured crossover
# (_decode_crossover; docs/benchmarks.md, "GGUF blocks").
DENSE_ROWS = int(os.environ.get("FLOTILLA_GGUF_DENSE_ROWS", "16"))
DECODE_DENSE_ROWS = int(os.environ.get("FLOTILLA_GGUF_DECODE_DENSE_ROWS",
                                       str(_decode_crossover())))
REGROUPED_FORMATS = frozenset({"Q4_0", "Q4_1", "Q8_0"})


@dataclass(frozen=True)
class Segment:
    """Rows of a weight in one format: the file's blocks, or them regrouped."""

    format: str
    rows: int
    columns: int
    data: torch.Tensor  # uint8: [rows, bytes] as in the file, or flat when regrouped
    regrouped: bool

    @property
    def nbytes(self) -> int:
        return self.data.numel()


@dataclass
class GGUFWeight:
    """A [rows, columns] weight as row segments of GGUF blocks, in output-row order."""

    segments: list[Segment]
    kernels: object  # the native kernel module (engine.model.kernels.cpu_kernels())

    @classmethod
    def fuse(cls, pieces: list[tuple[int, GGUFBlocks]], rows: int, kernels) -> "GGUFWeight":
        """The weight of `rows` rows from (row offset, blocks) pieces that tile it; rows
        past the last piece (vocabulary padding under tensor parallelism) are zero
        blocks, which every format decodes to zeros."""
        joined: list[GGUFBlocks] = []
        at = 0
        for offset, piece in sorted(pieces, key=lambda p: p[0]):
            if offset != at:
                raise UnsupportedModelError(f"GGUF pieces leave rows {at}:{offset} unset")
            at = offset + piece.shape[0]
            if joined and joined[-1].format == piece.format:
                last = joined.pop()
                piece = GGUFBlocks(piece.format, torch.cat((last.raw, piece.raw)), piece.columns)
            joined.append(piece)
        if at < rows:
            last = joined.pop()
            pad = torch.zeros(rows - at, last.raw.shape[1], dtype=torch.uint8)
            joined.append(GGUFBlocks(last.format, torch.cat((last.raw, pad)), last.columns))
        elif at > rows:
            raise UnsupportedModelError(f"GGUF pieces hold {at} rows for a weight of {rows}")
        regroup = bool(kernels.gguf_regroups())
        segments = []
        for b in joined:
            raw = b.raw.contiguous()
            if regroup and b.format in REGROUPED_FORMATS:
                segments.append(Segment(b.format, raw.shape[0], b.columns,
                                        kernels.gguf_regroup(raw, b.format, b.columns), True))
            else:
                segments.append(Segment(b.format, raw.shape[0], b.columns, raw, False))
        return cls(segments, kernels)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def describe(self) -> str:
        return "+".join(s.format for s in self.segments)

    def packing(self) -> str:
        """What Linear.packing reports for a layer holding it."""
        return "gguf:" + self.describe()

    def stack_segments(self) -> list[tuple]:
        """Each row segment as the decoder stack calls it (engine.model.stack)."""
        return [("gguf_regrouped" if s.regrouped else "gguf", s.data, s.format, s.rows, [], 0.0)
                for s in self.segments]

    def _product(self, s: Segment, x: torch.Tensor, bias: torch.Tensor | None,
                 float_out: bool, dense_rows: int) -> torch.Tensor:
        if s.regrouped:
            return self.kernels.gguf_regrouped_linear(x, s.data, s.format, s.rows, bias,
                                                      float_out, dense_rows)
        return self.kernels.gguf_linear(x, s.data, s.format, bias, float_out, dense_rows)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None, float_out: bool = False,
               dense_rows: int = DENSE_ROWS) -> torch.Tensor:
        """x @ W.T (+ bias); float_out: float32 holding x-dtype-rounded values."""
        if len(self.segments) == 1:
            return self._product(self.segments[0], x, bias, float_out, dense_rows)
        outs, at = [], 0
        for s in self.segments:
            b = None if bias is None else bias[at:at + s.rows]
            outs.append(self._product(s, x, b, float_out, dense_rows))
            at += s.rows
        return torch.cat(outs, dim=-1)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of W decoded to dtype (an embedding lookup)."""
        if len(self.segments) != 1:
            raise UnsupportedModelError("an embedding's GGUF weight is one tensor")
        s = self.segments[0]
        out_dtype = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
        flat = ids.reshape(-1)
        if s.regrouped:
            out = self.kernels.gguf_regrouped_rows(s.data, s.format, s.rows, s.columns, flat,
                                                   out_dtype)
        else:
            out = self.kernels.gguf_dequantize(s.data.index_select(0, flat).contiguous(),
                                               s.format, s.columns, out_dtype)
        return out.to(dtype).reshape(*ids.shape, s.columns)


__all__ = ["DECODE_DENSE_ROWS", "DENSE_ROWS", "GGUFWeight", "REGROUPED_FORMATS", "Segment"]
