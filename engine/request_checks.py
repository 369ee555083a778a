"""Checks every request passes, shared by the frontend Processor and the engine cores.

The frontend checks first, to answer bad input before it travels; engines check
again because anything can reach their socket. Each check runs once on each side:
value rules in SamplingParams.__post_init__ (run when it is built, and by msgspec when
an engine decodes it), the limits of the model and engine here.
"""
from __future__ import annotations

from engine.errors import InvalidRequestError, PromptTooLongError
from engine.request_limits import RequestLimits, check_limits
from engine.sampling_params import SamplingParams


def check_prompt(token_ids: list[int], max_model_len: int, vocab_size: int) -> None:
    """Non-empty, fits max_model_len with one token to spare, ids inside the vocabulary."""
    n = len(token_ids)
    if n == 0:
        raise InvalidRequestError("the prompt is empty")
    if n >= max_model_len:
        raise PromptTooLongError(
            f"this model's maximum context length is {max_model_len} tokens, but the "
            f"prompt has {n} tokens (plus at least one to generate)")
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})")


def check_params(params: SamplingParams, max_logprobs: int, vocab_size: int,
                 limits: RequestLimits | None) -> None:
    """What SamplingParams cannot check by itself: limits of this engine and its model.
    limits None: the caller has checked them itself (the frontend Processor does, in two
    parts around tokenizing bad words), so that they run once."""
    if limits is not None:
        check_limits(params, limits)
    if params.logprobs is not None and params.logprobs > max_logprobs:
        raise InvalidRequestError(f"logprobs must be <= {max_logprobs}")
    if params.prompt_logprobs is not None and params.prompt_logprobs > max_logprobs:
        raise InvalidRequestError(f"prompt_logprobs must be <= {max_logprobs}")
    ids = params.token_ids_in_params()
    if ids and max(ids) >= vocab_size:
        raise InvalidRequestError(
            f"token id {max(ids)} is outside this model's vocabulary [0, {vocab_size}) "
            "(stop_token_ids, logit_bias, allowed_token_ids)")
    if params.bad_words and not params.bad_words_token_ids:
        raise InvalidRequestError("bad_words reach the engine tokenized: send them through "
                                  "a frontend (LLM, the OpenAI server), which fills "
                                  "bad_words_token_ids")
