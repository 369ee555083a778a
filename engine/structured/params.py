"""StructuredOutputsParams: the one constraint a request's output must satisfy.

A msgspec Struct inside SamplingParams, so it crosses the engine-core wire with the
request. It only says what is asked; checking that it compiles is grammar.py's job
(the frontend does it before the request travels).
"""
from __future__ import annotations

import json as _json
from typing import Any

import msgspec

from engine.errors import InvalidRequestError


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True, frozen=True):
    """Exactly one of: a JSON schema, any JSON object, a regex, a choice, an EBNF grammar.

    json accepts a dict (offline callers) and keeps it as JSON text, so the wire form
    and the compile cache key are one string per schema."""

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # Token ids that end a reasoning model's thinking (e.g. `</think>`): the constraint
    # holds from the token after them; before, the output is free. None: from the start.
    reasoning_end: list[int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            msgspec.structs.force_setattr(self, "json", _json.dumps(self.json))
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise InvalidRequestError(
                "structured outputs take exactly one of json, json_object, regex, choice, "
                f"grammar; got {given or 'none'}")
        if self.choice is not None and (
                not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError("structured outputs choice must be a non-empty list of "
                                      "non-empty strings")
        if self.reasoning_end is not None:
            ids = self.reasoning_end
            if (not isinstance(ids, (list, tuple)) or not ids
                    or not all(type(t) is int and t >= 0 for t in ids)):
                raise InvalidRequestError("structured outputs reasoning_end must be a "
                                          "non-empty list of token ids (ints >= 0)")
            if isinstance(ids, tuple):
                msgspec.structs.force_setattr(self, "reasoning_end", list(ids))

    @property
    def kind(self) -> str:
        return "json_object" if self.json_object else next(
            name for name in ("json", "regex", "choice", "grammar")
            if getattr(self, name) is not None)

    def cache_key(self) -> bytes:
        """The same constraint gives the same key (the compiled grammar is reused).
        reasoning_end is left out: it says when the grammar starts, not what it is, so
        one grammar compiles once whatever ends the thinking before it."""
        if self.reasoning_end is not None:
            return msgspec.msgpack.encode(msgspec.structs.replace(self, reasoning_end=None))
        return msgspec.msgpack.encode(self)
