"""Optional native CPU kernels, compiled once per machine with torch's C++ extension tools.

The engine works without them (pure torch ops); when a compiler is present the
attention kernel reads the paged cache directly instead of gathering it.
Set FLOTILLA_NATIVE_KERNELS=0 to use the torch path (this also turns off the
oneDNN-prepacked linear weights of engine.model.layers.linear).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)
_DIR = Path(__file__).parent
_SOURCES = [_DIR / n for n in ("bindings.cpp", "paged_attention.cpp", "fused_ops.cpp")]
_HEADERS = [_DIR / n for n in ("convert.h", "simd.h")]


def _build_tag() -> str:
    """Builds use -march=native, so the cache is keyed by the CPU they were built for,
    and by the sources and headers (a changed header alone rebuilds too)."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    digest = hashlib.sha256(flags.encode())
    for path in _SOURCES + _HEADERS:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def native_enabled() -> bool:
    """False when FLOTILLA_NATIVE_KERNELS=0 asks for plain torch ops everywhere."""
    return os.environ.get("FLOTILLA_NATIVE_KERNELS", "1") != "0"


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The compiled CPU kernel module, or None when disabled or unbuildable."""
    if not native_enabled():
        return None
    try:
        import torch
        from torch.utils import cpp_extension

        from engine.model.loader import cache_root
        build = cache_root() / "kernels" / f"torch{torch.__version__}-{_build_tag()}"
        build.mkdir(parents=True, exist_ok=True)
        return cpp_extension.load(
            name="flotilla_cpu_kernels", sources=[str(p) for p in _SOURCES], build_directory=str(build),
            extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"], extra_ldflags=["-fopenmp"],
            verbose=False)
    except Exception as exc:  # no compiler, no headers, ...: fall back to torch ops
        logger.warning("native CPU kernels unavailable (%s); using torch ops", exc)
        return None
