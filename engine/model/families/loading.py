"""The shared checkpoint loader: a checkpoint's tensors into a decoder's fused parameters.

Every family's network (engine.model.families.base.DecoderForCausalLM and its
subclasses) loads through load_checkpoint: Hugging Face names, this rank's slice of each
tensor (q/k/v and gate/up into their fused rows, o_proj and down_proj by input, the
embedding and LM head by vocabulary rows), quantized weights kept by their holders. A
family with tensors laid out its own way says so through the model's hooks
(checkpoint_name, load_family_tensor, expected_loads) rather than a loader of its own.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from engine.errors import UnsupportedModelError
from engine.executor.parallel import ShardPlan
from engine.model.shape import ModelShape
from engine.quant.gguf_weights import GGUFBlocks
from engine.quant.holding import QuantizedPieces

Slice = tuple[int, int, int]  # (dim, start, length) of the checkpoint tensor
ROW_PARALLEL = ("o_proj", "down_proj")  # split by input: biases stay whole
VOCAB_PARALLEL = ("embed_tokens", "lm_head")  # split by vocabulary rows


def load_checkpoint(model: nn.Module, weights: Iterable[tuple[str, Any]], holder: Any = None,
                    fp8_block: tuple[int, int] | None = None) -> int:
    """Copy this rank's slice of each checkpoint tensor (HF names) into the model's fused
    parameters (see DecoderForCausalLM.load_weights for the arguments; the model gives
    shape, plan, tp and the family hooks). Returns how many parameters came quantized;
    raises UnsupportedModelError naming any parameter the checkpoint left unset."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    quantized = QuantizedPieces(holder, model.tp is not None, fp8_block)
    rules = shard_rules(model.shape, model.plan)
    for name, tensor in weights:
        if "rotary_emb" in name:
            continue
        if name.startswith("model."):
            name = name[len("model."):]
        if name == "lm_head.weight" and model.shape.tie_word_embeddings:
            continue
        name = model.checkpoint_name(name)
        if model.load_family_tensor(name, tensor, loaded):
            continue
        parts = name.split(".")
        module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", name)
        target, offset, src = name, None, None
        if module in rules:
            fused_name, offset, src = rules[module]
            target = ".".join(parts[:-2] + [fused_name, kind])
            if kind == "bias" and module in ROW_PARALLEL:
                src = None  # a row-parallel bias is whole, on rank 0 only
                if target not in params:
                    continue
        if module == "self_attn" and kind in ("k_scale", "v_scale"):  # an fp8 cache's
            attn = model.get_submodule(".".join(parts[:-1]))
            attn.checkpoint_kv_scales = {**attn.checkpoint_kv_scales,
                                         kind: _scalar(tensor)}
            continue
        if quantized.take_sidecar(kind, target, offset, src, tensor, params):
            continue
        param = params.get(target)
        if param is None:
            raise UnsupportedModelError(f"unexpected checkpoint tensor {name!r}")
        piece = read_slice(tensor, src)
        if quantized.take_weight(name, kind, target, offset, piece, param):
            loaded.add(f"{target}:{offset}")
            continue
        if isinstance(piece, GGUFBlocks):
            piece = piece.dequantize()
        with torch.no_grad():
            if module in VOCAB_PARALLEL and piece.shape[0] < param.shape[0]:
                param.zero_()  # padding rows past the vocabulary stay zero
            dst = param.narrow(0, offset or 0, piece.shape[0]) \
                if offset is not None or module in VOCAB_PARALLEL else param
            if dst.shape != piece.shape:
                raise UnsupportedModelError(
                    f"checkpoint tensor {name!r} has shape {tuple(piece.shape)}, "
                    f"expected {tuple(dst.shape)}")
            dst.copy_(piece)
        loaded.add(f"{target}:{offset}")
    expected = model.expected_loads(params, rules)
    missing = sorted(expected - loaded)
    if missing:
        raise UnsupportedModelError(f"checkpoint is missing tensors for {missing[:5]}")
    quantized.finish(model, params, model.shape.tie_word_embeddings)
    return quantized.count()


def expected_keys(params: dict, rules: dict) -> set[str]:
    """What load_checkpoint notes once every parameter is in: each at its offsets."""
    return {f"{n}:{o}" for n in params for o in offsets(n, rules)}


def shard_rules(s: ModelShape, plan: ShardPlan) -> dict[str, tuple[str, int | None, Slice]]:
    """checkpoint module name -> (fused parameter, row offset in it, source slice), for
    weights and biases alike (row-parallel biases excepted, see load_checkpoint)."""
    d, h, kv, inter = s.head_dim, plan.num_heads, plan.num_kv_heads, plan.intermediate_size
    q_src = (0, plan.head_start * d, h * d)
    kv_src = (0, plan.kv_head_start * d, kv * d)
    mlp_src = (0, plan.rank * inter, inter)
    vocab = (0, plan.vocab_start, min(plan.vocab_per_rank, s.vocab_size - plan.vocab_start))
    return {"q_proj": ("qkv_proj", 0, q_src), "k_proj": ("qkv_proj", h * d, kv_src),
            "v_proj": ("qkv_proj", (h + kv) * d, kv_src),
            "gate_proj": ("gate_up_proj", 0, mlp_src),
            "up_proj": ("gate_up_proj", inter, mlp_src),
            "o_proj": ("o_proj", None, (1, plan.head_start * d, h * d)),
            "down_proj": ("down_proj", None, (1, plan.rank * inter, inter)),
            "embed_tokens": ("embed_tokens", None, vocab),
            "lm_head": ("lm_head", None, vocab)}


def read_slice(tensor, src: Slice | None) -> torch.Tensor:
    """The source slice of a tensor or lazy safetensors slice, as a tensor."""
    if src is None:
        return tensor[:] if not isinstance(tensor, torch.Tensor) else tensor
    dim, start, length = src
    if dim == 0:
        return tensor[start:start + length]
    return tensor[:, start:start + length]


def _scalar(tensor) -> float:
    """A one-value tensor or lazy safetensors slice ([] or [1]) as a float."""
    t = tensor if isinstance(tensor, torch.Tensor) else tensor[...]
    return float(t.reshape(-1)[0])


def offsets(param_name: str, rules: dict) -> list:
    """The row offsets a parameter is filled at (several for fused ones)."""
    fused = param_name.split(".")[-2] if "." in param_name else ""
    return [offset for target, offset, _ in rules.values() if target == fused] or [None]


__all__ = ["ROW_PARALLEL", "Slice", "VOCAB_PARALLEL", "expected_keys", "load_checkpoint",
           "offsets", "read_slice", "shard_rules"]
