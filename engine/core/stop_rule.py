"""The stop rule: whether a request ends with the token it just produced, and why.

Why one function: EngineCore and the model-free mock engine (engine/mock/) must end a
request on the same token for the same reason, or a test of the frontend against the
mock proves nothing about the real engine. Both call this; each keeps its own
bookkeeping around it (EngineCore its structured-outputs check and stop_reason, the mock
its finish reasons).

The rules, in the order they are checked (the first that applies wins):
1. EOS: the token is one of the model's EOS ids, unless ignore_eos;
2. a stop token: the token is in stop_token_ids;
3. max_tokens: the request has produced max_tokens tokens;
4. max_model_len: prompt and output fill the context.
min_tokens masks the first two: until the request has produced min_tokens tokens
(this one included), neither EOS nor a stop token ends it.
"""
from __future__ import annotations

import enum
from collections.abc import Container

from engine.core_messages import FINISH_LENGTH, FINISH_STOP
from engine.sampling_params import SamplingParams


class StopRule(enum.Enum):
    """Which rule ended a request."""

    EOS = "eos"
    STOP_TOKEN = "stop_token"
    MAX_TOKENS = "max_tokens"
    MAX_MODEL_LEN = "max_model_len"

    @property
    def finish_reason(self) -> str:
        """The output's finish_reason: "stop" for EOS and stop tokens, else "length"."""
        return FINISH_STOP if self in (StopRule.EOS, StopRule.STOP_TOKEN) else FINISH_LENGTH


def check_stop(token: int, num_output_tokens: int, num_tokens: int,
               params: SamplingParams, eos_token_ids: Container[int],
               max_model_len: int) -> StopRule | None:
    """The rule that ends a request after it produced `token`, its num_output_tokens-th
    output token (num_tokens: prompt and output, this token included); None: it goes on."""
    past_min = num_output_tokens >= params.min_tokens
    if past_min and not params.ignore_eos and token in eos_token_ids:
        return StopRule.EOS
    if past_min and token in params.stop_token_ids:
        return StopRule.STOP_TOKEN
    if params.max_tokens is not None and num_output_tokens >= params.max_tokens:
        return StopRule.MAX_TOKENS
    if num_tokens >= max_model_len:
        return StopRule.MAX_MODEL_LEN
    return None
