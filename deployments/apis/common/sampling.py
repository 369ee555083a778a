"""The one way every API (OpenAI, Responses, Anthropic) turns a request into
SamplingParams, so that a field a request leaves unset means the same on each, and a
value out of range gets the same answer on each.

A field of the model's sampling defaults (engine/generation_defaults.py:
SAMPLING_KEYS) that the request leaves unset takes the model's value when its
generation_config has one, else SamplingParams' own default, which is the neutral
value (temperature 1, top_p 1, top_k off, min_p 0, repetition_penalty 1): those
neutral values are written once, in engine/sampling_params.py. Each API maps only its
own field names onto these.

Ranges are checked once too, by SamplingParams.__post_init__ (the rule the engines
apply to whatever reaches their socket); the request models only document them
(documented_range) and check what is the API's own (OpenAI's temperature up to 2,
Anthropic's up to 1, 64-bit integers, ...). A refusal is an InvalidRequestError naming
the field, which the endpoint wrapper answers with a 400; build_sampling_params runs in
the handler, before any stream starts.
"""
from __future__ import annotations

from typing import Any, Mapping

from pydantic import Field

from engine.errors import InvalidRequestError
from engine.generation_defaults import SAMPLING_KEYS
from engine.sampling_params import SamplingParams


def build_sampling_params(defaults: Mapping[str, int | float] | None,
                          given: Mapping[str, Any], *,
                          names: Mapping[str, str] | None = None,
                          **fields: Any) -> SamplingParams:
    """defaults: the model's sampling defaults (EngineClient.sampling_defaults); given:
    the request's values of those fields (SAMPLING_KEYS names; None: not set); names:
    the API's name of a SamplingParams field where it has another (chat's top_logprobs
    is SamplingParams' logprobs), for the `param` of a refusal; fields: every other
    SamplingParams field, passed as is."""
    unknown = set(given) - set(SAMPLING_KEYS)
    if unknown:  # a caller's mistake: such a field would skip the model's defaults
        raise ValueError(f"not a field with a model default: {sorted(unknown)}")
    chosen = dict(defaults or {})
    chosen.update((name, value) for name, value in given.items() if value is not None)
    try:
        return SamplingParams(**chosen, **fields)
    except InvalidRequestError as exc:
        renamed = (names or {}).get(exc.param or "")
        if renamed is None:
            raise
        raise InvalidRequestError(f"{renamed}: {exc}", param=renamed) from None


class _DocumentedBounds:
    """json_schema_extra that writes bounds into a field's JSON schema: into its number
    branch when the field is nullable (where pydantic writes a checked bound)."""

    def __init__(self, bounds: dict[str, float]) -> None:
        self.bounds = bounds

    def __call__(self, schema: dict[str, Any]) -> None:
        branches = [s for s in schema.get("anyOf", ()) if s.get("type") != "null"]
        for target in branches or [schema]:
            target.update(self.bounds)


def documented_range(default: Any, *, minimum: float | None = None,
                     exclusive_minimum: float | None = None, maximum: float | None = None,
                     **checked: Any) -> Any:
    """A request model's Field whose range is documented, not checked, here.

    Why: SamplingParams.__post_init__ checks the range, once for every API and again
    for anything that reaches an engine directly, and its refusal names the field (a
    400), so a pydantic ge=/gt=/le= of the same bound was the same rule written twice.
    The OpenAPI document (/openapi.json) still shows the bounds (minimum,
    exclusiveMinimum, maximum). `checked`: Field constraints that are the API's own
    and pydantic does check (temperature's le=2.0 on OpenAI's endpoints, lt=1 << 63)."""
    bounds = {key: value for key, value in (("minimum", minimum),
                                             ("exclusiveMinimum", exclusive_minimum),
                                             ("maximum", maximum)) if value is not None}
    return Field(default, json_schema_extra=_DocumentedBounds(bounds), **checked)
