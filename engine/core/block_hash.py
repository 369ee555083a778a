"""Prefix-cache block hashes, computed the same way in every process.

Why one place: the engine names its cached KV blocks by these hashes and publishes
them (KV events); the frontend's router hashes a prompt's full blocks the same way to
find how much of it each engine holds. Both sides must get the same numbers, so the
chain only hashes ints and tuples of ints, whose hashes do not depend on the process
(PYTHONHASHSEED randomizes str hashes; Python 3.11's hash(None) is an address).

A block's hash is hash((parent hash, its token ids)); the first block's parent is the
root seed of the model the KV was computed under (the base model, or one adapter).
The engine still compares the full identity (tokens and adapter) on a hit, so a hash
collision can never hand out the wrong KV; here it could at worst misroute a request.
"""
from __future__ import annotations

import zlib
from collections.abc import Sequence

from engine.lora.request import LoRARequest

# The parent of a base-model prompt's first block (any fixed int: the FNV-64 offset basis).
BASE_ROOT_SEED = 0xCBF29CE484222325


def root_seed(lora: LoRARequest | None = None) -> int:
    """The first block's parent: the base model's seed, or one derived from the adapter's
    id and path (KV computed under one adapter is never another's)."""
    if lora is None:
        return BASE_ROOT_SEED
    return hash((lora.lora_int_id, zlib.crc32(lora.lora_path.encode())))


def block_hash(parent: int, tokens: tuple[int, ...]) -> int:
    """The hash of a full block of `tokens` following the block hashed `parent`."""
    return hash((parent, tokens))


def prefix_block_hashes(token_ids: Sequence[int], block_size: int,
                        lora: LoRARequest | None = None,
                        max_blocks: int | None = None) -> list[int]:
    """The hash chain of the full blocks of token_ids (at most max_blocks of them)."""
    full = len(token_ids) // block_size
    if max_blocks is not None:
        full = min(full, max_blocks)
    hashes: list[int] = []
    parent = root_seed(lora)
    for i in range(full):
        parent = hash((parent, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        hashes.append(parent)
    return hashes


def cacheable_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading full blocks of a prompt an engine can serve from its cache: at
    least one token is always computed, so that the request gets logits."""
    return max(0, (num_tokens - 1) // block_size)
