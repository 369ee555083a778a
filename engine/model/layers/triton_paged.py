"""Paged attention through the Triton kernels (engine.model.triton_kernels): the launches
of attention_backend triton (engine/model/attention/triton.py, the backend the engine
asks, calls these).

Per layer and step: one launch rotates q and k and writes k and v into the cache
(rope_write_kv), one attends the decodes (all of them, GQA-packed, split-KV with a
reduce launch when there are too few sequences to fill the GPU) and one attends every
prefill chunk, fresh or after cached context (chunked prefill, prefix-cache hits).

The cache is FlexAttention's head-major layout with its scratch block
(flex_paged.cache_shape): a captured decode batch's padding rows write their keys there
and attend to nothing. Unlike FlexAttention the kernels take the batch size at run
time, so eager steps need no padding and nothing compiles per batch size.

step() turns a step's lists into launches with one host-to-device copy; graph_step()
builds the same from a CUDA graph's static input buffers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.layers.rotary import Rope
from engine.model.triton_kernels.fused_ops import rope_write_kv
from engine.model.triton_kernels.paged_attention import (
    MAX_SPLITS,
    AttentionLaunch,
    SplitScratch,
    attend,
)

# Keys a program reads per iteration. 64 keys x 128 dims x 2 bytes = 16 KiB of K and of V.
BLOCK_N = 64
# Rows (queries x packed query heads) of a prefill tile.
PREFILL_ROWS = 64
# Programs that keep a device busy, per streaming multiprocessor: split-KV cuts decodes
# into segments until a launch has about this many programs per SM.
PROGRAMS_PER_SM = 4
# Stand-in SM count under the interpreter, small so that CPU tests exercise split-KV.
_INTERPRETER_SMS = 2
_ALIGN = 4  # int32s: 16 bytes, the pointer alignment Triton specializes on


@dataclass
class TritonStep:
    """A step's attention launches: the decodes' (query tiles of one token) and the
    prefill chunks' (tiles of several queries), either may be absent."""

    decode: AttentionLaunch | None
    prefill: AttentionLaunch | None

    def launches(self) -> list[AttentionLaunch]:
        return [launch for launch in (self.decode, self.prefill) if launch is not None]


