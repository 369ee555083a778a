"""The one way every API (OpenAI, Responses, Anthropic) turns a request into
SamplingParams, so that a field a request leaves unset means the same on each.

A field of the model's sampling defaults (engine/generation_defaults.py:
SAMPLING_KEYS) that the request leaves unset takes the model's value when its
generation_config has one, else SamplingParams' own default, which is the neutral
value (temperature 1, top_p 1, top_k off, min_p 0, repetition_penalty 1): those
neutral values are written once, in engine/sampling_params.py. Each API maps only its
own field names onto these.
"""
from __future__ import annotations

from typing import Any, Mapping

from engine.generation_defaults import SAMPLING_KEYS
from engine.sampling_params import SamplingParams


def build_sampling_params(defaults: Mapping[str, int | float] | None,
                          given: Mapping[str, Any], **fields: Any) -> SamplingParams:
    """defaults: the model's sampling defaults (EngineClient.sampling_defaults); given:
    the request's values of those fields (SAMPLING_KEYS names; None: not set); fields:
    every other SamplingParams field, passed as is."""
    unknown = set(given) - set(SAMPLING_KEYS)
    if unknown:  # a caller's mistake: such a field would skip the model's defaults
        raise ValueError(f"not a field with a model default: {sorted(unknown)}")
    chosen = dict(defaults or {})
    chosen.update((name, value) for name, value in given.items() if value is not None)
    return SamplingParams(**chosen, **fields)
