"""attention_backend flex: PyTorch's FlexAttention over the head-major cache
(engine/model/layers/flex_paged.py holds the cache layout, the BlockMask groups and the
compiled calls; this module is the backend the engine asks).

What it keeps beside the cache: slot_pos, each cache slot's position in its sequence,
which every step writes for the pages it writes into (prepare_step) and FlexAttention's
mask reads. Decodes are padded to the captured batch sizes on CUDA (static shapes for
the split-KV decoding kernel), and its decode steps replay CUDA graphs.

It refuses attention sinks, sliding windows and an fp8 cache (its score and value
products would need the whole cache widened), and on CUDA blocks under 16 tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.executor.cuda_graphs import padded_size
from engine.model.attention.base import (
    AttentionBackend,
    AttentionLayer,
    AttentionMetadata,
    AttentionSpec,
    GraphMetadata,
)
from engine.model.layers import flex_paged
from engine.model.layers.flex_paged import FlexGroup, FlexPagedAttention, build_group

if TYPE_CHECKING:
    from engine.model.layers.rotary import Rope


@dataclass
class FlexMetadata(AttentionMetadata):
    """The step's FlexAttention calls: the decodes' group, then the prefills'."""

    calls: list[FlexGroup] = field(default_factory=list)
    slot_pos: torch.Tensor | None = None  # [slots] int32 each cache slot's position


class FlexBackend(AttentionBackend):
    name = "flex"
    graphs = True

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        self.flex = FlexPagedAttention(spec.device.type == "cuda", spec.block_size)
        self.slot_pos: torch.Tensor | None = None
        self.num_blocks = 0

    @classmethod
    def refuses(cls, spec: AttentionSpec) -> str | None:
        if spec.shape.attention_sinks:
            return ("attention_backend 'flex' does not serve attention sinks "
                    f"({spec.shape.architecture}); use triton, native (CPU) or torch")
        if any(spec.shape.layer_windows):
            return ("attention_backend 'flex' does not serve sliding-window layers "
                    f"({spec.shape.architecture}); use triton, native or torch")
        return None

    @classmethod
    def refuses_cache(cls, spec: AttentionSpec) -> str | None:
        if spec.kv_cache_dtype != "auto":
            return (f"kv_cache_dtype {spec.kv_cache_dtype!r} is not read by attention "
                    "backend 'flex'; the native (CPU), triton and torch backends read it (use "
                    "attention_backend triton, or kv_cache_dtype auto)")
        if spec.device.type == "cuda" and spec.block_size < 16:
            return (f"block_size {spec.block_size} is too small for FlexAttention on CUDA "
                    "(one page per KV tile; its kernels' tiles hold 16 keys at least)")
        return None

    # ---- the KV cache: head-major, a scratch block last --------------------------------
    def cache_shape(self, slots: int, num_blocks: int) -> tuple[int, ...]:
        return flex_paged.cache_shape(slots, num_blocks, self.spec.num_kv_heads,
                                      self.block_size, self.spec.head_dim)

    def cache_views(self, layer_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return flex_paged.cache_views(layer_cache)

    def cache_allocated(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.slot_pos = torch.full(((num_blocks + 1) * self.block_size,),
                                   torch.iinfo(torch.int32).max, dtype=torch.int32,
                                   device=self.device)

    def cache_freed(self) -> None:
        self.slot_pos = None

    def max_blocks(self) -> int | None:
        """torch 2.11's FlexAttention kernels index one layer's keys with 32-bit offsets
        (a larger cache failed to compile on the H200)."""
        if self.device.type != "cuda":
            return None
        return (2 ** 31 - 1) // (self.spec.num_kv_heads * self.spec.head_dim
                                 * self.block_size) - 1

    # ---- a step -----------------------------------------------------------------------
    def build_metadata(self, query_lens: list[int], seq_lens: list[int],
                       tables: list[list[int]], slot_mapping: torch.Tensor,
                       num_decodes: int) -> FlexMetadata:
        """The decodes in one FlexAttention call, then each prefill chunk in its own on
        CUDA (FlexPagedAttention), all chunks in one on the eager reference."""
        groups = []
        count = len(query_lens)
        decode_rows = decode_width = 0
        if self.flex.pad_decodes and num_decodes:  # a few static shapes (FlexPagedAttention)
            decode_rows = padded_size(self.spec.decode_sizes, num_decodes)
            decode_width = self.spec.max_pages
        spans = [(0, num_decodes)]
        if self.device.type == "cuda":
            spans += [(i, i + 1) for i in range(num_decodes, count)]
        else:
            spans.append((num_decodes, count))
        first = 0
        for lo, hi in spans:
            if hi > lo:
                decodes = lo == 0 and num_decodes > 0
                groups.append(build_group(first, query_lens[lo:hi], seq_lens[lo:hi],
                                          tables[lo:hi], self.num_blocks,
                                          self.block_size, self.device,
                                          decode_width if decodes else None,
                                          page_map=not self.flex.compiled,
                                          pad_rows=decode_rows if decodes else 0))
                first += groups[-1].num_tokens
        return FlexMetadata(slot_mapping, num_decodes, groups, self.slot_pos, backend=self)

    def prepare_step(self, meta: AttentionMetadata, positions: torch.Tensor) -> None:
        """The positions of the pages this step writes (flex_paged.write_positions)."""
        flex_paged.write_positions(self.slot_pos, meta.slot_mapping, positions,
                                   self.block_size)

    def graph_metadata(self) -> GraphMetadata:
        """A captured decode batch's metadata for the compiled FlexPagedAttention: graphs
        exist on CUDA only, so no page map."""
        slot_pos, block_size = self.slot_pos, self.block_size

        def metadata(size: int, positions: torch.Tensor, slots: torch.Tensor,
                     lengths: torch.Tensor, tables: torch.Tensor) -> FlexMetadata:
            flex_paged.write_positions(slot_pos, slots, positions, block_size)
            pages = (lengths + block_size - 1) // block_size
            group = FlexGroup(0, size, size, 1, None, positions[:, None].to(torch.int32), None,
                              pages.to(torch.int32)[:, None, None],
                              tables.to(torch.int32).contiguous()[:, None, None, :])
            return FlexMetadata(slots, size, [group], slot_pos, backend=self)

        return metadata

    def forward(self, layer: AttentionLayer, qkv: torch.Tensor, rope: Rope,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: FlexMetadata) -> torch.Tensor:
        q, k, v = layer.rotated(qkv, rope)
        k_cache, v_cache = kv_cache
        flex_paged.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = self.flex(q, k, v, k_cache, v_cache, meta.slot_pos, meta.calls, layer.scale)
        return out.reshape(qkv.shape[0], layer.num_heads * layer.head_dim)


__all__ = ["FlexBackend", "FlexMetadata"]
