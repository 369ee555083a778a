"""Paged attention over the block-structured KV cache.

Cache layout per layer: one tensor [num_blocks, 2, KVH, block_size, D]: a block
holds the keys and values of all its kv heads in one contiguous span, so reading a
sequence's context touches few, large pieces of memory (decode attention is bound
by memory; scattered 2 KiB per-head pieces read ~25% slower than 12 KiB blocks).
Keys store each block transposed, [D, block_size] per head, so a block's scores are
block_size-wide vector operations in the CPU kernel. The kernels and the torch path
see strided views: keys [KVH, num_blocks, D, block_size], values [KVH, num_blocks,
block_size, D].

Every step first writes the new keys/values of all scheduled tokens into their
cache slots, then computes attention. Because the writes of a layer precede its
reads, a request may read blocks that another request fills in the same step
(prefix-cache hits on blocks scheduled in the same batch stay correct).

- On CPU with the compiled kernels (engine/model/kernels), one call writes the step's keys
  and values and attends every row of the step, decodes and prefill chunks alike,
  reading the cache in place with a causal limit per row (a 64-token prefill spent
  4x longer in SDPA).
- On CUDA, FlexAttention over its own cache layout (engine/model/layers/flex_paged.py),
  or the Triton kernels over the same layout (engine/model/layers/triton_paged.py; the
  layer hands them its fused qkv: rotary, cache write and attention in their launches).
- Otherwise (attention_backend torch, or CPU kernels off) with torch ops: single-token
  queries are batched: their blocks are gathered and attended with two batched matmuls
  and a masked softmax. Prefill chunks without cached context attend to their fresh k/v;
  consecutive chunks of equal length share one SDPA call. Prefill chunks with cached
  context (chunked prefill, prefix-cache hits) gather their blocks and use SDPA with
  an offset causal mask.

Sliding windows (a layer's `window` > 0): a query at position p sees keys
p - window + 1 .. p. The kernels start each row at the block of its first visible key;
the torch path masks. Blocks wholly before every window may have been freed by the KV
cache manager: their table entries then name its null block, which is never read (the
kernels) or only read masked (the torch path: the null block holds zeros, never NaN).

Attention sinks (gpt-oss; `sinks`: a float32 logit per query head): each softmax's
denominator gains exp(sink) as if from a key with no value. The native kernel adds it
to its sums; the torch path appends it as a score column (its prefill then scores
explicitly instead of calling SDPA).

kv_cache_dtype fp8: the cache holds keys / k_scale and values / v_scale in e4m3 (the
layer's scales); every path reads them widened to the activation dtype, with the
scales applied to the scores and the output.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.layers import flex_paged
from engine.model.layers.attention_metadata import AttentionMetadata, PrefillGroup
from engine.quant.fp8 import to_e4m3


def cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's cache [num_blocks, 2, KVH, bs, D] as strided views: keys [KVH,
    num_blocks, D, bs] (blocks stored transposed) and values [KVH, num_blocks, bs, D]."""
    num_blocks, _, kv_heads, block_size, head_dim = kv_cache.shape
    keys = kv_cache[:, 0].view(num_blocks, kv_heads, head_dim, block_size)
    return keys.transpose(0, 1), kv_cache[:, 1].transpose(0, 1)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """Store this step's keys [T, KVH, D] and values into their slots (torch path; the
    native kernel writes them itself)."""
    k_cache.permute(1, 3, 0, 2)[meta.slot_blocks, meta.slot_offsets] = k
    v_cache.permute(1, 2, 0, 3)[meta.slot_blocks, meta.slot_offsets] = v


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                    scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                    window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D]; kv_cache: this layer's (keys, values) views
    (cache_views); k_scale, v_scale: an fp8 cache's, which holds k / k_scale and
    v / v_scale in e4m3 (not FlexAttention's: the runner refuses fp8 with it);
    window: the layer's sliding window (0: none; not FlexAttention's either); sinks: its
    attention sinks [H] (not FlexAttention's or Triton's: the runner refuses them).

    Returns the attention output [T, H, D].
    """
    k_cache, v_cache = kv_cache
    if meta.flex is not None:
        flex_paged.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return meta.flex(q, k, v, k_cache, v_cache, meta.slot_pos, meta.flex_groups, scale)
    if meta.native_attention is not None:
        return meta.native_attention(q, k, v, k_cache, v_cache, meta.slot_mapping,
                                     meta.block_tables, meta.seq_lens, meta.query_start, scale,
                                     k_scale, v_scale, window, sinks)
    if k_cache.dtype == torch.float8_e4m3fn:
        # every key and value attended is the cache's (fresh ones too, as the kernels
        # read them back): e4m3 widens exactly to q's dtype, and the scales fold into
        # the score scale and the output (in bf16 / fp16 the output is rounded before
        # v_scale multiplies it, where the kernels scale it in float32: a last-bit
        # difference)
        k, v = to_e4m3(k, k_scale), to_e4m3(v, v_scale)
        out = _torch_attention(q, k, v, k_cache, v_cache, meta, scale * k_scale, window, sinks)
        return out.mul_(v_scale) if v_scale != 1.0 else out
    return _torch_attention(q, k, v, k_cache, v_cache, meta, scale, window, sinks)


def _torch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, window: int = 0,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The torch path: k, v in the cache's dtype, widened to q's where they are read."""
    write_kv(k, v, k_cache, v_cache, meta)
    if meta.num_decodes == q.shape[0]:
        return _decode_attention(q, k_cache, v_cache, meta, scale, window, sinks)
    out = torch.empty_like(q)
    if meta.num_decodes:
        out[:meta.num_decodes] = _decode_attention(q[:meta.num_decodes], k_cache, v_cache,
                                                   meta, scale, window, sinks)
    gqa = q.shape[1] != k.shape[1]
    for g in meta.prefills:
        s, n, b = g.start, g.query_len, g.count
        e = s + n * b
        qs = q[s:e].view(b, n, *q.shape[1:]).transpose(1, 2)  # [B, H, n, D]
        if g.block_table is None:
            ks = k[s:e].view(b, n, *k.shape[1:]).transpose(1, 2).to(q.dtype)
            vs = v[s:e].view(b, n, *v.shape[1:]).transpose(1, 2).to(q.dtype)
            if sinks is not None:
                o = _sink_attention(qs, ks, vs, _offset_causal_mask(n, n, q.device, window),
                                    scale, sinks)
            elif window and window < n:
                o = F.scaled_dot_product_attention(
                    qs, ks, vs, attn_mask=_offset_causal_mask(n, n, q.device, window),
                    scale=scale, enable_gqa=gqa)
            else:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                   enable_gqa=gqa)
        else:
            c = g.context_len
            ks = gather_keys(k_cache, g.block_table)[:, :c].unsqueeze(0).to(q.dtype)
            vs = gather_values(v_cache, g.block_table)[:, :c].unsqueeze(0).to(q.dtype)
            mask = _offset_causal_mask(n, c, q.device, window)
            if sinks is not None:
                o = _sink_attention(qs, ks, vs, mask, scale, sinks)
            else:
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                                   enable_gqa=gqa)
        out[s:e] = o.transpose(1, 2).reshape(e - s, *q.shape[1:])
    return out


