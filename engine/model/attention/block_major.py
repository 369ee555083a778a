"""The block-major KV cache of the CPU backends (native and torch).

Per layer one tensor [num_blocks, 2, KVH, block_size, D]: a block holds the keys and
values of all its kv heads in one contiguous span, so reading a sequence's context
touches few, large pieces of memory (decode attention is bound by memory; scattered
2 KiB per-head pieces read ~25% slower than 12 KiB blocks). Keys store each block
transposed, [D, block_size] per head, so a block's scores are block_size-wide vector
operations in the CPU kernel. The kernel and the torch path see strided views: keys
[KVH, num_blocks, D, block_size], values [KVH, num_blocks, block_size, D].
"""
from __future__ import annotations

import torch


def cache_shape(slots: int, num_blocks: int, kv_heads: int, block_size: int,
                head_dim: int) -> tuple[int, ...]:
    """The whole pool: [slots, num_blocks, 2, KVH, block_size, D]."""
    return (slots, num_blocks, 2, kv_heads, block_size, head_dim)


def cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's cache [num_blocks, 2, KVH, bs, D] as strided views: keys [KVH,
    num_blocks, D, bs] (blocks stored transposed) and values [KVH, num_blocks, bs, D]."""
    num_blocks, _, kv_heads, block_size, head_dim = kv_cache.shape
    keys = kv_cache[:, 0].view(num_blocks, kv_heads, head_dim, block_size)
    return keys.transpose(0, 1), kv_cache[:, 1].transpose(0, 1)


def gather_keys(k_cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[KVH, num_blocks, D, bs] -> [KVH, len(block_table) * bs, D] for one sequence."""
    kv_heads, _, d, bs = k_cache.shape
    return k_cache[:, block_table].transpose(2, 3).reshape(kv_heads, -1, d)


def gather_values(v_cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[KVH, num_blocks, bs, D] -> [KVH, len(block_table) * bs, D] for one sequence."""
    kv_heads, _, bs, d = v_cache.shape
    return v_cache[:, block_table].view(kv_heads, -1, d)


def padded_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """Block tables padded with block 0 to the longest (the kernels stop at seq_lens)."""
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    return torch.tensor(padded, dtype=torch.long, device=device)


__all__ = ["cache_shape", "cache_views", "gather_keys", "gather_values", "padded_tables"]


class BlockMajorCache:
    """The cache methods of a backend over this layout (native and torch share them);
    mixed in before AttentionBackend, whose `spec` and `block_size` they read."""

    def cache_shape(self, slots: int, num_blocks: int) -> tuple[int, ...]:
        return cache_shape(slots, num_blocks, self.spec.num_kv_heads, self.block_size,
                           self.spec.head_dim)

    def cache_views(self, layer_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return cache_views(layer_cache)

