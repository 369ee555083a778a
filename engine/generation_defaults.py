"""Sampling defaults: the model's generation_config.json, as vLLM's --generation-config.

A request that leaves temperature, top_p, top_k, min_p or repetition_penalty unset
gets the model author's value (SmolLM2 ships none, so its defaults stay neutral);
the server's override_generation_config takes precedence over the file, and anything
the request sets takes precedence over both. The engine reads them (it owns the
checkpoint) and reports them in its READY answer, so every frontend applies the same
values.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from engine.errors import InvalidRequestError

logger = logging.getLogger(__name__)

# generation_config.json keys that become SamplingParams defaults (same names).
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(checkpoint: Path, source: str,
                      overrides: dict[str, Any] | None) -> dict[str, float | int]:
    """source: "auto" (the checkpoint's file), "vllm" (none: neutral defaults) or a
    folder holding a generation_config.json."""
    values: dict[str, Any] = {}
    if source != "vllm":
        folder = checkpoint if source == "auto" else Path(source).expanduser()
        path = folder / "generation_config.json" if folder.is_dir() else None
        if source != "auto" and (path is None or not path.exists()):
            raise InvalidRequestError(f"generation_config: no generation_config.json in "
                                      f"{source!r} (auto, vllm or a folder holding one)")
        if path is not None and path.exists():
            with open(path, encoding="utf-8") as f:
                values = {k: v for k, v in json.load(f).items() if k in SAMPLING_KEYS}
    unknown = sorted(set(overrides or {}) - set(SAMPLING_KEYS))
    if unknown:
        raise InvalidRequestError(f"override_generation_config: unknown keys {unknown}; "
                                  f"known: {', '.join(SAMPLING_KEYS)}")
    values.update(overrides or {})
    if values:  # wrong types and out-of-range values fail at start, not per request
        import msgspec

        from engine.sampling_params import SamplingParams
        try:
            msgspec.convert(values, SamplingParams)
        except msgspec.ValidationError as exc:
            raise InvalidRequestError(f"sampling defaults {values}: {exc}") from None
    return values
