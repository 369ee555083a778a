"""attention_backend native: the compiled CPU kernel (engine/model/kernels,
paged_attention.cpp) over the block-major cache (block_major.py).

One call a layer writes the step's keys and values and attends every row of the step,
decodes and prefill chunks alike, reading the cache in place with a causal limit per
row (a 64-token prefill spent 4x longer in SDPA). The kernel adds a sliding window's
start and the sinks to its sums itself, and reads an fp8 cache. Its metadata (every
sequence's table, length and row offsets) is also what engine.model.stack's one call
for all layers reads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.model.attention import block_major
from engine.model.attention.base import (
    AttentionBackend,
    AttentionLayer,
    AttentionMetadata,
    AttentionSpec,
)

if TYPE_CHECKING:
    from engine.model.layers.rotary import Rope


@dataclass
class NativeMetadata(AttentionMetadata):
    """Every sequence of the batch, decodes and prefill chunks alike."""

    block_tables: torch.Tensor | None = None  # [S, max_blocks] int64
    seq_lens: torch.Tensor | None = None  # [S] int64 context length after this step
    query_start: torch.Tensor | None = None  # [S + 1] int64 row offsets


class NativeBackend(block_major.BlockMajorCache, AttentionBackend):
    name = "native"
    runs_stack = True
    lazy_cpu_pool = True

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        # read at each call: a test may wrap it (tests/test_kv_cache_fp8.py)
        self.kernel = spec.kernels.paged_attention

    @classmethod
    def refuses(cls, spec: AttentionSpec) -> str | None:
        if spec.kernels is None:
            return ("attention_backend 'native' needs the CPU kernels "
                    f"(device {spec.device}, kernels unavailable or off)")
        return None

    def build_metadata(self, query_lens: list[int], seq_lens: list[int],
                       tables: list[list[int]], slot_mapping: torch.Tensor,
                       num_decodes: int) -> NativeMetadata:
        """One kernel call for every row."""
        dev = self.device
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        return NativeMetadata(
            slot_mapping, num_decodes, block_major.padded_tables(tables, dev),
            torch.tensor(seq_lens, dtype=torch.long, device=dev),
            torch.tensor(starts, dtype=torch.long, device=dev), backend=self)

    def forward(self, layer: AttentionLayer, qkv: torch.Tensor, rope: Rope,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: NativeMetadata) -> torch.Tensor:
        q, k, v = layer.rotated(qkv, rope)
        k_cache, v_cache = kv_cache
        out = self.kernel(q, k, v, k_cache, v_cache, meta.slot_mapping, meta.block_tables,
                          meta.seq_lens, meta.query_start, layer.scale, layer.k_scale,
                          layer.v_scale, layer.window, layer.sinks)
        return out.reshape(qkv.shape[0], layer.num_heads * layer.head_dim)


__all__ = ["NativeBackend", "NativeMetadata"]
