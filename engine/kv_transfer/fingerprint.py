"""The fingerprint of a KV pool: what must match for one engine's blocks to be another's.

Why: a block's hash names its tokens (and adapter), not the weights or the layout that
computed it. Two engines sharing a tier directory, or pulling KV from each other, must
also agree on the checkpoint, the activation and cache dtypes, the block size, the
cache layout and the tensor-parallel shape; a block from an engine that differs in any
of these would be read as wrong KV, not refused. So every transfer is keyed (the disk
tier's folder) or checked by this fingerprint.

The checkpoint is identified by its files' names, sizes and the hash of their first
MiB (a safetensors or GGUF header and the start of its tensors): cheap to read at
start, and different for a fine-tune of the same shapes. Python's tuple hash, which
the block hashes use, is folded in too (it may differ between Python builds).
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import torch

HEAD_BYTES = 1 << 20
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")


def checkpoint_signature(checkpoint: Path, load_format: str) -> str:
    """Names, sizes and the first MiB's hash of a checkpoint's weight files ("dummy"
    weights are the same everywhere: seeded)."""
    if load_format == "dummy":
        return "dummy-weights"
    files = [checkpoint] if checkpoint.is_file() else sorted(
        p for p in checkpoint.iterdir() if p.suffix in _WEIGHT_SUFFIXES)
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            digest.update(f.read(HEAD_BYTES))
    return digest.hexdigest()


def pool_fingerprint(checkpoint_sig: str, architecture: str, dtype: torch.dtype,
                     kv_dtype: torch.dtype, block_size: int, block_shape: tuple[int, ...],
                     layout: str, tensor_parallel_size: int) -> str:
    """16 hex digits naming everything a block's bytes depend on besides its tokens."""
    parts = [checkpoint_sig, architecture, str(dtype), str(kv_dtype), str(block_size),
             "x".join(map(str, block_shape)), layout, str(tensor_parallel_size),
             sys.implementation.cache_tag, str(sys.hash_info.width)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


__all__ = ["checkpoint_signature", "pool_fingerprint"]
