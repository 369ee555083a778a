"""int4 weight-only checkpoints with a scale and zero point per group of input columns:
AWQ (vLLM's `awq`, AutoAWQ's GEMM layout) and GPTQ (vLLM's `gptq`, with or without
act-order), read into GGUF's Q4_1 blocks.

Why Q4_1: a group's weights are w = (q - z) * s, and Q4_1's are w = q * d + m for each
run of 32, so with d = s and m = -z * s every run of a group (a multiple of 32 wide) is
one Q4_1 block holding the same 4-bit q. The blocks are then served exactly as a GGUF
file's: regrouped for the AVX-512 VNNI kernels, sliced for tensor parallelism, held by
the decoder stack (engine/quant/gguf_linear.py). The one rounding is m's, stored as a
half like s: at most half a unit in its 11th bit, so for the largest zero point (15) a
shift of 15 x 2^-12 = 0.4 % of a quantization step (a 4-bit weight's own rounding is
up to 50 %); tests bound it and the logits' difference.

On disk, per linear `<prefix>` (W is [out, in], y = x W^T):
- AWQ: `qweight` int32 [in, out / 8], `qzeros` int32 [in / g, out / 8], each int32 eight
  4-bit values of consecutive output columns in AutoAWQ's order (nibble i holds column
  AWQ_ORDER[i] of its eight); `scales` half [in / g, out].
- GPTQ: `qweight` int32 [in / 8, out] (nibble i: input row 8j + i), `qzeros` int32
  [groups, out / 8] (nibble i: column 8j + i; stored as z - 1 in the original format),
  `scales` half [groups, out], `g_idx` int32 [in] (each input row's group). With
  act-order (desc_act) the groups are not runs of rows: the input columns are sorted by
  group at load and each call gathers x's columns in that order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

from engine.errors import UnsupportedModelError, UnsupportedQuantizationError
from engine.quant.dummy import tiled
from engine.quant.gguf_weights import GGUFBlocks
from engine.quant.method import QuantFormat, config_dict

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
INPUT_ORDER = "input_order"  # the name suffix under which act-order's column order is yielded


@dataclass(frozen=True)
class Int4Scheme:
    method: str  # awq or gptq
    group_size: int  # -1: one group over all of K
    act_order: bool
    zeros_minus_one: bool  # GPTQ's original format stores z - 1


def read_scheme(method: str, qc: dict, model: str) -> Int4Scheme:
    """The int4 scheme of an AWQ or GPTQ `quantization_config`; raises
    UnsupportedQuantizationError naming what is not served."""
    def refuse(what: str) -> UnsupportedQuantizationError:
        return UnsupportedQuantizationError(
            f"model {model!r} is {method} with {what}; Flotilla serves {method} with 4-bit "
            "weights in groups of a multiple of 32 input columns"
            + (" (AutoAWQ's GEMM layout, zero points)" if method == "awq" else ""))

    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise refuse(f"{bits}-bit weights")
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if group != -1 and (group <= 0 or group % 32):
        raise refuse(f"group size {group}")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise refuse(f"version {version!r}")
        if not qc.get("zero_point", True):
            raise refuse("no zero points")
        return Int4Scheme("awq", group, False, False)
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise refuse(f"checkpoint_format {fmt!r}")
    return Int4Scheme("gptq", group, bool(qc.get("desc_act", False)), fmt == "gptq")


def _nibbles_along_columns(packed: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """int32 [R, C / 8] -> uint8 [R, C]; order: which column of its eight nibble i holds."""
    vals = (packed.to(torch.int32).unsqueeze(-1) >> _SHIFTS) & 0xF  # [R, C/8, 8]
    if order is not None:
        out = torch.empty_like(vals)
        out[..., list(order)] = vals
        vals = out
    return vals.reshape(packed.shape[0], -1).to(torch.uint8)


def _nibbles_along_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R / 8, C] -> uint8 [R, C] (nibble i of row j: row 8j + i)."""
    vals = (packed.to(torch.int32).unsqueeze(1) >> _SHIFTS.view(1, 8, 1)) & 0xF  # [R/8, 8, C]
    return vals.reshape(-1, packed.shape[1]).to(torch.uint8)


