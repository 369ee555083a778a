"""Embeddings: PoolingParams (what a request asks, vLLM's name) and the Pooler that
turns an embedding request's hidden states into its vector.

An embedding request is prefilled like any prompt (chunked, batched with generation
requests) and samples nothing: each step hands the Pooler the final hidden states of
the request's tokens, and when the last chunk is in, the Pooler gives its vector.
The pooling follows the checkpoint's sentence-transformers config (1_Pooling/
config.json: mean, CLS or last token) when it has one, else the last token, which is
how decoder models are used as embedders.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from engine.errors import InvalidRequestError

if TYPE_CHECKING:  # the core messages import PoolingParams; only the Pooler runs torch
    import torch

POOLING_METHODS = ("last", "mean", "cls")


class PoolingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    normalize: bool = True  # L2-normalize the vector (cosine similarity by dot product)
    dimensions: int | None = None  # matryoshka truncation: only for models trained for it

    def __post_init__(self) -> None:
        if self.dimensions is not None and self.dimensions < 1:
            raise InvalidRequestError(f"dimensions must be >= 1, got {self.dimensions}")


def pooling_method(checkpoint: Path) -> str:
    """The checkpoint's sentence-transformers pooling, else "last"."""
    modules = checkpoint / "modules.json" if checkpoint.is_dir() else None
    if modules is None or not modules.exists():
        return "last"
    with open(modules, encoding="utf-8") as f:
        entries = json.load(f)
    for entry in entries:
        if entry.get("type", "").endswith("Pooling"):
            config = checkpoint / entry.get("path", "1_Pooling") / "config.json"
            if not config.exists():
                break
            with open(config, encoding="utf-8") as f:
                modes = json.load(f)
            if modes.get("pooling_mode_mean_tokens"):
                return "mean"
            if modes.get("pooling_mode_cls_token"):
                return "cls"
            break
    return "last"


class Pooler:
    def __init__(self, method: str, hidden_size: int) -> None:
        if method not in POOLING_METHODS:
            raise InvalidRequestError(f"pooling must be one of {POOLING_METHODS}")
        self.method = method
        self.hidden_size = hidden_size

    def check(self, params: PoolingParams) -> None:
        if params.dimensions is not None and params.dimensions != self.hidden_size:
            raise InvalidRequestError(
                f"dimensions: this model gives {self.hidden_size}-dimensional embeddings "
                "and was not trained for shorter ones")

    def add(self, request, hidden: torch.Tensor, first: bool) -> None:
        """hidden: [n, H] final hidden states of the request's tokens this step;
        first: they start at its first token."""
        if self.method == "mean":
            part = hidden.sum(dim=0)
            request.pool_sum = part if request.pool_sum is None else request.pool_sum + part
        elif self.method == "cls":
            if first:
                request.pool_sum = hidden[0].clone()
        else:
            request.pool_sum = hidden[-1].clone()

    def finish(self, request) -> list[float]:
        """The request's vector once every token is in."""
        vector = request.pool_sum
        if self.method == "mean":
            vector = vector / request.num_tokens
        if request.pooling.normalize:
            import torch
            vector = torch.nn.functional.normalize(vector, dim=0)
        request.pool_sum = None
        return vector.cpu().tolist()
