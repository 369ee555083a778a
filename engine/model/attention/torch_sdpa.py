"""attention_backend torch: torch ops over the block-major cache (block_major.py), the
path wherever no compiled kernel serves (CPU kernels off, or chosen).

Single-token queries are batched: their blocks are gathered and attended with two
batched matmuls and a masked softmax. Prefill chunks without cached context attend to
their fresh k/v; consecutive chunks of equal length share one SDPA call. Prefill chunks
with cached context (chunked prefill, prefix-cache hits) gather their blocks and use
SDPA with an offset causal mask.

Sliding windows are masked. Sinks are appended as a score column (a prefill then
scores explicitly instead of calling SDPA). An fp8 cache's keys and values are widened
to q's dtype where they are read, its scales folded into the score scale and the
output.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.model.attention import block_major
from engine.model.attention.base import (
    AttentionBackend,
    AttentionLayer,
    AttentionMetadata,
)
from engine.model.attention.block_major import gather_keys, gather_values
from engine.quant.fp8 import to_e4m3

if TYPE_CHECKING:
    from engine.model.layers.rotary import Rope


@dataclass
class PrefillGroup:
    """Prefill chunks [start, start + count * query_len) of the batch, one after another.

    count > 1 only for chunks without cached context (context_len == query_len).
    """

    start: int
    query_len: int
    count: int
    context_len: int  # tokens in the cache after this step, queries included
    block_table: torch.Tensor | None  # [num_blocks] block ids; only when context > query


@dataclass
class TorchMetadata(AttentionMetadata):
    """block_tables / seq_lens / decode_bias cover the decodes, prefills the rest."""

    block_tables: torch.Tensor | None = None  # [D, max_blocks] int64
    seq_lens: torch.Tensor | None = None  # [D] int64 context length after this step
    decode_bias: torch.Tensor | None = None  # [D, max_blocks * block_size] 0 or -inf
    prefills: list[PrefillGroup] = field(default_factory=list)
    slot_blocks: torch.Tensor | None = None  # [T] slot_mapping // block_size
    slot_offsets: torch.Tensor | None = None  # [T] slot_mapping % block_size
    _window_bias: dict = field(default_factory=dict)  # window -> decode bias

    def decode_bias_for(self, window: int) -> torch.Tensor:
        """The decode bias for a layer with this sliding window (0: none): keys before
        each row's window masked too, made once a step per window."""
        if not window:
            return self.decode_bias
        bias = self._window_bias.get(window)
        if bias is None:
            span = torch.arange(self.decode_bias.shape[1], device=self.decode_bias.device)
            first = (self.seq_lens - window).unsqueeze(1)
            bias = self.decode_bias.masked_fill(span.unsqueeze(0) < first, float("-inf"))
            self._window_bias[window] = bias
        return bias


class TorchBackend(block_major.BlockMajorCache, AttentionBackend):
    name = "torch"
    lazy_cpu_pool = True

    def build_metadata(self, query_lens: list[int], seq_lens: list[int],
                       tables: list[list[int]], slot_mapping: torch.Tensor,
                       num_decodes: int) -> TorchMetadata:
        dev = self.device
        lens = bias = None
        if num_decodes:
            decode_tables = block_major.padded_tables(tables[:num_decodes], dev)
            lens = torch.tensor(seq_lens[:num_decodes], dtype=torch.long, device=dev)
            span = torch.arange(decode_tables.shape[1] * self.block_size, device=dev)
            bias = torch.zeros(num_decodes, decode_tables.shape[1] * self.block_size, device=dev)
            bias.masked_fill_(span.unsqueeze(0) >= lens.unsqueeze(1), float("-inf"))
        else:
            decode_tables = None
        return TorchMetadata(
            slot_mapping, num_decodes, decode_tables, lens, bias,
            prefill_groups(query_lens, seq_lens, tables, num_decodes, dev),
            slot_blocks=slot_mapping // self.block_size,
            slot_offsets=slot_mapping % self.block_size, backend=self)

    def forward(self, layer: AttentionLayer, qkv: torch.Tensor, rope: Rope,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: TorchMetadata) -> torch.Tensor:
        q, k, v = layer.rotated(qkv, rope)
        out = paged_attention(q, k, v, kv_cache, meta, layer.scale, layer.k_scale,
                              layer.v_scale, layer.window, layer.sinks)
        return out.reshape(qkv.shape[0], layer.num_heads * layer.head_dim)


def prefill_groups(query_lens: list[int], seq_lens: list[int], tables: list[list[int]],
                   num_decodes: int, device: torch.device) -> list[PrefillGroup]:
    """Consecutive fresh chunks (no cached context) of equal length share one group; a
    chunk with context carries its block table."""
    groups: list[PrefillGroup] = []
    first = num_decodes
    for i in range(num_decodes, len(query_lens)):
        n, ctx = query_lens[i], seq_lens[i]
        if ctx > n:
            table = torch.tensor(tables[i], dtype=torch.long, device=device)
            groups.append(PrefillGroup(first, n, 1, ctx, table))
        elif groups and groups[-1].block_table is None and groups[-1].query_len == n:
            groups[-1].count += 1
        else:
            groups.append(PrefillGroup(first, n, 1, n, None))
        first += n
    return groups


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: TorchMetadata) -> None:
    """Store this step's keys [T, KVH, D] and values into their slots (the native
    kernel writes them itself)."""
    k_cache.permute(1, 3, 0, 2)[meta.slot_blocks, meta.slot_offsets] = k
    v_cache.permute(1, 2, 0, 3)[meta.slot_blocks, meta.slot_offsets] = v


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    kv_cache: tuple[torch.Tensor, torch.Tensor], meta: TorchMetadata,
                    scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                    window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D]; kv_cache: this layer's (keys, values) views
    (block_major.cache_views); k_scale, v_scale: an fp8 cache's, which holds k / k_scale
    and v / v_scale in e4m3; window: the layer's sliding window (0: none); sinks: its
    attention sinks [H].

    Returns the attention output [T, H, D].
    """
    k_cache, v_cache = kv_cache
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
                     v_cache: torch.Tensor, meta: TorchMetadata,
                     scale: float, window: int = 0,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """k, v in the cache's dtype, widened to q's where they are read."""
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


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: TorchMetadata, scale: float, window: int = 0,
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


__all__ = ["PrefillGroup", "TorchBackend", "TorchMetadata", "paged_attention",
           "prefill_groups", "write_kv"]
