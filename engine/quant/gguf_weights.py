"""A GGUF file's tensors under Hugging Face names, the quantized ones left as blocks.

The weight loader takes tensors by their Hugging Face names (model.layers.0.self_attn.
q_proj.weight, ...) and slices them for tensor parallelism. This module yields a GGUF
llama file's tensors that way without decoding them: a quantized tensor comes as a
`GGUFBlocks`, its rows of blocks memory-mapped from the file, which slices like a
tensor (whole rows; columns only at block boundaries) and is decoded only by whoever
cannot use it as it is.

llama.cpp's converter stores the q and k projections with each head's rows permuted
(the rotary halves interleaved: rows [head, 2, dim/2] written as [head, dim/2, 2]);
that is a permutation of whole rows, so it is undone on the blocks themselves.
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from engine.errors import UnsupportedModelError
from engine.quant.gguf_blocks import BLOCK_FORMATS, dequantize
from engine.quant.gguf_index import GGUFIndex
from engine.quant.method import QuantFormat

# GGUF name -> Hugging Face name; {i} is the layer
_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")
# architectures whose q/k rows llama.cpp's converter permuted
_PERMUTED_QK = frozenset({"llama", "mistral"})


@dataclass(frozen=True)
class GGUFBlocks:
    """A quantized [rows, columns] weight as rows of GGUF blocks (uint8 [rows, bytes])."""

    format: str  # the GGML type name, a key of BLOCK_FORMATS
    raw: torch.Tensor
    columns: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.raw.shape[0], self.columns)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def __getitem__(self, index) -> "GGUFBlocks":
        """t[a:b] (rows), t[:, a:b] (columns at block boundaries) or t[:] (all)."""
        if isinstance(index, slice):
            return GGUFBlocks(self.format, self.raw[index], self.columns)
        rows, cols = index
        start, stop, step = cols.indices(self.columns)
        fmt = BLOCK_FORMATS[self.format]
        if step != 1 or start % fmt.weights or stop % fmt.weights:
            raise UnsupportedModelError(
                f"a {self.format} weight splits only at its blocks of {fmt.weights} columns "
                f"(asked for columns {start}:{stop}); pick a tensor-parallel size that "
                "divides it so")
        per = fmt.nbytes
        raw = self.raw[rows, start // fmt.weights * per:stop // fmt.weights * per]
        return GGUFBlocks(self.format, raw, stop - start)

    def dequantize(self) -> torch.Tensor:
        """The weights as float32 [rows, columns] (engine.quant.gguf_blocks' decoders)."""
        return dequantize(self.raw, self.format, self.columns)

    def permute_rows(self, order: torch.Tensor) -> "GGUFBlocks":
        return GGUFBlocks(self.format, self.raw[order], self.columns)


def unpermute_order(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation of `rows` rows of `heads`
    heads: HF row (h, half, i) is stored at GGUF row (h, i, half)."""
    dim = rows // heads
    return torch.arange(rows).view(heads, dim // 2, 2).transpose(1, 2).reshape(rows)


def iter_gguf_weights(path: Path) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
    """(Hugging Face name, tensor or GGUFBlocks) for every tensor of a GGUF llama file;
    float tensors are read as they are, quantized ones stay blocks (memory-mapped)."""
    index = GGUFIndex(path)
    arch = index.metadata.get("general.architecture")
    heads = index.metadata.get(f"{arch}.attention.head_count")
    kv_heads = index.metadata.get(f"{arch}.attention.head_count_kv") or heads
    for t in index.tensors:
        name = _hf_name(t.name)
        array = index.array(t)
        if t.type_name in BLOCK_FORMATS:  # the file's read-only map: nothing writes to it
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.from_numpy(array)
            value: torch.Tensor | GGUFBlocks = GGUFBlocks(t.type_name, raw, t.shape[0])
        else:
            value = torch.from_numpy(array.copy())
            if t.type_name == "BF16":
                value = value.view(torch.bfloat16)
        if arch in _PERMUTED_QK and name.endswith(("q_proj.weight", "k_proj.weight",
                                                   "q_proj.bias", "k_proj.bias")):
            n = heads if "q_proj" in name else kv_heads
            order = unpermute_order(value.shape[0], n)
            value = value.permute_rows(order) if isinstance(value, GGUFBlocks) else value[order]
        yield name, value


def _hf_name(gguf_name: str) -> str:
    match = _LAYER.fullmatch(gguf_name)
    key, layer = (match.group(2), match.group(1)) if match else (gguf_name, None)
    template = _NAMES.get(key)
    if template is None or ("{i}" in template) != (layer is not None):
        raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no place in a llama model")
    return template.format(i=layer)


# gguf's format object: the base's behaviour (a file's types are checked by
# engine.quant.check_gguf_types as the loader opens it, its tensors read as blocks)
GGUF = QuantFormat("gguf", tuple(BLOCK_FORMATS))


__all__ = ["GGUF", "GGUFBlocks", "iter_gguf_weights", "unpermute_order"]
