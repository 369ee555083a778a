"""Paged attention over the block-structured KV cache, written with torch ops.

Every step first writes the new keys/values of all scheduled tokens into their
cache slots, then computes attention. Because the writes of a layer precede its
reads, a request may read blocks that another request fills in the same step
(prefix-cache hits on blocks scheduled in the same batch stay correct).

Requests with one query token (decodes, or a one-token prefill chunk) are
batched: their context is gathered block-wise from the cache and attended in
one masked SDPA call. Longer queries (prefill chunks) go one request at a time;
a prefill without cached context attends to its fresh k/v with no gather.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """One request with query_len > 1: tokens [start, start+query_len) of the batch."""

    start: int
    query_len: int
    context_len: int  # tokens in the cache after this step, query included
    block_table: torch.Tensor  # [num_blocks] int64 block ids covering context_len


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each query attends to.

    The batch holds the num_decodes single-token queries first, then the prefill spans.
    """

    slot_mapping: torch.Tensor  # [T] int64 flat slot index of each token
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [D, max_blocks] int64
    decode_mask: torch.Tensor | None  # [D, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillSpan]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D]; caches: [num_blocks, block_size, KVH, D].

    Returns the attention output [T, H, D].
    """
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    gqa = q.shape[1] != kv_heads

    d = meta.num_decodes
    if d:
        tables = meta.decode_block_tables
        ctx = tables.shape[1] * block_size
        kd = k_cache[tables].view(d, ctx, kv_heads, head_dim).transpose(1, 2)
        vd = v_cache[tables].view(d, ctx, kv_heads, head_dim).transpose(1, 2)
        qd = q[:d].unsqueeze(2)  # [D, H, 1, Dh]
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask,
                                           scale=scale, enable_gqa=gqa)
        out[:d] = o.squeeze(2)

    for span in meta.prefills:
        s, n, c = span.start, span.query_len, span.context_len
        qs = q[s:s + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, Dh]
        if c == n:
            ks = k[s:s + n].transpose(0, 1).unsqueeze(0)
            vs = v[s:s + n].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                               enable_gqa=gqa)
        else:
            ks = k_cache[span.block_table].view(-1, kv_heads, head_dim)[:c]
            vs = v_cache[span.block_table].view(-1, kv_heads, head_dim)[:c]
            ks = ks.transpose(0, 1).unsqueeze(0)
            vs = vs.transpose(0, 1).unsqueeze(0)
            mask = _offset_causal_mask(n, c, q.device)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                               enable_gqa=gqa)
        out[s:s + n] = o.squeeze(0).transpose(0, 1)
    return out


def _offset_causal_mask(query_len: int, context_len: int, device: torch.device) -> torch.Tensor:
    """Query i (the (context_len - query_len + i)-th token) sees keys 0..its own position."""
    q_pos = torch.arange(context_len - query_len, context_len, device=device).unsqueeze(1)
    k_pos = torch.arange(context_len, device=device).unsqueeze(0)
    return k_pos <= q_pos
