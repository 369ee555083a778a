"""Which layers share a block table: the KV cache groups of a model.

Most models have one group: every layer reads the same blocks, and a block of the pool
holds one token range of every layer. A model that mixes full-attention layers with
sliding-window ones (Gemma 3, gpt-oss) would then keep every block of every local
layer for as long as its global layers need them. So its layers are split into groups
of one kind each (a window, or none), every group of the same size P; a block of the
pool holds P layers' keys and values, and is owned by one group at a time. A request
keeps one block table per group: a local group's table gives back the blocks that slid
out of its window, while the global group's keeps them all. vLLM's hybrid allocator
does the same; with P the smallest kind's layer count, a kind whose count P does not
divide leaves its last group's unused slots empty (Gemma 3: 4 global and 22 local
layers make one global group and six local ones of 4, two slots unused).
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.model.shape import ModelShape


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int, ...]  # each group's window (0: full attention); full first
    layers: tuple[tuple[int, ...], ...]  # each group's layers
    slots: int  # layers a block holds (P)

    @classmethod
    def of(cls, shape: ModelShape) -> "KVGroups":
        """One group unless the model mixes windows (hybrids keep one: their state
        blocks span every layer's tensor)."""
        windows = shape.layer_windows or (0,) * shape.num_layers
        kinds: dict[int, list[int]] = {}
        for layer, window in enumerate(windows):
            kinds.setdefault(window, []).append(layer)
        if len(kinds) == 1 or shape.mamba is not None:
            return cls((max(windows),), (tuple(range(shape.num_layers)),), shape.num_layers)
        size = min(len(layers) for layers in kinds.values())
        groups = [(window, tuple(layers[i:i + size]))
                  for window, layers in sorted(kinds.items())
                  for i in range(0, len(layers), size)]
        return cls(tuple(w for w, _ in groups), tuple(ls for _, ls in groups), size)

    @property
    def count(self) -> int:
        return len(self.windows)

    def layer_group(self, layer: int) -> int:
        return next(g for g, layers in enumerate(self.layers) if layer in layers)

    def layer_slot(self, layer: int) -> int:
        """The layer's place among the P layers a block holds."""
        return self.layers[self.layer_group(layer)].index(layer)


__all__ = ["KVGroups"]
