"""What the CPU can run, as the engine's defaults see it: its feature flags, held to a
narrower x86 level when the kernels are.

FLOTILLA_KERNELS_MARCH=x86-64-v3 builds and runs the native kernels' AVX2 path on a
wider CPU (engine.model.kernels). The engine's other choices read the CPU's flags
(dtype "auto", bf16 packing, the GGUF kernels' crossovers), so they are held to the
same level here: on a Zen 4 held to x86-64-v3 they are what they would be on a Zen 3.
That is how CI checks the AVX2 path on whatever CPU it draws (`make test`'s held leg).
"""
from __future__ import annotations

import functools
import os

# Flags a CPU of each x86-64 level may lack, by prefix (x86-64-v3 is AVX2 + FMA + F16C +
# BMI; v2 adds nothing past SSE4.2 and POPCNT; the baseline is SSE2).
_BEYOND_V3 = ("avx512", "amx", "avx_", "avx10")
_BEYOND_V2 = _BEYOND_V3 + ("avx", "fma", "f16c", "bmi", "movbe", "abm")
_BEYOND_V1 = _BEYOND_V2 + ("pni", "ssse3", "sse4", "popcnt", "cx16")
_BEYOND = {"x86-64-v4": (), "x86-64-v3": _BEYOND_V3, "x86-64-v2": _BEYOND_V2,
           "x86-64": _BEYOND_V1}


def kernels_march() -> str:
    """The -march the engine's native kernels are built for: $FLOTILLA_KERNELS_MARCH, else
    native (this CPU's own)."""
    return os.environ.get("FLOTILLA_KERNELS_MARCH") or "native"


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo's first "flags" line; empty where there is
    none), less those past the x86 level the kernels are held to (kernels_march)."""
    return _held_flags(kernels_march())


@functools.cache
def _held_flags(march: str) -> frozenset[str]:
    flags = _proc_flags()
    beyond = _BEYOND.get(march, ())
    return frozenset(f for f in flags if not f.startswith(beyond))


@functools.cache
def _proc_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return frozenset()


def cpu_has_native_bf16() -> bool:
    """True when the CPU runs bf16 dot products natively (avx512_bf16 or AMX)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def missing_bf16_message() -> str:
    """Why bf16 is refused on this CPU, naming the features it lacks."""
    held = kernels_march()
    where = (f"this CPU (held to {held} by FLOTILLA_KERNELS_MARCH)" if held in _BEYOND
             else "this CPU")
    return (f"dtype bfloat16 needs a CPU with native bf16 dot products (the avx512_bf16 or "
            f"amx_bf16 feature); {where} has neither, so every bf16 matmul would be "
            f"emulated. Use --dtype float32, or auto (float32 on this CPU).")
