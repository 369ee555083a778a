"""QuantFormat: what a quantization format does, as one object per format.

Why an object and not a name: before it, each place that loads a quantized checkpoint
asked "which format is this?" in its own if/elif chain (the checkpoint's check, the int4
scheme, the fp8 scale blocks, the AWQ / GPTQ conversion, the dummy weights, the refusal
of a float checkpoint that declares fp8). Each format's module now subclasses this and
says what it does; the registry (engine.quant.QUANT_FORMATS) maps vLLM's
`--quantization` names to the objects, and the loader calls them by name. This base is
also what an unquantized checkpoint, or a name no entry reads, gets: nothing checked,
its tensors read as they are.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from engine.errors import UnsupportedQuantizationError
from engine.quant.dummy import dummy_tensors


def config_dict(hf_config: Any) -> dict:
    """A Hugging Face config's quantization_config as a dict (transformers keeps some as
    objects with to_dict)."""
    qc = hf_config.quantization_config
    return qc if isinstance(qc, dict) else qc.to_dict()


class QuantFormat:
    """One checkpoint format, by vLLM's `--quantization` name. Subclasses override what
    their format does differently; every member has the unquantized behaviour here."""

    # a config declaring it whose linears all load as floats is refused (a float
    # checkpoint with a quantization_config is not quantized at load)
    needs_quantized_tensors = False

    # names of the formats whose objects make dummy weights (override dummy_linear), in
    # the order they were made: what a refusal of a dummy load lists
    dummy_makers: list[str] = []

    def __init__(self, name: str, variants: tuple[str, ...]) -> None:
        self.name = name  # vLLM's --quantization value
        self.variants = variants  # what of the format is read (GGUF: its tensor types)
        if self.makes_dummies() and name not in QuantFormat.dummy_makers:
            QuantFormat.dummy_makers.append(name)

    def makes_dummies(self) -> bool:
        """Whether load_format dummy can make this format's weights (dummy_linear)."""
        return type(self).dummy_linear is not QuantFormat.dummy_linear

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def check(self, hf_config: Any, model: str) -> None:
        """Refuse (UnsupportedQuantizationError, naming the part) a checkpoint of this
        format whose scheme is not served; before any weight is read."""

    def scheme(self, hf_config: Any, model: str) -> Any:
        """The variant of the format the checkpoint names (the int4 groups, the fp8
        scale blocks), as read() and scale_block() take it; None where nothing varies."""
        return None

    def scale_block(self, scheme: Any) -> tuple[int, int] | None:
        """(rows, columns) of the scale blocks the loader gathers weights' scales by
        (block-wise fp8), else None."""
        return None

    def read(self, weights: Iterable[tuple[str, Any]], scheme: Any
             ) -> Iterable[tuple[str, Any]]:
        """The checkpoint's (name, tensor) pairs as the loader takes them: converted where
        the format's tensors are not ones it holds (AWQ / GPTQ into Q4_1 blocks)."""
        return weights

    def dummy_config(self, group_size: int = 128) -> dict[str, Any]:
        """The quantization_config of a checkpoint dummy() makes (load_format dummy);
        UnsupportedQuantizationError for a format that makes none."""
        raise self._no_dummy()

    def dummy_linear(self, out: int, inp: int, scheme: Any, generator: torch.Generator,
                     device: torch.device) -> dict[str, torch.Tensor]:
        """One linear's random checkpoint tensors in this format, by name suffix."""
        raise self._no_dummy()

    def dummy(self, shape: Any, scheme: Any) -> Iterable[tuple[str, Any]]:
        """Random tensors as this format's checkpoint holds them, for load_format dummy
        (engine.quant.dummy walks the decoder; dummy_linear makes each linear's)."""
        if not self.makes_dummies():
            raise self._no_dummy()
        return dummy_tensors(shape, lambda out, inp, generator, device: self.dummy_linear(
            out, inp, scheme, generator, device))

    def _no_dummy(self) -> UnsupportedQuantizationError:
        return UnsupportedQuantizationError(
            f"load_format dummy makes random weights in {', '.join(self.dummy_makers)} only, "
            f"not {self.name!r}: serve that format from its checkpoint")


__all__ = ["QuantFormat", "config_dict"]
