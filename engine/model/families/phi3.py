"""Phi-3 and Phi-4 (`Phi3ForCausalLM`): the shared decoder, checkpoint fused.

Phi-3's checkpoints store q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`,
the layout the engine's own fused layers use; the loader splits them back into the
q / k / v and gate / up pieces that the shared rules place, so tensor parallelism
takes each rank's heads and columns as for any Llama checkpoint. LongRoPE (Phi-3's
128k variants) is engine.model.layers.rotary's: the long factors when max_model_len
passes the original context, else the short ones.
"""
from __future__ import annotations

from typing import Any, Iterable

from engine.errors import UnsupportedModelError
from engine.model.families.base import DecoderForCausalLM
from engine.model.families.phi3_arch import FAMILY
from engine.model.shape import FUSED_PROJECTIONS, fused_pieces


class Phi3ForCausalLM(DecoderForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, Any]], holder: Any = None,
                     fp8_block: tuple[int, int] | None = None) -> int:
        return super().load_weights(self._split_fused(weights), holder, fp8_block)

    def _split_fused(self, weights: Iterable[tuple[str, Any]]):
        """Each fused qkv_proj / gate_up_proj tensor as its pieces, rows read lazily."""
        pieces = {fused: fused_pieces(self.shape, fused) for fused in FUSED_PROJECTIONS}
        for name, tensor in weights:
            parts = name.split(".")
            fused = parts[-2] if len(parts) >= 2 else ""
            if fused not in pieces:
                yield name, tensor
                continue
            if parts[-1] != "weight":  # a quantized format's sidecars, a bias
                raise UnsupportedModelError(
                    f"checkpoint tensor {name!r}: of Phi-3's fused {fused}, only the weight "
                    "is read (quantized Phi-3 checkpoints are not served)")
            rows = _rows(tensor)
            want = sum(n for _, _, n in pieces[fused])
            if rows != want:
                raise UnsupportedModelError(
                    f"checkpoint tensor {name!r} has {rows} rows, expected {want}")
            for piece, start, length in pieces[fused]:
                yield ".".join(parts[:-2] + [piece, parts[-1]]), tensor[start:start + length]


def _rows(tensor: Any) -> int:
    shape = tensor.get_shape() if hasattr(tensor, "get_shape") else tensor.shape
    return int(shape[0])


ARCHITECTURES = FAMILY.classes(Phi3ForCausalLM)
