"""SamplingParams: what a request asks of the sampler and of the stop checks.

A msgspec Struct so the same object travels over the engine-core wire protocol;
validation runs in __post_init__, so an invalid object cannot be built (msgspec
also runs it when decoding). __post_init__ is the one place each value rule is
written: the HTTP APIs only document these ranges (deployments/apis/common/
sampling.py), and every refusal is an InvalidRequestError whose `param` names the
field, which the APIs answer with a 400 naming it.
"""
from __future__ import annotations

import msgspec

from engine.errors import InvalidRequestError
from engine.structured.params import StructuredOutputsParams

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
    # logprobs of each prompt token given those before it (the first has none), with
    # this many top alternatives; the engine computes every prompt position for them
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, [-100, 100]
    allowed_token_ids: list[int] | None = None  # sample only among these
    bad_words: list[str] = []  # never generate these words (as a whole token sequence)
    # bad_words as token id sequences, filled by the frontend's Processor (the engine
    # has no tokenizer): each word with and without a leading space
    bad_words_token_ids: list[list[int]] = []
    structured_outputs: StructuredOutputsParams | None = None
    # false: this request never takes proposed tokens (an engine with speculative_config
    # then decodes it one token a step); its tokens are the same either way
    speculative_decoding: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        # NaN fails every comparison below, so it is refused wherever a range is checked
        _check(self.n >= 1, f"n must be >= 1, got {self.n}", "n")
        _check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}",
               "temperature")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        _check(self.top_k >= 0, f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}",
               "top_k")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        _check(-2.0 <= self.presence_penalty <= 2.0,
               f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
               "presence_penalty")
        _check(-2.0 <= self.frequency_penalty <= 2.0,
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
               "frequency_penalty")
        _check(self.repetition_penalty > 0.0,
               f"repetition_penalty must be > 0, got {self.repetition_penalty}",
               "repetition_penalty")
        _check(self.max_tokens is None or self.max_tokens >= 1,
               f"max_tokens must be >= 1, got {self.max_tokens}", "max_tokens")
        _check(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}",
               "min_tokens")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
               "min_tokens")
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
               f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", "logprobs")
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
               f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}",
               "prompt_logprobs")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty",
               "stop")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids must be non-negative ints", "stop_token_ids")
        _check(self.structured_outputs is None or self.min_tokens == 0,
               "min_tokens cannot be combined with structured outputs (the constraint "
               "decides where the output ends)", "min_tokens")
        if self.logit_bias is not None:
            _check(all(isinstance(t, int) and t >= 0 for t in self.logit_bias),
                   "logit_bias keys must be non-negative token ids", "logit_bias")
            _check(all(-100.0 <= b <= 100.0 for b in self.logit_bias.values()),
                   "logit_bias values must be in [-100, 100]", "logit_bias")
        if self.allowed_token_ids is not None:
            _check(bool(self.allowed_token_ids)
                   and all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids),
                   "allowed_token_ids must be a non-empty list of non-negative token ids",
                   "allowed_token_ids")
        _check(all(isinstance(w, str) and w for w in self.bad_words),
               "bad_words must be non-empty strings", "bad_words")
        _check(all(seq and all(isinstance(t, int) and t >= 0 for t in seq)
                   for seq in self.bad_words_token_ids),
               "bad_words_token_ids must be non-empty lists of non-negative token ids",
               "bad_words_token_ids")

    def token_ids_in_params(self) -> list[int]:
        """Every token id these params name (checked against the vocabulary)."""
        ids = list(self.stop_token_ids) + list(self.logit_bias or ()) + list(
            self.allowed_token_ids or ())
        for seq in self.bad_words_token_ids:
            ids.extend(seq)
        return ids

    @property
    def greedy(self) -> bool:
        """Temperature 0 means argmax (top_k=1 is equivalent and takes the same path)."""
        return self.temperature == 0.0 or self.top_k == 1

    def clone(self, **changes) -> "SamplingParams":
        return msgspec.structs.replace(self, **changes)


def _check(ok: bool, message: str, param: str) -> None:
    """Refuse unless ok; param: the field at fault, so an HTTP 400 names it."""
    if not ok:
        raise InvalidRequestError(message, param=param)
