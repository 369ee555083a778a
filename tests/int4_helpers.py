"""AWQ and GPTQ checkpoints in their on-disk formats (AutoAWQ's GEMM layout; GPTQ's
original format, act-order optional), made from a float Hugging Face checkpoint by
round-to-nearest with a scale and zero point per group, and the float checkpoint of their
decoded weights that references run. engine/quant/int4_groups.py describes the layouts.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.quant.int4_groups import AWQ_ORDER
from tests.int8_helpers import LINEARS, _state

# linears sharing an input share GPTQ's act-order (their inputs' statistics are equal)
_SHARED_INPUT = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in",
                 "gate_proj": "mlp_in", "up_proj": "mlp_in", "o_proj": "o", "down_proj": "down"}


def _quantize(w: torch.Tensor, group: int, order: torch.Tensor):
    """q [N, K] (0..15), scales and zeros [K / group, N] of W [N, K] whose group j holds
    input columns order[j * group:(j + 1) * group]."""
    n, k = w.shape
    wg = w.float()[:, order].view(n, k // group, group)
    lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp_min(1e-8).half().float()
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = (torch.round(wg / scale[..., None]) + zero[..., None]).clamp(0, 15).view(n, k)
    q_in_order = torch.empty_like(q)
    q_in_order[:, order] = q
    return q_in_order.to(torch.int64), scale.t().half(), zero.t().to(torch.int64)


def _pack(vals: torch.Tensor, dim: int, order=tuple(range(8))) -> torch.Tensor:
    """int64 values 0..15 packed eight to an int32 along dim (nibble i: element order[i])."""
    v = vals.movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, 8)
    packed = sum(v[..., order[i]] << (4 * i) for i in range(8))
    packed = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)
    return packed.movedim(-1, dim).contiguous()


def write_int4(src: Path, out: Path, method: str, group: int = 32, act_order: bool = False,
               seed: int = 0) -> Path:
    """src's linears as AWQ or GPTQ (4-bit, `group` input columns a group) under out."""
    gen = torch.Generator().manual_seed(seed)
    orders: dict[str, torch.Tensor] = {}
    state, decoded = {}, {}
    for name, value in _state(src).items():
        parts = name.split(".")
        if not (len(parts) >= 2 and parts[-2] in LINEARS and parts[-1] == "weight"):
            state[name] = decoded[name] = value.contiguous()
            continue
        n, k = value.shape
        key = ".".join(parts[:-2]) + _SHARED_INPUT[parts[-2]]
        order = torch.arange(k)
        if act_order:
            order = orders.setdefault(key, torch.randperm(k, generator=gen))
        q, scale, zero = _quantize(value, group, order)
        groups = torch.empty(k, dtype=torch.int64)
        groups[order] = torch.arange(k) // group
        decoded[name] = ((q - zero.t().index_select(1, groups)).float()
                         * scale.t().float().index_select(1, groups))
        prefix = name[:-len(".weight")]
        if method == "awq":
            state[prefix + ".qweight"] = _pack(q.t(), 1, AWQ_ORDER)
            state[prefix + ".qzeros"] = _pack(zero, 1, AWQ_ORDER)
            state[prefix + ".scales"] = scale.contiguous()
        else:
            state[prefix + ".qweight"] = _pack(q.t(), 0)
            state[prefix + ".qzeros"] = _pack((zero - 1) & 0xF, 1)  # the format's z - 1
            state[prefix + ".scales"] = scale.contiguous()
            state[prefix + ".g_idx"] = groups.to(torch.int32)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
         "version": "gemm"} if method == "awq" else
        {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order,
         "sym": False, "checkpoint_format": "gptq"})
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
            shutil.copy(f, out / f.name)
    ref = out.with_name(out.name + "-decoded")
    ref.mkdir(exist_ok=True)
    save_file({k: v.float().contiguous() for k, v in decoded.items()},
              str(ref / "model.safetensors"), metadata={"format": "pt"})
    config.pop("quantization_config")
    (ref / "config.json").write_text(json.dumps(config, indent=1))
    return out
