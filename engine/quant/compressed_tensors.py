"""compressed-tensors checkpoints (llm-compressor's format, vLLM's `compressed-tensors`
quantization): which of their schemes Flotilla serves, and a refusal naming what differs
for every other one.

Served: 8-bit symmetric weights, one scale per output channel or per tensor,
- int8 (format int-quantized or naive-quantized) with int8 activations per token
  (dynamic) or per tensor (static): W8A8, engine/quant/int8_w8a8.py;
- fp8 e4m3 (format float-quantized or naive-quantized) with fp8 activations per token or
  per tensor, or none (weight-only): engine/quant/fp8.py; or per block of weights
  (FP8_BLOCK: block_structure, activations dynamic per token or group).
What the weights need past the scheme (static input scales, the modules left in float)
the checkpoint's tensors say: an `input_scale` beside a weight, a quantized weight or a
float one. A kv_cache_scheme of static fp8 per tensor is served too: its k_scale /
v_scale tensors (or the older k_proj / v_proj output_scale) scale an fp8 KV cache.
"""
from __future__ import annotations

from typing import Any, Iterable

from engine.errors import UnsupportedQuantizationError
from engine.quant.fp8 import current_kv_scale_names
from engine.quant.method import QuantFormat, config_dict

SERVED = ("int8 W8A8: int8 symmetric weights per channel or per tensor, with int8 symmetric "
          "activations per token (dynamic) or per tensor (static); FP8: e4m3 weights per "
          "channel or per tensor, with fp8 activations per token or per tensor, or "
          "weight-only; or per block, with dynamic activations per token or group")
_FORMATS = {"int": ("int-quantized", "naive-quantized"),
            "float": ("float-quantized", "naive-quantized")}


KV_SERVED = "static symmetric 8-bit float per tensor, the fp8 cache's k_scale / v_scale"


def kv_scheme_difference(kv: dict) -> str | None:
    """What a kv_cache_scheme differs in from the one served (its scales are then an fp8
    cache's per-layer k_scale / v_scale, used under kv_cache_dtype fp8 as vLLM uses
    them), or None."""
    if kv.get("num_bits") != 8 or kv.get("type") != "float":
        return f"{kv.get('num_bits')}-bit {kv.get('type')}"
    if kv.get("strategy") != "tensor":
        return f"scales by {kv.get('strategy')!r}"
    if kv.get("dynamic") or not kv.get("symmetric", True):
        return "dynamic" if kv.get("dynamic") else "asymmetric values"
    return None


def block_structure(qc: dict) -> list | None:
    """The [rows, columns] of a block-wise FP8 scheme's scale blocks (llm-compressor's
    FP8_BLOCK), else None."""
    groups = qc.get("config_groups") or {}
    weights = next(iter(groups.values()), {}).get("weights") or {}
    return weights.get("block_structure") if weights.get("strategy") == "block" else None


def check_scheme(qc: dict, model: str) -> str:
    """The weights' type of a compressed-tensors `quantization_config` Flotilla serves,
    "int" or "float"; else UnsupportedQuantizationError naming the part that differs."""
    def refuse(what: str) -> UnsupportedQuantizationError:
        return UnsupportedQuantizationError(
            f"model {model!r} is compressed-tensors with {what}; Flotilla serves its "
            f"schemes {SERVED}")

    fmt = qc.get("format")
    if fmt not in _FORMATS["int"] + _FORMATS["float"]:
        raise refuse(f"format {fmt!r}")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise refuse(f"{len(groups)} config groups")
    group = next(iter(groups.values()))
    w, a = group.get("weights") or {}, group.get("input_activations")
    kind = w.get("type", "int")
    if w.get("num_bits") != 8 or kind not in _FORMATS or fmt not in _FORMATS[kind]:
        raise refuse(f"{w.get('num_bits')}-bit {kind} weights in format {fmt!r}")
    block = kind == "float" and w.get("strategy") == "block"
    if not w.get("symmetric", True) or (w.get("strategy") not in ("channel", "tensor")
                                        and not block):
        raise refuse(f"{'asymmetric ' if not w.get('symmetric', True) else ''}weights by "
                     f"{w.get('strategy')!r}")
    structure = w.get("block_structure")
    if block and (not isinstance(structure, (list, tuple)) or len(structure) != 2
                  or not all(isinstance(b, int) and b > 0 for b in structure)):
        raise refuse(f"float weights by block with block_structure {structure!r}")
    if not a:
        if kind == "int":
            raise refuse("weight-only int8 (no input_activations)")
    else:
        if (a.get("num_bits") != 8 or a.get("type", "int") != kind
                or not a.get("symmetric", True)):
            raise refuse(f"{a.get('num_bits')}-bit "
                         f"{'asymmetric ' if not a.get('symmetric', True) else ''}"
                         f"{a.get('type')} activations over {kind} weights")
        dynamic = bool(a.get("dynamic"))
        served = (("token", True), ("group", True)) if block else \
            (("token", True), ("tensor", False))
        if (a.get("strategy"), dynamic) not in served:
            raise refuse(f"{'dynamic' if dynamic else 'static'} activations by "
                         f"{a.get('strategy')!r}")
    if group.get("output_activations"):
        raise refuse("quantized output activations")
    kv = qc.get("kv_cache_scheme")
    if kv:
        what = kv_scheme_difference(kv)
        if what is not None:
            raise refuse(f"a kv_cache_scheme of {what} (served: {KV_SERVED})")
    targets = group.get("targets") or []
    if targets != ["Linear"]:
        raise refuse(f"targets {targets}")
    return kind


class CompressedTensorsFormat(QuantFormat):
    """vLLM's `compressed-tensors`: its int8 W8A8 and FP8 schemes (check_scheme)."""

    needs_quantized_tensors = True

    def __init__(self) -> None:
        super().__init__("compressed-tensors", (
            "int8 W8A8: weights per channel or tensor, activations per token or static",
            "FP8: e4m3 weights per channel, tensor or block, activations dynamic, static "
            "or none"))

    def check(self, hf_config: Any, model: str) -> None:
        check_scheme(config_dict(hf_config), model)

    def scheme(self, hf_config: Any, model: str) -> tuple[int, int] | None:
        """The scale blocks' (rows, columns) of an FP8_BLOCK scheme, else None."""
        block = block_structure(config_dict(hf_config))
        return (int(block[0]), int(block[1])) if block else None

    def scale_block(self, scheme: tuple[int, int] | None) -> tuple[int, int] | None:
        return scheme

    def read(self, weights: Iterable[tuple[str, Any]], scheme: Any
             ) -> Iterable[tuple[str, Any]]:
        return current_kv_scale_names(weights)


__all__ = ["CompressedTensorsFormat", "KV_SERVED", "SERVED", "block_structure", "check_scheme", "kv_scheme_difference"]
