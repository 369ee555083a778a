"""Quantized checkpoints: the formats Flotilla reads, by vLLM's `--quantization` names,
and a refusal that names the format for every other one.

A checkpoint says how it is quantized: a Hugging Face directory in its config's
`quantization_config` (`quant_method`: awq, gptq, compressed-tensors, fp8,
bitsandbytes, ...), a GGUF file in the type of each tensor. Before this registry, a
quantized directory failed deep in the weight loader ("unexpected checkpoint tensor
'...qweight'"), or had its fp8 weights widened as they were copied. Each format is one
entry here, with the module that reads it; a format without an entry is refused up
front, naming it and listing what is read.

The entries:
- gguf: GGUF's block formats. engine/quant/gguf_blocks.py (layouts and reference
  decoders), gguf_weights.py (a file's tensors under Hugging Face names, left as blocks)
  and gguf_linear.py (a layer's weight as blocks, multiplied by the native kernels of
  engine/model/kernels/quant_linear.cpp as stored).
- compressed-tensors: its int8 W8A8 schemes (engine/quant/int8_w8a8.py, multiplied by
  engine/model/kernels/int8_linear.cpp) and its FP8 ones (engine/quant/fp8.py), checked
  by engine/quant/compressed_tensors.py.
- fp8: vLLM's own fp8 checkpoints, e4m3 weights with a scale per channel or tensor
  (engine/quant/fp8.py: fp8_linear.cpp widens them on CPU, torch._scaled_mm on CUDA),
  or per block (DeepSeek's and Qwen's weight_block_size: fp8_linear.cpp on CPU, decoded
  on CUDA).
- awq, gptq: int4 weights in groups (engine/quant/int4_groups.py), read into Q4_1 blocks
  and served as a GGUF file's are.
Where those kernels do not run (CUDA, FLOTILLA_NATIVE_KERNELS=0) the weights are decoded
to the activation dtype at load, and the engine says so in its log.
"""
from __future__ import annotations

from typing import Any, Iterable

from engine.errors import UnsupportedQuantizationError
from engine.model.registry import family
from engine.quant.compressed_tensors import CompressedTensorsFormat
from engine.quant.fp8 import Fp8Format
from engine.quant.gguf_blocks import BLOCK_FORMATS, FLOAT_TYPES
from engine.quant.gguf_weights import GGUF
from engine.quant.int4_groups import AWQ, GPTQ
from engine.quant.method import QuantFormat

QUANT_FORMATS: dict[str, QuantFormat] = {}
# vLLM's names for a kernel choice over the same checkpoint format: the format is served
ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq"}


def register(fmt: QuantFormat) -> QuantFormat:
    if fmt.name in QUANT_FORMATS:
        raise ValueError(f"quantization format {fmt.name!r} is registered twice")
    QUANT_FORMATS[fmt.name] = fmt
    return fmt


for _fmt in (GGUF, AWQ, GPTQ, CompressedTensorsFormat(), Fp8Format()):
    register(_fmt)


def quant_format(name: str | None) -> QuantFormat:
    """The format object of a quant_method name; for None (unquantized) or a name no
    entry reads, the base QuantFormat, which reads the tensors as they are."""
    return QUANT_FORMATS.get(name) or QuantFormat(name or "none", ())


def dummy_formats() -> list[str]:
    """The formats load_format dummy makes random weights in (their dummy_linear)."""
    return [f.name for f in QUANT_FORMATS.values() if f.makes_dummies()]


def quantization_config(name: str, group_size: int = 128) -> dict[str, Any]:
    """The quantization_config a dummy checkpoint of format `name` declares (bench/gpu.py
    writes it into a config.json of a model's shapes)."""
    return quant_format(name).dummy_config(group_size)


def dummy_weights(shape: Any, name: str, group_size: int = 128
                  ) -> Iterable[tuple[str, Any]]:
    """(HF name, tensor) of a random checkpoint of these shapes in format `name`, as that
    format's checkpoint holds them (before its read() conversion)."""
    fmt = quant_format(name)
    return fmt.dummy(shape, fmt.scheme(_Declared(fmt.dummy_config(group_size)), "dummy"))


