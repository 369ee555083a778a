"""The adapters resident on the device, and the batched low-rank products of a step.

Each fused layer of each decoder layer has one stack of A^T and one of B^T with a
row per slot (max_loras). A step's tokens are ordered so that each adapter's tokens
are contiguous (ModelRunner.prepare); `segments` lists those runs as (start, end,
slot). After a layer's base matmul over the whole batch, add() adds
(x[s:e] @ A^T) @ B^T for each run: one pair of small matmuls per adapter run, no
merged weights, no per-request work. Base-model tokens are in no run.
"""
from __future__ import annotations

import torch

from engine.lora.adapter import FUSED_SUBS, LoRAAdapter


class LoRASlots:
    def __init__(self, shape, plan, max_loras: int, max_rank: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        from engine.lora.adapter import _Layout
        layout = _Layout(shape, plan)
        self.max_loras = max_loras
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        for layer in range(shape.num_layers):
            for fused, subs in FUSED_SUBS.items():
                if fused in ("gate_up_proj", "down_proj") and shape.is_sparse(layer):
                    continue  # a mixture of experts: adapters never reach it
                width = subs * max_rank
                self.a[(layer, fused)] = torch.zeros(
                    max_loras, layout.in_size(fused), width, dtype=dtype, device=device)
                self.b[(layer, fused)] = torch.zeros(
                    max_loras, width, layout.out_size(fused), dtype=dtype, device=device)
        # (layer, fused) -> slots whose adapter targets it (others add nothing)
        self.targets: dict[tuple[int, str], set[int]] = {k: set() for k in self.a}
        self.loaded: list[str | None] = [None] * max_loras  # adapter key per slot
        self.segments: list[tuple[int, int, int]] = []  # this step's (start, end, slot)

    def load(self, slot: int, key: str, adapter: LoRAAdapter) -> None:
        """Put an adapter in a slot (overwriting what was there)."""
        for k in self.a:
            weights = adapter.weights.get(k)
            if weights is None:
                self.targets[k].discard(slot)
                self.a[k][slot].zero_()
                self.b[k][slot].zero_()
                continue
            self.a[k][slot].copy_(weights[0])
            self.b[k][slot].copy_(weights[1])
            self.targets[k].add(slot)
        self.loaded[slot] = key

    def add(self, layer: int, fused: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += this step's low-rank products of x, for each adapter run."""
        if not self.segments:
            return
        key = (layer, fused)
        targeted = self.targets[key]
        a, b = self.a[key], self.b[key]
        for start, end, slot in self.segments:
            if slot in targeted:
                y[start:end].addmm_(torch.mm(x[start:end], a[slot]), b[slot])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))
