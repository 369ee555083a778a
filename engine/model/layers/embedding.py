"""VocabEmbedding: the token embedding, its weight dense or held quantized.

Why its own layer: a GGUF file's embedding is blocks like its linears, and is served as
stored (its rows decoded at each lookup: a 49k x 576 Q8_0 table is a quarter of its
float32 size). Like a Linear, the layer holds a HeldWeight (engine.quant.held) once
set_quantized replaced its weight, and the model looks rows up without asking how they
are held.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class VocabEmbedding(nn.Embedding):
    """nn.Embedding whose weight may be a held one (its rows(ids, dtype))."""

    quant = None  # a HeldWeight serving rows(), once set_quantized replaced the weight

    def set_quantized(self, weight) -> None:
        """Serve lookups from `weight`; the dense weight is released."""
        self.quant = weight
        del self.weight
        self.register_parameter("weight", None)

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` in dtype (the model's activation dtype: a held weight has none)."""
        if self.quant is not None:
            return self.quant.rows(ids, dtype)
        return F.embedding(ids, self.weight)


__all__ = ["VocabEmbedding"]