def gather_keys(k_cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[KVH, num_blocks, D, bs] -> [KVH, len(block_table) * bs, D] for one sequence."""
    kv_heads, _, d, bs = k_cache.shape
    return k_cache[:, block_table].transpose(2, 3).reshape(kv_heads, -1, d)


def gather_values(v_cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[KVH, num_blocks, bs, D] -> [KVH, len(block_table) * bs, D] for one sequence."""
    kv_heads, _, bs, d = v_cache.shape
    return v_cache[:, block_table].view(kv_heads, -1, d)


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, window: int = 0,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [S, H, D]; k_cache: [KVH, num_blocks, D, bs]; v_cache: [KVH, num_blocks, bs, D]."""
    d_reqs, heads, head_dim = q.shape
    kv_heads, _, _, bs = k_cache.shape
    group = heads // kv_heads
    tables = meta.block_tables
    ctx = tables.shape[1] * bs
    # keys^T: [KVH, S, blocks, D, bs] -> [KVH * S, D, ctx]; values: [KVH * S, ctx, D]
    keys_t = k_cache[:, tables].permute(0, 1, 3, 2, 4).reshape(
        kv_heads * d_reqs, head_dim, ctx).to(q.dtype)
    values = v_cache[:, tables].view(kv_heads * d_reqs, ctx, head_dim).to(q.dtype)
    qg = q.view(d_reqs, kv_heads, group, head_dim).transpose(0, 1).reshape(
        kv_heads * d_reqs, group, head_dim)
    scores = torch.bmm(qg, keys_t).float()  # [KVH * S, group, ctx]
    scores = scores.view(kv_heads, d_reqs, group, ctx).mul_(scale)
    scores.add_(meta.decode_bias_for(window)[None, :, None, :])
    if sinks is not None:  # one more column per head: the sink, with no value
        sink = sinks.float().view(kv_heads, 1, group, 1).expand(-1, d_reqs, -1, -1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :ctx].to(q.dtype).reshape(
        kv_heads * d_reqs, group, ctx)
    out = torch.bmm(probs, values)  # [KVH * S, group, D]
    return out.view(kv_heads, d_reqs, group, head_dim).transpose(0, 1).reshape(
        d_reqs, heads, head_dim)


def _sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """q [B, H, n, D] over k, v [B, KVH, c, D] where mask [n, c] allows, each head's
    softmax with its sink as one more score (a key with no value)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return probs.to(q.dtype) @ v.to(q.dtype)


def _offset_causal_mask(query_len: int, context_len: int, device: torch.device,
                        window: int = 0) -> torch.Tensor:
    """Query i (the (context_len - query_len + i)-th token) sees keys 0..its own position,
    or only the last `window` of them."""
    q_pos = torch.arange(context_len - query_len, context_len, device=device).unsqueeze(1)
    k_pos = torch.arange(context_len, device=device).unsqueeze(0)
    if window:
        return (k_pos <= q_pos) & (k_pos > q_pos - window)
    return k_pos <= q_pos


# AttentionMetadata and PrefillGroup live in attention_metadata (flex_paged builds the
# former too) and stay importable from here, where the model families and the executor
# take them
__all__ = ["AttentionMetadata", "PrefillGroup", "cache_views", "gather_keys", "gather_values",
           "paged_attention", "write_kv"]
