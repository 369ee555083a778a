"""PEFT LoRA adapters read into the shapes of the engine's fused layers.

An adapter folder holds adapter_config.json and adapter_model.safetensors, as
`peft`'s save_pretrained writes them. The engine fuses q/k/v into qkv_proj and
gate/up into gate_up_proj, so an adapter's matrices are laid out per fused layer:
A stacks each sub-projection's A (rank padded to max_lora_rank) and B is block
diagonal, each sub-projection's B in its rows and its own rank columns, with the
scaling (alpha / r, or alpha / sqrt(r) under rsLoRA) folded in. A sub-projection the
adapter does not target stays zero. Under tensor parallelism each rank reads only its
slice: B's rows for a column-parallel layer, A's columns for a row-parallel one.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import InvalidRequestError
from engine.model.shape import FUSED_PROJECTIONS, fused_pieces

# checkpoint module -> (fused layer, sub-projection index)
_TARGETS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
            "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}
FUSED_SUBS = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}
_MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
_SERVED_ON = "adapters are served on attention (q_proj, k_proj, v_proj, o_proj) and dense MLPs"
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class _RowSlice:
    """Rows [start, start + length) of a lazy safetensors slice, itself sliced lazily: a
    fused projection's piece of an adapter's B (A is shared, and B @ (A @ x) split by
    B's rows is each piece's product)."""

    def __init__(self, lazy, start: int, length: int) -> None:
        self.lazy, self.start, self.length = lazy, start, length

    def get_shape(self) -> list[int]:
        return [self.length, *self.lazy.get_shape()[1:]]

    def __getitem__(self, rows: slice) -> torch.Tensor:
        lo, hi, _ = (rows if isinstance(rows, slice) else slice(None)).indices(self.length)
        return self.lazy[self.start + lo:self.start + hi]


class LoRAError(InvalidRequestError):
    """An adapter that cannot be served: missing files, unsupported targets, rank."""


@dataclass
class LoRAAdapter:
    """One adapter in this rank's fused layout: (layer, fused name) -> (A^T, B^T) with
    A^T [in, subs * max_rank] and B^T [subs * max_rank, out], scaling folded into B."""

    name: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self.weights.values())


def _refuse_unserved_layout(key: str) -> None:
    """Adapters on a mixture of experts' experts refused by what they are, not key by
    key."""
    if any(part in key for part in (".experts.", ".block_sparse_moe.", ".shared_expert.")):
        raise LoRAError(f"adapter tensor {key!r} targets a mixture of experts' experts; "
                        + _SERVED_ON)


def read_config(path: str | Path, max_rank: int) -> dict:
    """adapter_config.json, checked: a plain LoRA of rank <= max_rank on supported
    modules. Raises LoRAError saying what is wrong."""
    folder = Path(path)
    config_file = folder / "adapter_config.json"
    if not config_file.is_file() or not (folder / "adapter_model.safetensors").is_file():
        raise LoRAError(f"no LoRA adapter at {str(path)!r}: expected adapter_config.json and "
                        "adapter_model.safetensors")
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"adapter type {config.get('peft_type')!r} is not LoRA")
    rank = int(config.get("r", 0))
    if not 1 <= rank <= max_rank:
        raise LoRAError(f"adapter rank {rank} is over max_lora_rank ({max_rank})"
                        if rank > max_rank else f"adapter rank {rank} is not positive")
    unsupported = [(key, config[key]) for key in ("rank_pattern", "alpha_pattern")
                   if config.get(key)]
    unsupported += [(key, True) for key in ("use_dora", "fan_in_fan_out") if config.get(key)]
    if config.get("bias", "none") != "none":
        unsupported.append(("bias", config["bias"]))
    if config.get("modules_to_save"):
        unsupported.append(("modules_to_save", config["modules_to_save"]))
    if unsupported:
        raise LoRAError("unsupported adapter options: "
                        + ", ".join(f"{k}={v!r}" for k, v in unsupported))
    return config


def load_adapter(name: str, path: str | Path, shape, plan, max_rank: int,
                 dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    """Read the adapter at path into this rank's (plan's) fused layout. Whatever goes
    wrong (a file that cannot be read, shapes of another model) is a LoRAError."""
    try:
        return _load(name, path, shape, plan, max_rank, dtype)
    except LoRAError:
        raise
    except Exception as exc:  # noqa: BLE001 - I/O, safetensors, torch: one typed error
        raise LoRAError(f"cannot read the LoRA adapter at {str(path)!r}: "
                        f"{type(exc).__name__}: {exc}") from exc


def _load(name: str, path: str | Path, shape, plan, max_rank: int,
          dtype: torch.dtype) -> LoRAAdapter:
    from safetensors import safe_open
    config = read_config(path, max_rank)
    rank = int(config["r"])
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pieces: dict[tuple[int, str, str], object] = {}
    bad: set[str] = set()
    with safe_open(str(Path(path) / "adapter_model.safetensors"), framework="pt") as f:
        for key in f.keys():
            _refuse_unserved_layout(key)
            match = _KEY.search(key)
            if match is None or match.group(2) not in (*_TARGETS, *FUSED_PROJECTIONS):
                bad.add(match.group(2) if match else key)
                continue
            layer, module, which = int(match.group(1)), match.group(2), match.group(3)
            if layer >= shape.num_layers:
                raise LoRAError(f"adapter tensor {key!r} names layer {layer}; the model has "
                                f"{shape.num_layers}")
            if module in (*_MLP_TARGETS, "gate_up_proj") and shape.is_sparse(layer):
                raise LoRAError(f"adapter tensor {key!r} targets layer {layer}'s MLP, which is "
                                "a mixture of experts; " + _SERVED_ON)
            if module in FUSED_PROJECTIONS:  # Phi-3's qkv_proj / gate_up_proj: per piece
                for piece, start, length in fused_pieces(shape, module):
                    pieces[(layer, piece, which)] = f.get_slice(key) if which == "A" else \
                        _RowSlice(f.get_slice(key), start, length)
                continue
            pieces[(layer, module, which)] = f.get_slice(key)
        if bad:
            raise LoRAError("adapter targets modules this engine does not support: "
                            + ", ".join(sorted(bad)) + " (supported: "
                            + ", ".join((*_TARGETS, *FUSED_PROJECTIONS)) + ")")
        layout = _Layout(shape, plan)
        weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for (layer, module, which), lazy in pieces.items():
            if which != "A":
                continue
            if (layer, module, "B") not in pieces:
                raise LoRAError(f"adapter has lora_A but no lora_B for layer {layer} {module}")
            fused, sub = _TARGETS[module]
            subs = FUSED_SUBS[fused]
            if (layer, fused) not in weights:
                weights[(layer, fused)] = (
                    torch.zeros(layout.in_size(fused), subs * max_rank, dtype=dtype),
                    torch.zeros(subs * max_rank, layout.out_size(fused), dtype=dtype))
            a_t, b_t = weights[(layer, fused)]
            b_lazy = pieces[(layer, module, "B")]
            want = (rank, layout.full_in(module)), (layout.full_out(module), rank)
            got = tuple(lazy.get_shape()), tuple(b_lazy.get_shape())
            if got != want:
                raise LoRAError(f"adapter tensors of layer {layer} {module} have shapes "
                                f"{got[0]} and {got[1]}; this model needs {want[0]} and "
                                f"{want[1]} (an adapter of another model?)")
            a = layout.slice_a(module, lazy).to(dtype)  # [r, in shard]
            b = layout.slice_b(module, b_lazy).to(dtype)  # [out shard, r]
            cols = slice(sub * max_rank, sub * max_rank + rank)
            row0, rows = layout.out_rows(module)
            a_t[:, cols] = a.t()
            b_t[cols, row0:row0 + rows] = b.t() * scale
    return LoRAAdapter(name, rank, weights)


class _Layout:
    """Where each checkpoint module sits in this rank's fused layers."""

    def __init__(self, shape, plan) -> None:
        d = shape.head_dim
        self.shape, self.plan = shape, plan
        self.q, self.kv, self.inter = plan.num_heads * d, plan.num_kv_heads * d, \
            plan.intermediate_size
        # the checkpoint rows of each column-parallel module that this rank holds
        self.src_rows = {"q_proj": (plan.head_start * d, self.q),
                         "k_proj": (plan.kv_head_start * d, self.kv),
                         "v_proj": (plan.kv_head_start * d, self.kv),
                         "gate_proj": (plan.rank * self.inter, self.inter),
                         "up_proj": (plan.rank * self.inter, self.inter)}
        # the checkpoint input columns of each row-parallel module that this rank holds
        self.src_cols = {"o_proj": (plan.head_start * d, self.q),
                         "down_proj": (plan.rank * self.inter, self.inter)}

    def full_in(self, module: str) -> int:
        """The checkpoint's input width of a module (before any TP split)."""
        s = self.shape
        return {"o_proj": s.num_heads * s.head_dim,
                "down_proj": s.intermediate_size}.get(module, s.hidden_size)

    def full_out(self, module: str) -> int:
        s = self.shape
        return {"q_proj": s.num_heads * s.head_dim, "k_proj": s.num_kv_heads * s.head_dim,
                "v_proj": s.num_kv_heads * s.head_dim, "gate_proj": s.intermediate_size,
                "up_proj": s.intermediate_size}.get(module, s.hidden_size)

    def in_size(self, fused: str) -> int:
        return {"qkv_proj": self.shape.hidden_size, "gate_up_proj": self.shape.hidden_size,
                "o_proj": self.q, "down_proj": self.inter}[fused]

    def out_size(self, fused: str) -> int:
        return {"qkv_proj": self.q + 2 * self.kv, "gate_up_proj": 2 * self.inter,
                "o_proj": self.shape.hidden_size, "down_proj": self.shape.hidden_size}[fused]

    def out_rows(self, module: str) -> tuple[int, int]:
        """(first row, rows) of a module's output inside its fused layer on this rank."""
        return {"q_proj": (0, self.q), "k_proj": (self.q, self.kv),
                "v_proj": (self.q + self.kv, self.kv), "gate_proj": (0, self.inter),
                "up_proj": (self.inter, self.inter), "o_proj": (0, self.shape.hidden_size),
                "down_proj": (0, self.shape.hidden_size)}[module]

    def slice_a(self, module: str, lazy) -> torch.Tensor:
        if module in self.src_cols:
            start, length = self.src_cols[module]
            return lazy[:, start:start + length]
        return lazy[:]

    def slice_b(self, module: str, lazy) -> torch.Tensor:
        if module in self.src_rows:
            start, length = self.src_rows[module]
            return lazy[start:start + length]
        return lazy[:]
