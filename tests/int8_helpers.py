"""int8 W8A8 checkpoints in compressed-tensors' on-disk format, made from a float Hugging
Face checkpoint (tests' tiny models; bench/quantize_w8a8.py's default model), and the
float checkpoint of their decoded weights that references run.

The format as llm-compressor writes its W8A8 schemes and vLLM reads them: each quantized
linear's `weight` int8 [out, in] with `weight_scale` [out, 1] (per channel) or [1] (per
tensor), `input_scale` [1] for static activations; the config's `quantization_config`
names the scheme (quant_method compressed-tensors, format int-quantized).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantize(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.float()
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().max().reshape(1, 1)
    scale = amax.clamp_min(1e-12) / 127
    q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    return q, scale.reshape(-1, 1) if per_channel else scale.reshape(1)


def _state(src: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def write_w8a8(src: Path, out: Path, per_channel: bool = True,
               static_inputs: dict[str, float] | None = None,
               scale_dtype: torch.dtype = torch.float32) -> Path:
    """src's linears (q/k/v/o, gate/up/down) as int8 W8A8 under out; the embedding,
    norms and any lm_head stay as they are (the scheme's ignore list). static_inputs:
    linear name -> input_scale, for static per-tensor activations (else dynamic per
    token)."""
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, value in _state(src).items():
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in LINEARS and parts[-1] == "weight":
            q, scale = _quantize(value, per_channel)
            prefix = name[:-len(".weight")]
            state[name] = q
            state[prefix + ".weight_scale"] = scale.to(scale_dtype)
            if static_inputs is not None:
                state[prefix + ".input_scale"] = torch.tensor(
                    [static_inputs[parts[-2]]], dtype=scale_dtype)
        else:
            state[name] = value.contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    static = static_inputs is not None
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False,
                        "strategy": "channel" if per_channel else "tensor",
                        "group_size": None, "observer": "minmax"},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                  "dynamic": not static,
                                  "strategy": "tensor" if static else "token",
                                  "observer": "minmax" if static else None},
            "output_activations": None}},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for f in src.iterdir():  # tokenizer and generation config
        if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
            shutil.copy(f, out / f.name)
    return out


def write_decoded(w8a8: Path, out: Path) -> Path:
    """The float32 checkpoint of a W8A8 (or fp8: tests/fp8_helpers.py) one's decoded
    weights (int8 or e4m3 x scale): what a reference runs."""
    out.mkdir(parents=True, exist_ok=True)
    state = _state(w8a8)
    decoded = {}
    config = json.loads((w8a8 / "config.json").read_text())
    block = _block(config["quantization_config"])
    for name, value in state.items():
        if name.endswith((".weight_scale", ".weight_scale_inv", ".input_scale")):
            continue
        if value.dtype in (torch.int8, torch.float8_e4m3fn):
            scale = state.get(name + "_scale_inv", state.get(name + "_scale")).float()
            if block:  # [ceil(out / bn), ceil(in / bk)]: each block's scale over its block
                rows, cols = value.shape
                scale = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(
                    block[1], 1)[:, :cols]
            decoded[name] = value.float() * (scale if block else scale.reshape(-1, 1))
        else:
            decoded[name] = value.float()
    save_file(decoded, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for f in w8a8.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
            shutil.copy(f, out / f.name)
    return out


def _block(qc: dict) -> list | None:
    """A block-wise fp8 config's [rows, columns] of its scale blocks, else None."""
    from engine.quant.compressed_tensors import block_structure
    return qc.get("weight_block_size") or block_structure(qc)