def q4_1_blocks(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> GGUFBlocks:
    """Q4_1 blocks of W [N, K] from q (uint8 0..15, [N, K]) and per-run scales and zero
    points ([N, K / 32] each): d = s, m = -z * s, both half."""
    n, k = q.shape
    if k % 32:
        raise UnsupportedModelError(f"int4 weight of {k} input columns: not whole runs of 32")
    runs = q.view(n, k // 32, 32)
    qs = runs[..., :16] | (runs[..., 16:] << 4)  # low nibbles: weights 0-15; high: 16-31
    d = scales.to(torch.float16).contiguous()
    m = (-(zeros.float() * scales.float())).to(torch.float16).contiguous()
    raw = torch.cat((d.view(torch.uint8).view(n, k // 32, 2), m.view(torch.uint8).view(n, k // 32, 2),
                     qs), dim=-1)
    return GGUFBlocks("Q4_1", raw.reshape(n, -1).contiguous(), k)


def _per_run(per_group: torch.Tensor, group_of_run: torch.Tensor) -> torch.Tensor:
    """[groups, N] -> [N, runs]: each run's group's values."""
    return per_group.index_select(0, group_of_run).t()


def awq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               group: int) -> GGUFBlocks:
    q = _nibbles_along_columns(qweight, AWQ_ORDER).t().contiguous()  # [N, K]
    k = q.shape[1]
    g = k if group == -1 else group
    z = _nibbles_along_columns(qzeros, AWQ_ORDER)  # [groups, N]
    runs = torch.arange(k // 32) * 32 // g
    return q4_1_blocks(q, _per_run(scales, runs), _per_run(z, runs))


def gptq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor | None, scheme: Int4Scheme
                ) -> tuple[GGUFBlocks, torch.Tensor | None]:
    """The blocks, and the input columns' order where act-order shuffled the groups
    (None: in order)."""
    q = _nibbles_along_rows(qweight).t().contiguous()  # [N, K]
    n, k = q.shape
    z = _nibbles_along_columns(qzeros, None).to(torch.int16)  # [groups, N]
    if scheme.zeros_minus_one:
        z = (z + 1) & 0xF  # the original format stores z - 1 (wrapping at 4 bits)
    g = k if scheme.group_size == -1 else scheme.group_size
    groups = torch.arange(k) // g if g_idx is None else g_idx.to(torch.int64)
    order = None
    if not torch.equal(groups, torch.arange(k) // g):  # act-order: sort columns by group
        order = torch.argsort(groups, stable=True)
        q, groups = q.index_select(1, order), groups.index_select(0, order)
    runs = groups.view(k // 32, 32)
    if not bool((runs == runs[:, :1]).all()):
        raise UnsupportedQuantizationError(
            "a GPTQ group is not a whole number of runs of 32 input columns")
    first = runs[:, 0]
    return q4_1_blocks(q, _per_run(scales, first), _per_run(z, first)), order


def iter_int4_weights(weights: Iterable[tuple[str, Any]], scheme: Int4Scheme
                      ) -> Iterator[tuple[str, Any]]:
    """A checkpoint's tensors with each int4 linear's packed tensors replaced by
    `<prefix>.weight` as Q4_1 blocks (and `<prefix>.input_order` under act-order); the
    rest pass through."""
    parts = ("qweight", "qzeros", "scales")  # GPTQ's g_idx, where present, sorts first
    pending: dict[str, dict[str, torch.Tensor]] = {}
    read = 0
    for name, tensor in weights:
        prefix, _, kind = name.rpartition(".")
        if kind not in parts and not (kind == "g_idx" and scheme.method == "gptq"):
            yield name, tensor
            continue
        held = pending.setdefault(prefix, {})
        held[kind] = tensor if isinstance(tensor, torch.Tensor) else tensor[:]
        if any(p not in held for p in parts):
            continue
        del pending[prefix]
        read += 1
        if scheme.method == "awq":
            yield f"{prefix}.weight", awq_weight(held["qweight"], held["qzeros"],
                                                 held["scales"], scheme.group_size)
            continue
        blocks, order = gptq_weight(held["qweight"], held["qzeros"], held["scales"],
                                    held.get("g_idx"), scheme)
        yield f"{prefix}.weight", blocks
        if order is not None:
            yield f"{prefix}.{INPUT_ORDER}", order
    if pending:
        prefix, held = next(iter(pending.items()))
        raise UnsupportedModelError(
            f"int4 weight {prefix} lacks {sorted(set(parts) - set(held))} in the checkpoint")
    if not read:
        raise UnsupportedModelError(f"the checkpoint's config says {scheme.method}, but it "
                                    "holds no qweight / qzeros / scales tensors")


class Int4Format(QuantFormat):
    """AWQ or GPTQ (one object each): int4 groups, read into Q4_1 blocks at load."""

    def __init__(self, name: str, variant: str) -> None:
        super().__init__(name, (variant,))

    def check(self, hf_config: Any, model: str) -> None:
        self.scheme(hf_config, model)

    def scheme(self, hf_config: Any, model: str) -> Int4Scheme:
        return read_scheme(self.name, config_dict(hf_config), model)

    def read(self, weights: Iterable[tuple[str, Any]], scheme: Int4Scheme
             ) -> Iterator[tuple[str, Any]]:
        return iter_int4_weights(weights, scheme)



class AwqFormat(Int4Format):
    """AWQ, which a dummy load can make too (bench/gpu.py times its decode steps)."""

    def dummy_config(self, group_size: int = 128) -> dict[str, Any]:
        return {"quant_method": "awq", "bits": 4, "group_size": group_size,
                "zero_point": True, "version": "gemm"}

    def dummy_linear(self, out: int, inp: int, scheme: Int4Scheme, generator: torch.Generator,
                     device: torch.device) -> dict[str, torch.Tensor]:
        """Random AutoAWQ words, zero points and half scales for scheme's groups (-1:
        one group over all of the inputs)."""
        group_size = inp if scheme.group_size == -1 else scheme.group_size
        if inp % group_size or out % 8:
            raise UnsupportedQuantizationError(
                f"load_format dummy, awq: a {out} x {inp} linear is not a whole number of "
                f"{group_size}-input groups and 8-output words")
        words = tiled(inp, lambda n: torch.randint(-2 ** 31, 2 ** 31 - 1, (n, out // 8),
                                                   generator=generator, device=device,
                                                   dtype=torch.int32))
        zeros = torch.randint(-2 ** 31, 2 ** 31 - 1, (inp // group_size, out // 8),
                              generator=generator, device=device, dtype=torch.int32)
        scales = (torch.rand((inp // group_size, out), generator=generator, device=device)
                  * 2e-4).to(torch.float16)
        return {"qweight": words, "qzeros": zeros, "scales": scales}


AWQ = AwqFormat("awq", "4-bit, groups of a multiple of 32, GEMM layout")
GPTQ = Int4Format("gptq", "4-bit, groups of a multiple of 32, with or without act-order")


__all__ = ["AWQ", "AWQ_ORDER", "AwqFormat", "GPTQ", "INPUT_ORDER", "Int4Format", "Int4Scheme", "awq_weight", "gptq_weight",
           "iter_int4_weights", "q4_1_blocks", "read_scheme"]
