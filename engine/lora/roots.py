"""Where adapters may be loaded from (EngineConfig.allowed_lora_roots).

An adapter named at run time carries a host path (the load endpoint, an engine-core
request), and reading it means reading that host's files; so an engine that is told
its roots loads only from under them. Paths are compared after resolving symlinks and
`..`, so a link inside a root that points out of it is refused too. The adapters the
operator configured at start (lora_modules) are always allowed.
"""
from __future__ import annotations

import os
from pathlib import Path

from engine.config import EngineConfig


def lora_roots(config: EngineConfig) -> list[Path] | None:
    """The resolved folders adapters may come from, or None where any folder may."""
    if config.allowed_lora_roots is None:
        return None
    roots = [p for p in config.allowed_lora_roots.split(os.pathsep) if p]
    roots += [str(p) for p in (config.lora_modules or {}).values()]
    return [Path(p).resolve() for p in roots]


def path_within(path: str, roots: list[Path]) -> bool:
    """Whether `path`, resolved, is one of `roots` or lies under one."""
    resolved = Path(path).resolve()
    return any(resolved.is_relative_to(root) for root in roots)
