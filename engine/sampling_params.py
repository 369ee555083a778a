"""SamplingParams: what a request asks of the sampler and of the stop checks.

A msgspec Struct so the same object travels over the engine-core wire protocol;
validation runs in __post_init__, so an invalid object cannot be built (msgspec
also runs it when decoding).
"""
from __future__ import annotations

import msgspec

from engine.errors import InvalidRequestError

MAX_LOGPROBS = 20


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """vLLM-compatible sampling options (same names, same defaults)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        _check(self.n >= 1, f"n must be >= 1, got {self.n}")
        _check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(-2.0 <= self.presence_penalty <= 2.0,
               f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0,
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _check(self.repetition_penalty > 0.0,
               f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check(self.max_tokens is None or self.max_tokens >= 1,
               f"max_tokens must be >= 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
               f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids must be non-negative ints")

    @property
    def greedy(self) -> bool:
        """Temperature 0 means argmax (top_k=1 is equivalent and takes the same path)."""
        return self.temperature == 0.0 or self.top_k == 1

    def clone(self, **changes) -> "SamplingParams":
        return msgspec.structs.replace(self, **changes)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message)
