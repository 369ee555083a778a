"""AttentionMetadata: one step's description of where its tokens go in the KV cache and
what each query attends to, read by every attention path.

Its own module because both sides need it: attention.py's paged_attention reads it and
dispatches to a backend, and the backends build it (flex_paged.graph_metadata for a
captured decode batch, engine.executor's step inputs for every step). Here it depends on
neither, so attention.py may import its backends and they may import it without a
circle (tests/test_import_graph.py). Importable from engine.model.layers.attention too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch


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
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each query attends to.

    The batch holds the num_decodes single-token queries first, then the prefills.
    With native_attention, block_tables / seq_lens / query_start describe every
    sequence of the batch; on the torch path block_tables / seq_lens cover the decodes
    and prefills the rest.
    """

    slot_mapping: torch.Tensor  # [T] int64 flat slot index (block * block_size + offset)
    num_decodes: int
    block_tables: torch.Tensor | None  # [S, max_blocks] int64
    seq_lens: torch.Tensor | None  # [S] int64 context length after this step
    decode_bias: torch.Tensor | None = None  # [D, max_blocks * block_size] 0 or -inf (torch)
    prefills: list[PrefillGroup] = field(default_factory=list)  # torch path
    query_start: torch.Tensor | None = None  # [S + 1] int64 row offsets (native path)
    native_attention: Callable | None = None  # compiled CPU kernel (engine.model.kernels), if any
    slot_blocks: torch.Tensor | None = None  # [T] slot_mapping // block_size
    slot_offsets: torch.Tensor | None = None  # [T] slot_mapping % block_size
    # FlexAttention (CUDA): the step's calls (engine.model.layers.flex_paged)
    flex: Callable | None = None  # a FlexPagedAttention
    flex_groups: list = field(default_factory=list)  # its FlexGroups: decodes, prefills
    slot_pos: torch.Tensor | None = None  # [slots] int32 each cache slot's position
    # Triton (engine.model.layers.triton_paged): the backend and this step's launches
    triton: Any = None  # a TritonPagedAttention
    triton_step: Any = None  # its TritonStep
    state: Any = None  # a hybrid's Mamba states (engine.model.layers.mamba.StateMetadata)
    # several KV groups: each group's metadata (this one first), picked per layer
    groups: list | None = None
    # every token is a generated one (decodes, and verified proposals: engine/spec_decode),
    # none a prompt's: the linears and the LM head take the decode path's products
    generated_only: bool = False
    _window_bias: dict = field(default_factory=dict)  # window -> decode bias (torch)

    def decode_bias_for(self, window: int) -> torch.Tensor:
        """The torch path's decode bias for a layer with this sliding window (0: none):
        keys before each row's window masked too, made once a step per window."""
        if not window:
            return self.decode_bias
        bias = self._window_bias.get(window)
        if bias is None:
            span = torch.arange(self.decode_bias.shape[1], device=self.decode_bias.device)
            first = (self.seq_lens - window).unsqueeze(1)
            bias = self.decode_bias.masked_fill(span.unsqueeze(0) < first, float("-inf"))
            self._window_bias[window] = bias
        return bias


__all__ = ["AttentionMetadata", "PrefillGroup"]
