"""FP8 checkpoints in their on-disk formats, made from a float Hugging Face checkpoint
(tests' tiny models; bench/quantize_fp8.py's default model). tests/int8_helpers.py's
write_decoded gives the float checkpoint of their decoded weights.

Two formats, as vLLM reads them:
- vLLM's `fp8` (quant_method fp8, as AutoFP8 and vLLM's own tools write it): each
  quantized linear's `weight` float8_e4m3fn [out, in], `weight_scale` a float32 scalar
  per tensor (here optionally [out] per channel), `input_scale` a scalar for
  activation_scheme static;
- compressed-tensors (format float-quantized, llm-compressor's FP8 and FP8_DYNAMIC
  schemes): `weight_scale` [out, 1] per channel or [1] per tensor, `input_scale` [1]
  for static activations, or no input_activations (weight-only).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.int8_helpers import LINEARS, _state

E4M3_MAX = 448.0


def quantize_fp8(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and their float32 scale ([out] per channel, [] per tensor)."""
    w = w.float()
    amax = w.abs().amax(dim=1) if per_channel else w.abs().max()
    scale = amax.clamp_min(1e-12) / E4M3_MAX
    q = (w / (scale[:, None] if per_channel else scale)).clamp(-E4M3_MAX, E4M3_MAX)
    return q.to(torch.float8_e4m3fn), scale


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
    """e4m3 values and their float32 scales, one per block of rows x columns:
    [ceil(out / rows), ceil(in / columns)] (partial blocks at the edges, as DeepSeek's)."""
    bn, bk = block
    w = w.float()
    out, inp = w.shape
    grid = torch.zeros(-(-out // bn), -(-inp // bk))
    q = torch.empty(out, inp, dtype=torch.float8_e4m3fn)
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            part = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            grid[i, j] = part.abs().max().clamp_min(1e-12) / E4M3_MAX
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (part / grid[i, j]).clamp(
                -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, grid


def write_fp8(src: Path, out: Path, fmt: str = "fp8", per_channel: bool = False,
              activations: str = "dynamic", static_scale: float = 0.05,
              kv_scales: str | None = None, block: tuple[int, int] | None = None) -> Path:
    """src's linears (q/k/v/o, gate/up/down) as e4m3 under out, in `fmt` ("fp8" or
    "compressed-tensors"); the embedding and norms stay as they are. activations:
    "dynamic", "static" (every input_scale static_scale) or "none" (weight-only,
    compressed-tensors only). kv_scales (compressed-tensors): a kv_cache_scheme of static
    fp8 per tensor, layer i's k_scale 0.1 (i + 1) and v_scale 0.2 (i + 1), named
    "k_scale" (self_attn.k_scale, llm-compressor's current names) or "output_scale"
    (k_proj / v_proj.output_scale, its older ones). block: (rows, columns) of block-wise
    scales (vLLM fp8's weight_block_size with `weight_scale_inv`; compressed-tensors'
    FP8_BLOCK with `weight_scale`), activations dynamic."""
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    if kv_scales is not None:
        layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
        for i in range(layers):
            for kind, value in (("k", 0.1 * (i + 1)), ("v", 0.2 * (i + 1))):
                name = (f"model.layers.{i}.self_attn.{kind}_scale" if kv_scales == "k_scale"
                        else f"model.layers.{i}.self_attn.{kind}_proj.output_scale")
                state[name] = torch.tensor([value])
    for name, value in _state(src).items():
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in LINEARS and parts[-1] == "weight" and block:
            q, grid = quantize_fp8_blocks(value, block)
            state[name] = q
            scale_name = "weight_scale_inv" if fmt == "fp8" else "weight_scale"
            state[name[:-len("weight")] + scale_name] = grid
        elif len(parts) >= 2 and parts[-2] in LINEARS and parts[-1] == "weight":
            q, scale = quantize_fp8(value, per_channel)
            prefix = name[:-len(".weight")]
            state[name] = q
            if fmt == "compressed-tensors":
                scale = scale.reshape(-1, 1) if per_channel else scale.reshape(1)
            state[prefix + ".weight_scale"] = scale.contiguous()
            if activations == "static":
                state[prefix + ".input_scale"] = torch.tensor(
                    static_scale if fmt == "fp8" else [static_scale])
        else:
            state[name] = value.contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    if fmt == "fp8":
        config["quantization_config"] = {"quant_method": "fp8",
                                         "activation_scheme": activations,
                                         "ignored_layers": ["lm_head"]}
        if block:
            config["quantization_config"]["weight_block_size"] = list(block)
    else:
        acts = None if activations == "none" else {
            "num_bits": 8, "type": "float", "symmetric": True,
            "dynamic": activations == "dynamic",
            "strategy": "token" if activations == "dynamic" else "tensor"}
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                   "strategy": "channel" if per_channel else "tensor"}
        if block:
            weights.update(strategy="block", block_structure=list(block))
            if acts is not None:
                acts.update(strategy="group", group_size=128)
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": weights, "input_activations": acts, "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None if kv_scales is None else {
                "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                "symmetric": True}}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for f in src.iterdir():  # tokenizer and generation config
        if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
            shutil.copy(f, out / f.name)
    return out
