"""LLM: the offline batch API, with vLLM's names so code can switch over."""
from __future__ import annotations

import itertools
from typing import Any, Sequence

from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.frontend.llm_engine import LLMEngine
from engine.frontend.processor import Prompt
from engine.lora.request import LoRARequest
from engine.outputs import RequestOutput
from engine.pooling import PoolingParams
from engine.sampling_params import SamplingParams


class LLM:
    """Load a model once, then generate for many prompts with continuous batching.

    `LLM()` serves the default model (SmolLM2-135M-Instruct); keyword arguments
    are EngineConfig fields (dtype, block_size, max_num_seqs, ...).
    """

    def __init__(self, model: str = "default", **kwargs: Any) -> None:
        self.llm_engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._counter = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel workers now (they also stop when this LLM
        is garbage-collected or the process exits)."""
        self.llm_engine.engine_core.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; results come back in prompt order. lora_request:
        the adapter every prompt runs with, or one per prompt (None: the base model);
        the engine needs enable_lora. priority: one per prompt, lower first (the engine
        needs scheduling_policy "priority")."""
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params_list(sampling_params, len(prompts))
        loras = (list(lora_request) if isinstance(lora_request, (list, tuple))
                 else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise InvalidRequestError(f"got {len(loras)} LoRA requests for {len(prompts)} "
                                      "prompts")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise InvalidRequestError(f"got {len(priorities)} priorities for {len(prompts)} "
                                      "prompts")
        ids = []
        try:
            for prompt, p, lora, rank in zip(prompts, params, loras, priorities):
                request_id = str(next(self._counter))
                self.llm_engine.add_request(request_id, prompt, p, lora_request=lora,
                                            priority=rank)
                ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def embed(self, prompts: Prompt | Sequence[Prompt],
              pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[RequestOutput]:
        """One embedding per prompt (outputs[0].embedding), in prompt order; prompts are
        batched with each other like generation requests."""
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = pooling_params or PoolingParams()
        ids = []
        try:
            for prompt in prompts:
                request_id = str(next(self._counter))
                self.llm_engine.add_request(request_id, prompt, SamplingParams(),
                                            pooling_params=params)
                ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             lora_request: LoRARequest | None = None) -> list[RequestOutput]:
        """Chat with the tokenizer's chat template; one conversation or a list of them."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        processor = self.llm_engine.processor
        prompts = []
        for conversation in conversations:
            text = processor.apply_chat_template(conversation, add_generation_prompt,
                                                 chat_template, **(chat_template_kwargs or {}))
            # the template already holds the BOS/special tokens: do not add them twice
            ids = processor.tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self.llm_engine.reset_prefix_cache(reset_running_requests)

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without sampling_params uses: the model's generation_config.json
        values (EngineConfig.generation_config / override_generation_config)."""
        return SamplingParams(**self.llm_engine.engine_core.sampling_defaults)

    def _params_list(self, params, count: int) -> list[SamplingParams]:
        if params is None:
            return [self.get_default_sampling_params()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        params = list(params)
        if len(params) != count:
            raise InvalidRequestError(
                f"got {len(params)} sampling params for {count} prompts")
        return params

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            engine.abort_request([i for i in ids if i not in done])
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]
