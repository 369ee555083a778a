"""Paged attention in Triton: one kernel for decodes and prefill chunks over a cached
context, and the reduce step of split-KV decoding.

Cache layout (the same as FlexAttention's, engine.model.layers.flex_paged): per layer
keys and values are each [KVH, slots, D], slot = page * page_size + offset, head-major,
so a kv head's keys for one page are one contiguous page_size x D span.

Work split: a program takes one query tile of one sequence and one kv head. Its rows
are BLOCK_Q queries x GROUP_PAD query heads, every query head that shares the kv head
(GQA / MQA packing), so each key and value is read once for all of them and the score
matmul has enough rows for the tensor cores even for a single decode token. It walks
the sequence's keys BLOCK_N at a time (a tile may span pages: each key's page comes
from the block table), with an online softmax in float32 and exp2.

Split-KV (decodes): with few sequences there are too few programs to fill the GPU, so a
third grid axis cuts each sequence's key tiles into NUM_SPLITS segments; each writes
its normalised partial output and its log-sum-exp to preallocated scratch, and
reduce_splits combines them. NUM_SPLITS is a launch constant, fixed per CUDA-graph
batch size, so a captured graph replays the same grid whatever the context lengths
(segments left without keys write an empty partial).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
MAX_SPLITS = 16  # the split-KV scratch holds this many segments a row


# the block table's row stride is its width, which varies step to step: not specialized
# on (Triton compiles a variant for a value of 1 or a multiple of 16)
@triton.jit(do_not_specialize=["stride_bt"])
def paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, part_out_ptr, part_lse_ptr,
        tile_seq_ptr, tile_q_ptr, query_start_ptr, seq_lens_ptr, tables_ptr, sinks_ptr,
        scale_log2, v_scale, window,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kh, stride_ks, stride_vh, stride_vs, stride_bt,
        stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
        PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
        HAS_SINKS: tl.constexpr):
    """Grid (query tiles, kv heads, NUM_SPLITS). Tile i covers queries
    tile_q[i] .. + BLOCK_Q of sequence tile_seq[i]; that sequence's queries are the flat
    tokens query_start[s] .. query_start[s + 1], the last of its seq_lens[s] positions.
    An e4m3 cache's keys and values are widened to q's dtype as they are loaded; k_scale
    is in scale_log2 and v_scale multiplies the output. window > 0: a query at position p
    sees keys p - window + 1 .. p only; the tiles before the tile's first visible key are
    skipped (their pages may have been freed). HAS_SINKS: each query head's sink
    (sinks_ptr, float32) joins its softmax's denominator; with splits, in the reduce."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seq_ptr + tile)
    q0 = tl.load(tile_q_ptr + tile)
    q_first = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_first
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # position of the sequence's first query

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    q_idx = q0 + rows // GROUP_PAD
    head = kvh * GROUP + rows % GROUP_PAD
    row_ok = (q_idx < q_len) & (rows % GROUP_PAD < GROUP)
    token = (q_first + q_idx).to(tl.int64)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q_pos = context + q_idx

    # keys up to the tile's last query, cut into this program's segment
    kv_end = tl.minimum(seq_len, context + q0 + BLOCK_Q)
    kv_start = tl.where(window > 0, tl.maximum(context + q0 - window + 1, 0), 0)
    first_tile = kv_start // BLOCK_N
    num_tiles = tl.cdiv(kv_end, BLOCK_N) - first_tile
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    t_lo = first_tile + split * per_split
    t_hi = tl.minimum(first_tile + num_tiles, t_lo + per_split)

    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_PAD], tl.float32)
    k_base = k_ptr + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + kvh.to(tl.int64) * stride_vh
    table = tables_ptr + seq.to(tl.int64) * stride_bt
    for t in range(t_lo, t_hi):
        keys = t * BLOCK_N + tl.arange(0, BLOCK_N)
        key_ok = (keys < kv_end) & (keys >= kv_start)
        page = tl.load(table + keys // PAGE, mask=key_ok, other=0).to(tl.int64)
        slot = page * PAGE + keys % PAGE
        k = tl.load(k_base + slot[None, :] * stride_ks + dims[:, None],
                    mask=key_ok[None, :] & dim_ok[:, None], other=0.0)  # [HEAD_PAD, BLOCK_N]
        s = tl.dot(q, k.to(q.dtype), input_precision=PRECISION) * scale_log2
        seen = key_ok[None, :] & (keys[None, :] <= q_pos[:, None]) & (
            (window <= 0) | (keys[None, :] > q_pos[:, None] - window))
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slot[:, None] * stride_vs + dims[None, :],
                    mask=key_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_N, HEAD_PAD]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                            input_precision=PRECISION)
        m_i = m_new

    if HAS_SINKS and NUM_SPLITS == 1:  # a key with no value: only the denominator grows
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")) * 1.4426950408889634
        l_i = l_i + tl.exp2(sink - tl.where(m_i == float("-inf"), 0.0, m_i))
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    result = acc / l_safe[:, None] * v_scale  # exact for a float cache's 1.0
    if NUM_SPLITS == 1:
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh
                 + dims[None, :], result.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & dim_ok[None, :])
    else:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        part = token[:, None] * stride_pt + head[:, None] * stride_ph + split * stride_ps
        tl.store(part_out_ptr + part + dims[None, :], result,
                 mask=row_ok[:, None] & dim_ok[None, :])
        tl.store(part_lse_ptr + token * stride_lt + head * stride_lh + split, lse,
                 mask=row_ok)


