"""Processor: user input -> EngineCoreRequests (tokenize, chat template, checks).

Runs in the frontend, so bad input fails here with a typed error before it
reaches an engine. A request with n > 1 becomes n engine requests that share
the prompt (and, through the prefix cache, its KV blocks).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from engine.core_messages import EngineCoreRequest
from engine.errors import InvalidRequestError
from engine.frontend.output_processor import child_request_id
from engine.lora.request import LoRARequest
from engine.pooling import PoolingParams
from engine.request_checks import check_params, check_prompt
from engine.request_limits import RequestLimits, check_bad_word_tokens, check_limits
from engine.sampling_params import SamplingParams
from engine.structured.grammar import check_structured_outputs, preload_xgrammar

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Prompt = str | list[int] | dict[str, Any]


class Processor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_model_len: int,
                 vocab_size: int, max_logprobs: int = 20,
                 limits: RequestLimits | None = None) -> None:
        """limits: what one request may ask (default: EngineConfig's defaults)."""
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs
        self.limits = limits or RequestLimits.defaults()
        preload_xgrammar()  # so a first constrained request does not wait for the import

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """Accepts text, a token id list, or {"prompt": ...} / {"prompt_token_ids": ...}."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InvalidRequestError("a prompt must be a string or a list of token ids")

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            chat_template: str | None = None, **kwargs: Any) -> str:
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and "role" in m for m in messages):
            raise InvalidRequestError("messages must be a list of {role, content} objects")
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("this model's tokenizer has no chat template")
        from jinja2.exceptions import TemplateError
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                chat_template=chat_template, **kwargs)
        except TemplateError as exc:  # the template refused the conversation (its raise_exception)
            raise InvalidRequestError(f"the chat template refused the conversation: {exc}") \
                from None

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's token ids as it would appear first in a text and after a space
        (BPE tokenizers spell the two differently); duplicates dropped."""
        seqs: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in seqs:
                    seqs.append(ids)
        return seqs

    def make_requests(self, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams, arrival_time: float | None = None,
                      priority: int = 0, data_parallel_rank: int | None = None,
                      pooling_params: PoolingParams | None = None,
                      lora_request: LoRARequest | None = None
                      ) -> list[EngineCoreRequest]:
        """Validate and build one EngineCoreRequest per sequence (n of them); with
        pooling_params, one embedding request (params only bound the prompt checks)."""
        if pooling_params is not None:
            check_prompt(prompt_token_ids, self.max_model_len + 1, self.vocab_size)
            return [EngineCoreRequest(request_id, list(prompt_token_ids),
                                      SamplingParams(max_tokens=1), arrival_time or time.time(),
                                      priority=priority, data_parallel_rank=data_parallel_rank,
                                      pooling_params=pooling_params,
                                      lora_request=lora_request)]
        check_prompt(prompt_token_ids, self.max_model_len, self.vocab_size)
        # the limits, once each: those on what was asked before tokenizing (up to
        # thousands of) bad words, those on their token sequences once filled in
        check_limits(params, self.limits)
        if params.bad_words and not params.bad_words_token_ids:
            params = params.clone(bad_words_token_ids=self.bad_words_token_ids(params.bad_words))
            check_bad_word_tokens(params, self.limits)
        check_params(params, self.max_logprobs, self.vocab_size, limits=None)
        if params.structured_outputs is not None:
            check_structured_outputs(params.structured_outputs)
        arrival = arrival_time or time.time()
        requests = []
        for i in range(params.n):
            child = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + i
                # the prompt is the same for every sequence: the first computes its logprobs
                child = params.clone(n=1, seed=seed,
                                     prompt_logprobs=params.prompt_logprobs if i == 0 else None)
            requests.append(EngineCoreRequest(
                child_request_id(request_id, i, params.n), list(prompt_token_ids), child,
                arrival, priority=priority, data_parallel_rank=data_parallel_rank,
                lora_request=lora_request))
        return requests
