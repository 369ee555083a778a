"""Optional native CPU kernels, compiled once per machine with torch's C++ extension tools.

The engine works without them (pure torch ops); when a compiler is present the
attention kernel reads the paged cache directly instead of gathering it.
Set FLOTILLA_NATIVE_KERNELS=0 to use the torch path (this also turns off the packed
linear weights of engine.model.layers.linear: the kernels' own matmul and oneDNN's).
FLOTILLA_KERNELS_MARCH=x86-64-v3 makes the engine build and run a narrower CPU family's
path (here AVX2 + FMA) on a wider CPU, so that path can be measured end to end on a
machine of another type (bench/throughput.py --isa avx2); the default is this CPU's own.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import sys
import time
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)
_DIR = Path(__file__).parent
_SOURCES = [_DIR / n for n in ("bindings.cpp", "paged_attention.cpp", "fused_ops.cpp",
                                   "linear.cpp", "quant_linear.cpp", "quant_regrouped.cpp",
                                   "int8_linear.cpp", "fp8_linear.cpp",
                                   "decoder_stack.cpp")]
_HEADERS = [_DIR / n for n in ("amx.h", "convert.h", "quant_regrouped.h",
                                   "quant_regrouped_avx2.h", "simd.h", "vec.h")]


def _cflags(march: str) -> list[str]:
    return ["-O3", f"-march={march}", "-ffast-math", "-fopenmp", "-Wno-psabi"]


def _build_tag(march: str) -> str:
    """Builds target -march=native by default, so the cache is keyed by the CPU they
    were built for, by the target and flags, by the Python ABI, and by the sources and
    headers (a changed header alone rebuilds too): a library in the folder of a tag is
    the build of exactly this code for this machine, whichever checkout made it."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    digest = hashlib.sha256(f"{march}\n{flags}\n{_cflags(march)}\n{sys.implementation.cache_tag}"
                            .encode())
    for path in _SOURCES + _HEADERS:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def native_enabled() -> bool:
    """False when FLOTILLA_NATIVE_KERNELS=0 asks for plain torch ops everywhere."""
    return os.environ.get("FLOTILLA_NATIVE_KERNELS", "1") != "0"


def cpu_kernels(march: str | None = None) -> ModuleType | None:
    """The compiled CPU kernel module, or None when disabled or unbuildable.

    `march` is the -march target: "native" vectorizes for this CPU (AVX-512, AVX2 + FMA,
    NEON); a narrower target such as "x86-64-v3" (AVX2) or "x86-64" (SSE2) builds that
    CPU family's path on a wider machine, for tests and benchmarks. Left out, it is what
    the engine runs: $FLOTILLA_KERNELS_MARCH, else native. The module's `isa` says which
    path it holds."""
    return _build(march or os.environ.get("FLOTILLA_KERNELS_MARCH") or "native")


def staged_sources(build: Path) -> list[Path]:
    """The sources and headers copied into the build's own folder, and the sources'
    paths there. torch's build records the absolute paths of the sources it compiled
    and rebuilds when they change, so building from the checkout made every other
    checkout of the same code (a developer's tree, CI's fresh clones, a deployment)
    rebuild for a minute and a half and evict the others' build. The build folder is
    keyed by the sources' content, so its copies' paths are the same for every checkout.
    A copy is written only when missing or different: a new mtime would rebuild too."""
    staged = build / "src"
    staged.mkdir(parents=True, exist_ok=True)
    for path in _SOURCES + _HEADERS:
        target = staged / path.name
        data = path.read_bytes()
        if not target.exists() or target.read_bytes() != data:
            target.write_bytes(data)
    return [staged / p.name for p in _SOURCES]


def import_library(name: str, library: Path) -> ModuleType:
    """A built kernel library imported directly. torch's own loader would rerun ninja,
    whose build file names this environment's torch headers by absolute path, so a
    checkout with its own virtualenv (CI's fresh clones) rebuilt for a minute and a half
    what the tag says is already built."""
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def _build(march: str) -> ModuleType | None:
    """cpu_kernels for one resolved target, built (or loaded) once per process."""
    if not native_enabled():
        return None
    try:
        import torch
        from torch.utils import cpp_extension

        from engine.model.loader import cache_root
        build = cache_root() / "kernels" / f"torch{torch.__version__}-{_build_tag(march)}"
        suffix = "" if march == "native" else "_" + "".join(c if c.isalnum() else "_" for c in march)
        name = "flotilla_cpu_kernels" + suffix
        library, ready = build / f"{name}.so", build / f"{name}.ready"
        if ready.exists():  # built before, by any checkout or environment: load it as is
            try:
                return import_library(name, library)
            except Exception as exc:  # damaged or foreign: build it again
                logger.warning("rebuilding the native CPU kernels: %s did not load (%s)",
                               library, exc)
                ready.unlink(missing_ok=True)
        before = library.stat().st_mtime_ns if library.exists() else None
        started = time.monotonic()
        module = cpp_extension.load(
            name=name, sources=[str(p) for p in staged_sources(build)],
            build_directory=str(build), extra_ldflags=["-fopenmp"], verbose=False,
            extra_cflags=_cflags(march))
        ready.touch()  # only now: another process never imports a library being linked
        if library.stat().st_mtime_ns != before:  # the start that paid says why it was slow
            logger.warning("compiled the native CPU kernels (%s, -march=%s) in %.0f s; cached "
                           "in %s for every later start (make setup builds them ahead)",
                           module.isa, march, time.monotonic() - started, build)
        return module
    except Exception as exc:  # no compiler, no headers, ...: fall back to torch ops
        logger.warning("native CPU kernels unavailable (%s); using torch ops", exc)
        return None