@triton.jit
def reduce_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, sinks_ptr,
                         stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
                         stride_ot, stride_oh,
                         NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                         HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                         HAS_SINKS: tl.constexpr):
    """Grid (tokens, heads): out = the splits' partial outputs weighted by
    exp2(lse - max lse), normalised (the head's sink joining the normaliser).
    A row no split saw (a padded decode row) is 0."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < NUM_SPLITS
    lse = tl.load(part_lse_ptr + token * stride_lt + head * stride_lh + splits,
                  mask=split_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    weight = tl.exp2(lse - m_safe)
    total = tl.sum(weight, 0)
    if HAS_SINKS:
        total += tl.where(m == float("-inf"), 0.0,
                          tl.exp2(tl.load(sinks_ptr + head) * 1.4426950408889634 - m_safe))
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_DIM
    parts = tl.load(part_out_ptr + token * stride_pt + head * stride_ph
                    + splits[:, None] * stride_ps + dims[None, :],
                    mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
    result = tl.sum(parts * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims,
             result.to(out_ptr.dtype.element_ty), mask=dim_ok)


@dataclass
class AttentionLaunch:
    """One launch of paged_attention_kernel: a set of sequences whose queries are
    contiguous flat tokens, cut into query tiles of block_q queries each."""

    tile_seq: torch.Tensor  # [tiles] int: each tile's sequence (index into the arrays below)
    tile_q: torch.Tensor  # [tiles] int: its first query, counted within the sequence
    query_start: torch.Tensor  # [S + 1] int: each sequence's first flat token, then the end
    seq_lens: torch.Tensor  # [S] int: context after this step, queries included
    block_tables: torch.Tensor  # [S, W] int: pages covering seq_lens
    block_q: int  # queries per tile (1 for decodes)
    num_splits: int = 1  # split-KV segments per tile (decodes)


@dataclass
class SplitScratch:
    """Preallocated split-KV partials for up to `rows` tokens (decodes come first in a
    step, so a decode token's index is its row): outputs [rows, H, MAX_SPLITS, D_pad] and
    log-sum-exps [rows, H, MAX_SPLITS], float32. Allocated once, so launches inside a
    captured CUDA graph keep their addresses."""

    out: torch.Tensor
    lse: torch.Tensor

    @classmethod
    def allocate(cls, rows: int, heads: int, head_dim: int,
                 device: torch.device) -> "SplitScratch":
        pad = triton.next_power_of_2(head_dim)
        return cls(torch.zeros(rows, heads, MAX_SPLITS, pad, device=device),
                   torch.zeros(rows, heads, MAX_SPLITS, device=device))


def group_pad(group: int, block_q: int) -> int:
    """Query-head rows per query in a tile: the group rounded up to a power of two, and
    for single-query tiles to 16 at least (tl.dot's smallest tile on the GPU)."""
    return max(triton.next_power_of_2(group), -(-16 // block_q))


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
           launch: AttentionLaunch, scale: float, page_size: int, block_n: int,
           scratch: SplitScratch | None = None, k_scale: float = 1.0,
           v_scale: float = 1.0, window: int = 0,
           sinks: torch.Tensor | None = None) -> None:
    """Attention of launch's queries in q [T, H, D] (row strides free, D contiguous) over
    one layer's cache (k_cache, v_cache [KVH, slots, D]) into out [T, H, D]. Queries see
    their sequence's keys at positions up to their own. Splits > 1 need scratch. An e4m3
    cache holds keys / k_scale and values / v_scale. window > 0: a sliding window;
    sinks: float32 [H], each head's attention sink."""
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[0]
    group = heads // kv_heads
    splits = launch.num_splits
    if splits > 1 and (scratch is None or splits > MAX_SPLITS
                       or scratch.out.shape[0] < int(launch.query_start.shape[0]) - 1):
        raise ValueError(f"{splits} splits need scratch for every decode row "
                         f"(at most {MAX_SPLITS} splits)")
    part_out = scratch.out if splits > 1 else out
    part_lse = scratch.lse if splits > 1 else out
    head_pad = triton.next_power_of_2(head_dim)
    grid = (launch.tile_seq.shape[0], kv_heads, splits)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    paged_attention_kernel[grid](
        q, k_cache, v_cache, out, part_out, part_lse,
        launch.tile_seq, launch.tile_q, launch.query_start, launch.seq_lens,
        launch.block_tables, launch.seq_lens if sinks is None else sinks,
        scale * _LOG2E * k_scale, float(v_scale), int(window),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        launch.block_tables.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2) if splits > 1 else 0,
        part_lse.stride(0), part_lse.stride(1),
        GROUP=group, GROUP_PAD=group_pad(group, launch.block_q), BLOCK_Q=launch.block_q,
        BLOCK_N=block_n, HEAD_DIM=head_dim, HEAD_PAD=head_pad, PAGE=page_size,
        NUM_SPLITS=splits, PRECISION=precision, HAS_SINKS=sinks is not None)
    if splits > 1:
        rows = int(launch.query_start.shape[0]) - 1
        reduce_splits_kernel[(rows, heads)](
            scratch.out, scratch.lse, out, launch.seq_lens if sinks is None else sinks,
            scratch.out.stride(0), scratch.out.stride(1), scratch.out.stride(2),
            scratch.lse.stride(0), scratch.lse.stride(1), out.stride(0), out.stride(1),
            NUM_SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits),
            HEAD_DIM=head_dim, HEAD_PAD=head_pad, HAS_SINKS=sinks is not None)
