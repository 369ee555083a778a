"""What a hybrid (attention + state-space) model changes in the engine's config.

A request's recurrent state lives in one block of the paged cache (each Mamba layer's
share of the block holds the state in that layer), so a block must be large enough to
hold it: the attention block size is raised, to a power of two, until a layer's block
holds a state, the way vLLM aligns the attention block to the state's page. The
aligned block_size is the engine's from then on, and reaches the frontend (and
`vllm:cache_config_info`) in the ready handshake.

Prefix caching is turned off: a cached block would have to carry the state as it was at
that block's end, which is not kept (vLLM started the same way). Tensor parallelism,
LoRA and an fp8 cache are refused by name.
"""
from __future__ import annotations

import dataclasses
import logging

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.model.shape import ModelShape

logger = logging.getLogger(__name__)


def state_block_size(shape: ModelShape, block_size: int) -> int:
    """The smallest power of two >= block_size whose block of one layer (keys and values
    of every kv head) holds a request's state in one Mamba layer."""
    per_token = 2 * shape.num_kv_heads * shape.head_dim
    size = block_size
    while size * per_token < shape.mamba.state_elements:
        size *= 2
    return size


def hybrid_config(config: EngineConfig, shape: ModelShape) -> EngineConfig:
    """config as a hybrid model is served with it (module docstring); raises
    InvalidRequestError for what it cannot be served with."""
    refused = [what for what, on in (
        (f"tensor_parallel_size {config.tensor_parallel_size}", config.tensor_parallel_size > 1),
        ("enable_lora", config.enable_lora),
        (f"kv_cache_dtype {config.kv_cache_dtype}", config.kv_cache_dtype not in ("auto",)))
        if on]
    if refused:
        raise InvalidRequestError(f"{shape.architecture} (a hybrid of attention and Mamba "
                                  f"layers) is not served with {', '.join(refused)}")
    size = state_block_size(shape, config.block_size)
    if size != config.block_size:
        logger.info("block_size %d -> %d: a block holds a request's Mamba state (%d "
                    "elements a layer)", config.block_size, size, shape.mamba.state_elements)
    if config.enable_prefix_caching:
        logger.info("prefix caching is off for %s: its Mamba states are not cached",
                    shape.architecture)
    return dataclasses.replace(config, block_size=size, enable_prefix_caching=False)


__all__ = ["hybrid_config", "state_block_size"]
