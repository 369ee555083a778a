"""attention_backend triton: the Triton kernels (engine/model/triton_kernels) over the
head-major cache FlexAttention uses (flex_paged.cache_shape, a scratch block last);
engine/model/layers/triton_paged.py turns a step into the kernels' launches.

Its forward takes the layer's fused qkv rows: one launch rotates q and k and writes k
and v into the cache, then the decodes' and the prefills' attention launches. Its
kernels run the layers' element-wise work too (TritonLayerOps) and the int4 linears
(TritonHolder), and its decode steps replay CUDA graphs. On CPU it runs only under
Triton's interpreter (tests).

This module imports no triton at load (the registry lists every backend; triton is
optional on CPU): the kernels' modules are imported when the backend is built.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.model.attention.base import (
    AttentionBackend,
    AttentionLayer,
    AttentionMetadata,
    AttentionSpec,
    GraphMetadata,
)
from engine.model.layers import flex_paged
from engine.model.triton_kernels import availability, fp8_cache_refusal

if TYPE_CHECKING:
    from engine.model.layers.rotary import Rope
    from engine.model.layers.triton_paged import TritonStep

# the runner's log, where its other load-time lines are
logger = logging.getLogger("engine.executor.model_runner")



@dataclass
class TritonMetadata(AttentionMetadata):
    """The step's attention launches (TritonStep: the decodes', the prefills')."""

    launches: TritonStep | None = None


class TritonBackend(AttentionBackend):
    name = "triton"
    graphs = True
    own_layer_kernels = True

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        from engine.model.layers.triton_paged import TritonPagedAttention
        self.paged = TritonPagedAttention(spec.block_size, spec.num_heads, spec.num_kv_heads,
                                          spec.head_dim, spec.decode_sizes[-1], spec.device)

    @classmethod
    def refuses(cls, spec: AttentionSpec) -> str | None:
        reason = availability(spec.device)
        return None if reason is None else f"attention_backend 'triton': {reason}"

    @classmethod
    def refuses_cache(cls, spec: AttentionSpec) -> str | None:
        if spec.kv_cache_dtype == "auto":
            return None
        reason = fp8_cache_refusal(spec.device)
        return None if reason is None else f"kv_cache_dtype {spec.kv_cache_dtype!r}: {reason}"

    # ---- the KV cache: FlexAttention's layout -----------------------------------------
    def cache_shape(self, slots: int, num_blocks: int) -> tuple[int, ...]:
        return flex_paged.cache_shape(slots, num_blocks, self.spec.num_kv_heads,
                                      self.block_size, self.spec.head_dim)

    def cache_views(self, layer_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from engine.model.layers.triton_paged import cache_views
        return cache_views(layer_cache)

    # ---- the layers' other kernels ------------------------------------------------------
    def layer_ops(self, kernels: Any) -> Any:
        from engine.model.triton_kernels.fused_ops import TritonLayerOps
        return TritonLayerOps()

    def weight_holder(self, fmt: str, dtype: torch.dtype) -> Any:
        from engine.model.triton_kernels.weight_holder import TritonHolder
        logger.info("%s weights on the Triton backend: Q4_1 blocks (AWQ and GPTQ are read "
                    "as such) are multiplied by the int4 kernel, fp8 weights by "
                    "torch._scaled_mm, the others decoded to %s at load", fmt, dtype)
        return TritonHolder(self.device)

    # ---- a step -----------------------------------------------------------------------
    def build_metadata(self, query_lens: list[int], seq_lens: list[int],
                       tables: list[list[int]], slot_mapping: torch.Tensor,
                       num_decodes: int) -> TritonMetadata:
        launches = self.paged.step(query_lens, seq_lens, tables, num_decodes)
        return TritonMetadata(slot_mapping, num_decodes, launches, backend=self)

    def graph_metadata(self) -> GraphMetadata:
        """A captured batch's launches read the graph's static buffers; the split count
        is fixed per batch size."""
        paged = self.paged

        def metadata(size: int, positions: torch.Tensor, slots: torch.Tensor,
                     lengths: torch.Tensor, tables: torch.Tensor) -> TritonMetadata:
            step = paged.graph_step(size, lengths, tables.contiguous())
            return TritonMetadata(slots, size, step, backend=self)

        return metadata

    def forward(self, layer: AttentionLayer, qkv: torch.Tensor, rope: Rope,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: TritonMetadata) -> torch.Tensor:
        """Rotary, cache write and attention in Triton, on the fused qkv rows (q/k norms
        applied first)."""
        return self.paged.forward(layer.normed_qkv(qkv), rope, kv_cache, meta.slot_mapping,
                                  meta.launches, layer.num_heads, layer.num_kv_heads,
                                  layer.head_dim, layer.scale, layer.k_scale, layer.v_scale,
                                  layer.window,
                                  None if layer.sinks is None else layer.sinks.float())


__all__ = ["TritonBackend", "TritonMetadata"]
