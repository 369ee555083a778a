"""RequestLimits: what one request may ask, so that no request stalls an engine or an
ingress for everyone else.

Without caps, stop strings are scanned on the ingress event loop for every token
(50,000 of them fit under the 1 MiB body limit), bad words are matched on the engine
thread for every row every step, logit_bias and allowed_token_ids grow the per-request
tensors, one completions request could fan out to 64 prompts x n = 128 sequences, and
a structured-outputs constraint of any size went to the grammar compiler.
The limits are EngineConfig options (declared there once, engine.config.LIMIT_OPTIONS);
engines announce theirs in the handshake, so the frontend refuses early with the same
numbers, and engines check again, since anything can reach their socket. Each refusal
is an InvalidRequestError (HTTP 400) that names the option.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from engine.errors import InvalidRequestError

if TYPE_CHECKING:  # sampling_params is above this module
    from engine.sampling_params import SamplingParams


class RequestLimits(msgspec.Struct, frozen=True, kw_only=True):
    """The limit options of an EngineConfig (each field is the option of that name)."""

    max_stop_strings: int
    max_stop_string_chars: int
    max_bad_words: int
    max_bad_word_chars: int
    max_logit_bias: int
    max_allowed_token_ids: int
    max_sequences_per_request: int
    max_structured_output_chars: int

    @classmethod
    def of(cls, config) -> "RequestLimits":
        """The limits an EngineConfig sets."""
        from engine.config import LIMIT_OPTIONS
        return cls(**{name: getattr(config, name) for name in LIMIT_OPTIONS})

    @classmethod
    def defaults(cls) -> "RequestLimits":
        from engine.config import EngineConfig
        return cls.of(EngineConfig())

    def tightest(self, other: "RequestLimits") -> "RequestLimits":
        """Field by field the smaller: what every one of several engines accepts."""
        return RequestLimits(**{f: min(getattr(self, f), getattr(other, f))
                                for f in self.__struct_fields__})


def _refuse(what: str, count: int, limit: int, option: str) -> None:
    if count > limit:
        raise InvalidRequestError(f"{what}: {count}, more than this server allows: "
                                  f"{limit} ({option})")


def check_limits(params, limits: RequestLimits) -> None:
    """Refuse SamplingParams that ask more than the limits allow."""
    _refuse("stop strings", len(params.stop), limits.max_stop_strings, "max_stop_strings")
    longest = max(map(len, params.stop), default=0)
    _refuse("the longest stop string's characters", longest, limits.max_stop_string_chars,
            "max_stop_string_chars")
    _refuse("bad_words", len(params.bad_words), limits.max_bad_words, "max_bad_words")
    longest = max(map(len, params.bad_words), default=0)
    _refuse("the longest bad word's characters", longest, limits.max_bad_word_chars,
            "max_bad_word_chars")
    _refuse("logit_bias entries", len(params.logit_bias or ()), limits.max_logit_bias,
            "max_logit_bias")
    _refuse("allowed_token_ids", len(params.allowed_token_ids or ()),
            limits.max_allowed_token_ids, "max_allowed_token_ids")
    spec = params.structured_outputs
    if spec is not None:
        _refuse(f"the structured-outputs {spec.kind}'s characters", constraint_chars(spec),
                limits.max_structured_output_chars, "max_structured_output_chars")
    check_bad_word_tokens(params, limits)


def check_bad_word_tokens(params: "SamplingParams", limits: RequestLimits) -> None:
    """The part of check_limits about bad_words_token_ids: on its own for the frontend,
    which checks the rest before it tokenizes the bad words (the limits bound that work)
    and this part once it has."""
    # as the engine gets them: each word with and without a leading space; byte-level
    # tokenizers may spend up to 4 tokens on a character
    _refuse("bad word token sequences", len(params.bad_words_token_ids),
            2 * limits.max_bad_words, "max_bad_words")
    longest = max(map(len, params.bad_words_token_ids), default=0)
    _refuse("the longest bad word's tokens", longest, 4 * (limits.max_bad_word_chars + 1),
            "max_bad_word_chars")


def constraint_chars(spec) -> int:
    """A StructuredOutputsParams' size: its schema, regex or grammar text, or all its
    choices together (a JSON object constraint has none)."""
    if spec.choice is not None:
        return sum(map(len, spec.choice))
    return len(spec.json or spec.regex or spec.grammar or "")


def check_fanout(prompts: int, n: int, limits: RequestLimits) -> None:
    """Refuse a request whose prompts x n sequences exceed max_sequences_per_request."""
    _refuse(f"sequences (prompts x n = {prompts} x {n})", prompts * n,
            limits.max_sequences_per_request, "max_sequences_per_request")
