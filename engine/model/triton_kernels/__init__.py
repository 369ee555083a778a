"""Triton kernels for the CUDA engine: paged attention (paged_attention.py) and the
decoder layer's fused element-wise work (fused_ops.py).

Why Triton: one source compiles for the GPU the engine runs on, and the same kernels
run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1), so CI, which has no
GPU, checks them against torch references like any other code; a GPU is needed only to
time them. The interpreter has no bf16 arithmetic and no autotuning, so every launch
takes a fixed configuration (LaunchConfig) and CPU tests use float32 and float16.

Triton decides between compiling and interpreting when a kernel is defined, so
TRITON_INTERPRET must be set before these modules are first imported: availability()
says why the kernels cannot run on a device, or None when they can.
"""
from __future__ import annotations

import importlib.util
import os

import torch


def interpreting() -> bool:
    """Whether Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def availability(device: torch.device) -> str | None:
    """None where the Triton kernels can run on device, else the reason they cannot."""
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed"
    if device.type == "cuda":
        if interpreting():
            return "TRITON_INTERPRET=1 runs Triton's CPU interpreter, not the GPU"
        return None
    if device.type == "cpu":
        if not interpreting():
            return ("on CPU the Triton kernels run only under Triton's interpreter: set "
                    "TRITON_INTERPRET=1 before starting (slow; for tests)")
        return None
    return f"no Triton kernels for device {device}"


def fp8_cache_refusal(device: torch.device, capability: tuple[int, int] | None = None) -> str | None:
    """Why the Triton kernels cannot read an e4m3 KV cache on device, or None: Triton
    has e4m3 (fp8e4nv) on NVIDIA GPUs of compute capability 8.9 and later (Ada, Hopper)
    only; the interpreter has it everywhere. capability: the device's (default: read)."""
    if device.type != "cuda":
        return None
    major, minor = capability or torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return (f"the Triton kernels read an fp8 KV cache on GPUs of compute capability 8.9 "
                f"or later (Ada, Hopper), and this one is {major}.{minor}; use "
                "attention_backend torch with kv_cache_dtype fp8, or kv_cache_dtype auto")
    return None