class _Declared:
    """A config carrying only a quantization_config (what scheme() reads)."""

    def __init__(self, quantization_config: dict) -> None:
        self.quantization_config = quantization_config


def supported_summary() -> str:
    """What is read, for error messages: "gguf (Q8_0, Q4_0, ...)"."""
    return "; ".join(f"{f.name} ({', '.join(f.variants)})" for f in QUANT_FORMATS.values())


def checkpoint_quantization(hf_config: Any) -> str | None:
    """The quant_method a Hugging Face config declares, lower-cased; None if unquantized."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    method = getattr(method, "value", method)  # transformers keeps some as enums
    return str(method or "unknown").lower()


def check_checkpoint(hf_config: Any, model: str) -> None:
    """Refuse a Hugging Face checkpoint whose quantization no entry reads."""
    method = checkpoint_quantization(hf_config)
    if method is None:
        return
    fmt = QUANT_FORMATS.get(method)
    if fmt is None:
        raise UnsupportedQuantizationError(
            f"model {model!r} is quantized with {method!r} (its config's quantization_config), "
            f"which Flotilla does not serve; quantized formats it reads: {supported_summary()}")
    fmt.check(hf_config, model)  # transformers marks a GGUF file's config gguf: nothing to check


def resolve_quantization(requested: str | None, checkpoint_format: str | None,
                         model: str) -> str | None:
    """The format the weights are served in: the checkpoint's own (None: unquantized).
    A requested format (the `quantization` option) must be that one: weights are never
    requantized into another format at load."""
    requested = ALIASES.get(requested, requested)
    if requested is None or requested == checkpoint_format:
        return checkpoint_format
    if requested not in QUANT_FORMATS:
        raise UnsupportedQuantizationError(
            f"quantization {requested!r} is not served; quantized formats Flotilla reads: "
            f"{supported_summary()}")
    raise UnsupportedQuantizationError(
        f"quantization {requested!r} was asked for, but model {model!r} is "
        f"{'quantized as ' + repr(checkpoint_format) if checkpoint_format else 'not quantized'}"
        "; leave quantization unset to serve the checkpoint as it is")


def check_quantized_family(fmt: str | None, shape: Any, model: str) -> None:
    """Refuse a quantized checkpoint of a family whose loader reads floats only, before
    its weights are read: a mixture of experts (the experts' products take floats,
    engine.model.layers.moe; a silent dequantize of every expert would hide the format's
    memory from its user), and each family whose declaration says so
    (Family.quantized_refusal: Phi-3's fused qkv / gate_up tensors are split at load,
    which the quantized formats' per-tensor pieces are not; Gemma 3's norms are stored
    differently by converters, and none is read here yet)."""
    if fmt is None:
        return
    if getattr(shape, "moe", None) is not None:
        what = f"a mixture-of-experts model ({shape.architecture})"
    else:
        what = family(shape.architecture).quantized_refusal
    if what is None:
        return
    raise UnsupportedQuantizationError(
        f"model {model!r} is {what} quantized as {fmt!r}; quantized checkpoints of it are "
        "not served yet: serve its float16, bfloat16 or float32 checkpoint")


def check_gguf_types(types: Iterable[str], model: str) -> None:
    """Refuse a GGUF file holding tensor types no block decoder reads (IQ*, TQ*, the
    K-quants other than Q4_K and Q6_K, ...), before any conversion starts."""
    unread = sorted(set(types) - set(BLOCK_FORMATS) - FLOAT_TYPES)
    if unread:
        raise UnsupportedQuantizationError(
            f"GGUF file {model!r} holds tensors of type {', '.join(unread)}, which Flotilla "
            f"does not read; GGUF types it reads: {', '.join(BLOCK_FORMATS)} and "
            f"{', '.join(sorted(FLOAT_TYPES))}")


__all__ = ["QUANT_FORMATS", "QuantFormat", "UnsupportedQuantizationError", "check_checkpoint",
           "check_gguf_types", "check_quantized_family", "checkpoint_quantization",
           "dummy_formats", "dummy_weights", "quant_format", "quantization_config", "register",
           "resolve_quantization", "supported_summary"]
