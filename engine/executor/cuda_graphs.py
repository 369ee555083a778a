"""Decode steps replayed from CUDA graphs, one captured per batch-size bucket.

A decode step of a small model is hundreds of short kernels; launched one by one from
Python the GPU waits on the host between them. A captured graph launches them all at
once. Each graph reads its inputs from one static device buffer (one row per
sequence: token id, position, cache slot, context length, block table) that the step
fills with a single host-to-device copy from pinned memory (stored field-major, so
each field is one contiguous vector), and writes its hidden states to a static output.
A batch is padded to the next captured size: padding rows write their keys to the
cache's scratch block and read nothing.

What a graph holds on to (the weights, the KV cache, the buffers) must not move: the
runner drops the graphs before sleep frees either and captures again on waking.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import torch

from engine.model.attention.base import GraphMetadata

logger = logging.getLogger(__name__)

_COLUMNS = 4  # id, position, slot, context length; then the block table


def capture_sizes(max_batch: int) -> list[int]:
    """Batch sizes captured: 1, 2, 4, 8, then every 8 up to 64, every 32 up to 256, then
    every 64 (vLLM's are 1, 2, 4 and multiples of 8; fewer here, captured faster)."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(96, 257, 32))
    sizes += list(range(320, max(max_batch, 256) + 64, 64))
    chosen = [s for s in sizes if s < max_batch] + [max_batch]
    return sorted(set(chosen))


def padded_size(sizes: Sequence[int], batch: int) -> int:
    """The smallest of sizes (ascending) that holds batch rows."""
    return next(s for s in sizes if s >= batch)


class DecodeGraphs:
    def __init__(self, model: Callable, layer_caches: list, step_metadata: GraphMetadata,
                 num_blocks: int, block_size: int, sizes: list[int], width: int,
                 device: torch.device) -> None:
        """model(ids, positions, layer_caches, meta) -> hidden states; step_metadata: the
        attention backend's metadata for a captured batch (its graph_metadata());
        num_blocks: the cache's blocks (the scratch block is next); sizes: the batch
        sizes to capture (capture_sizes); width: the longest block table."""
        self.model = model
        self.layer_caches = layer_caches
        self.step_metadata = step_metadata
        self.block_size = block_size
        self.scratch = num_blocks
        self.width = width
        self.sizes = sizes
        rows, fields = self.sizes[-1], _COLUMNS + self.width
        self.host = torch.zeros(fields, rows, dtype=torch.int64).pin_memory()
        self.host_fields = self.host.numpy()
        self.inputs = torch.zeros(fields, rows, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pad(0, rows)
        self.inputs.copy_(self.host)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _pad(self, start: int, end: int) -> None:
        """Host rows [start, end) as padding: token 0 at position 0, written to the scratch
        block's first slot, no context, a table of scratch pages."""
        fields = self.host_fields[:, start:end]
        fields[:_COLUMNS] = [[0], [0], [self.scratch * self.block_size], [0]]
        fields[_COLUMNS:] = self.scratch

    def _forward(self, size: int) -> torch.Tensor:
        x = self.inputs[:, :size]
        ids, positions, slots, lengths = x[0], x[1], x[2], x[3]
        tables = x[_COLUMNS:].t()
        meta = self.step_metadata(size, positions, slots, lengths, tables)
        return self.model(ids, positions, self.layer_caches, meta)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, all in one memory pool."""
        start = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):
            for _ in range(2):  # compile and warm up outside the capture
                self._forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch 1..%d) in %.1fs", len(self.sizes),
                    self.max_batch, time.perf_counter() - start)

    def fits(self, batch: int, longest_table: int) -> bool:
        return batch <= self.max_batch and longest_table <= self.width

    def run(self, ids: list[int], positions: list[int], slots: list[int],
            seq_lens: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        """Replay the smallest graph that holds the batch: its hidden states [B, H]."""
        batch = len(ids)
        size = padded_size(self.sizes, batch)
        fields = self.host_fields
        self._pad(0, size)
        fields[0, :batch] = ids
        fields[1, :batch] = positions
        fields[2, :batch] = slots
        fields[3, :batch] = seq_lens
        for i, table in enumerate(block_tables):
            fields[_COLUMNS:_COLUMNS + len(table), i] = table
        self.inputs[:, :size].copy_(self.host[:, :size], non_blocking=True)
        graph, out = self.graphs[size]
        graph.replay()
        return out[:batch]
