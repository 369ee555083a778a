"""Aggregation rules for utility results gathered from several engines (docs/architecture.md)."""
from __future__ import annotations

from typing import Any, Sequence

from engine.errors import InconsistentUtilityResults, NoEnginesError


def consensus(method: str, values: Sequence[Any]) -> Any:
    """The one value every engine returned; disagreement is an error, never a guess."""
    if not values:
        raise NoEnginesError(f"no engine answered {method}")
    first = values[0]
    if any(v != first for v in values[1:]):
        raise InconsistentUtilityResults(method, list(values))
    return first


def all_true(method: str, values: Sequence[Any]) -> bool:
    """AND of the engines' booleans (e.g. reset_prefix_cache)."""
    if not values:
        raise NoEnginesError(f"no engine answered {method}")
    return all(bool(v) for v in values)
