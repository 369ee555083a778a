"""EngineConfig: every engine knob in one frozen, checked object.

Built once (by LLM, the CLI or the engine-core server) and handed to the
Scheduler, the KV cache and the model runner; nothing else threads kwargs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.errors import InvalidRequestError

_DTYPES = {"auto": None, "float32": torch.float32, "fp32": torch.float32,
           "float": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}

# Measured on the 2-core CPU machine (docs/benchmarks.md): bf16 beats fp32 by about 1.35x
# on SmolLM2 W1 where the CPU has avx512_bf16; elsewhere bf16 matmuls are emulated and slow.
CPU_DEFAULT_KV_CACHE_BYTES = 2 << 30


@dataclass(frozen=True)
class EngineConfig:
    """Engine options; names follow vLLM's engine arguments."""

    model: str = "default"
    dtype: str = "auto"
    device: str = "auto"  # auto: cuda when available, else cpu
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    kv_cache_memory_bytes: int | None = None  # CPU budget (default 2 GiB); on GPU overrides
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None  # exact KV pool size (tests, debugging)
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch intra-op threads on CPU; None: engine default
    seed: int = 0
    tensor_parallel_size: int = 1
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        checks = [
            (self.dtype in _DTYPES, f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}"),
            (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
             f"device must be auto, cpu or cuda[:N], got {self.device!r}"),
            (self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
             f"block_size must be a power of two, got {self.block_size}"),
            (self.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1"),
            (self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be >= 1"),
            (self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
             "kv_cache_memory_bytes must be > 0"),
            (0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be in (0, 1]"),
            (self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 1,
             "num_gpu_blocks_override must be >= 1"),
            (self.num_threads is None or self.num_threads >= 1, "num_threads must be >= 1"),
            (self.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        chosen = _DTYPES[self.dtype]
        if chosen is not None:
            return chosen
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def cpu_has_native_bf16() -> bool:
    """True when the CPU runs bf16 dot products natively (avx512_bf16 or AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