def cache_views(layer_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's [2, KVH, slots, D] as the kernels' keys and values [KVH, slots, D]."""
    return layer_cache[0], layer_cache[1]


class TritonPagedAttention:
    """The Triton backend of one runner: launch shapes, the split-KV scratch and the
    per-layer call."""

    def __init__(self, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 max_decode_rows: int, device: torch.device,
                 sm_count: int | None = None) -> None:
        """max_decode_rows: the largest decode batch (max_num_seqs); sm_count: the
        device's streaming multiprocessors (default: read from the device)."""
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        group = num_heads // num_kv_heads
        self.prefill_block_q = max(1, PREFILL_ROWS // (1 << (group - 1).bit_length()))
        self.device = device
        sms = sm_count or (torch.cuda.get_device_properties(device).multi_processor_count
                           if device.type == "cuda" else _INTERPRETER_SMS)
        self.busy_programs = sms * PROGRAMS_PER_SM
        # only a batch too small to fill the device splits: the scratch holds those rows
        self.split_rows = min(max_decode_rows, -(-self.busy_programs // num_kv_heads))
        self.scratch = SplitScratch.allocate(self.split_rows, num_heads, head_dim, device)
        self._rows = torch.arange(max_decode_rows + 1, dtype=torch.int32, device=device)
        self._zeros = torch.zeros(max_decode_rows, dtype=torch.int32, device=device)

    def num_splits(self, rows: int, longest: int) -> int:
        """Split-KV segments for rows decodes whose longest context is `longest` keys:
        enough programs to fill the device, no more segments than key tiles; a batch
        that fills the device alone gets none. Rounded down to a power of two (1, 2, 4,
        8, 16), since each count is its own compiled kernel."""
        if rows > self.split_rows:
            return 1
        programs = rows * self.num_kv_heads
        wanted = -(-self.busy_programs // programs)
        splits = max(1, min(MAX_SPLITS, wanted, -(-longest // BLOCK_N)))
        return 1 << (splits.bit_length() - 1)  # a power of two: few kernel variants

    def step(self, query_lens: list[int], seq_lens: list[int],
             block_tables: list[list[int]], num_decodes: int) -> TritonStep:
        """The launches for a step whose first num_decodes sequences decode one token.
        All their integer arrays travel in one int32 tensor, one host-to-device copy."""
        parts: list[list[int]] = []
        layout: list[tuple[str, int, tuple[int, ...]]] = []

        def add(name: str, values: list[int], shape: tuple[int, ...]) -> None:
            # each array starts 16 bytes in: Triton specializes a kernel on its pointers'
            # alignment, and arrays at varying offsets would compile variants mid-serving
            layout.append((name, len(values), shape))
            parts.append(values + [0] * (-len(values) % _ALIGN))

        count = len(query_lens)
        specs = []
        if num_decodes:
            specs.append(("decode", 0, num_decodes, 1))
        if count > num_decodes:
            specs.append(("prefill", num_decodes, count, self.prefill_block_q))
        first = 0
        for name, lo, hi, block_q in specs:
            tiles = [(s, j) for s in range(hi - lo)
                     for j in range(0, query_lens[lo + s], block_q)]
            starts = [first]
            for n in query_lens[lo:hi]:
                starts.append(starts[-1] + n)
            first = starts[-1]
            width = max(len(t) for t in block_tables[lo:hi])
            table = [p for t in block_tables[lo:hi] for p in t + [0] * (width - len(t))]
            add(name + ".tile_seq", [s for s, _ in tiles], (len(tiles),))
            add(name + ".tile_q", [j for _, j in tiles], (len(tiles),))
            add(name + ".query_start", starts, (hi - lo + 1,))
            add(name + ".seq_lens", seq_lens[lo:hi], (hi - lo,))
            add(name + ".tables", table, (hi - lo, width))
        flat = torch.tensor([v for part in parts for v in part], dtype=torch.int32)
        flat = flat.to(self.device, non_blocking=True)
        arrays, at = {}, 0
        for name, size, shape in layout:
            arrays[name] = flat[at:at + size].view(shape)
            at += size + (-size % _ALIGN)
        launches: dict[str, AttentionLaunch | None] = {"decode": None, "prefill": None}
        for name, lo, hi, block_q in specs:
            splits = 1
            if name == "decode":
                splits = self.num_splits(hi - lo, max(seq_lens[lo:hi]))
            launches[name] = AttentionLaunch(
                arrays[name + ".tile_seq"], arrays[name + ".tile_q"],
                arrays[name + ".query_start"], arrays[name + ".seq_lens"],
                arrays[name + ".tables"], block_q, splits)
        return TritonStep(launches["decode"], launches["prefill"])

    def graph_step(self, size: int, seq_lens: torch.Tensor, tables: torch.Tensor) -> TritonStep:
        """A captured decode batch of `size` rows from the graph's static buffers; its
        split count is fixed by the size and the tables' width (the longest context the
        graph may see), so every replay runs the captured grid."""
        splits = self.num_splits(size, tables.shape[1] * self.block_size)
        launch = AttentionLaunch(self._rows[:size], self._zeros[:size], self._rows[:size + 1],
                                 seq_lens, tables, 1, splits)
        return TritonStep(launch, None)

    def forward(self, qkv: torch.Tensor, rope: Rope, kv_cache: tuple[torch.Tensor, torch.Tensor],
                slot_mapping: torch.Tensor, step: TritonStep, num_heads: int,
                num_kv_heads: int, head_dim: int, scale: float, k_scale: float = 1.0,
                v_scale: float = 1.0, window: int = 0,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """One layer: qkv [T, (H + 2 KVH) * D] (rotated in place) -> attention [T, H * D].
        k_scale, v_scale: an e4m3 cache's per-layer scales (constants of a captured
        graph, as they are of the layer); window: its sliding window (0: none); sinks:
        its heads' attention sinks (float32 [H]), or None."""
        k_cache, v_cache = kv_cache
        rope_write_kv(qkv, rope.positions, rope.cos_table, rope.sin_table, num_heads,
                      num_kv_heads, head_dim, k_cache, v_cache, slot_mapping, k_scale,
                      v_scale)
        t = qkv.shape[0]
        q = qkv[:, :num_heads * head_dim].view(t, num_heads, head_dim)
        out = qkv.new_empty(t, num_heads, head_dim)
        for launch in step.launches():
            attend(q, k_cache, v_cache, out, launch, scale, self.block_size, BLOCK_N,
                   self.scratch, k_scale, v_scale, window, sinks)
        return out.view(t, num_heads * head_dim)
