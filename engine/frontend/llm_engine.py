"""LLMEngine: Processor + in-process EngineCore + OutputProcessor, driven by step().

The synchronous engine behind the offline `LLM` API; the served path puts the
same EngineCore behind the engine-core server instead.
"""
from __future__ import annotations

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.errors import DuplicateRequestError
from engine.frontend.output_processor import OutputProcessor
from engine.frontend.processor import Processor, Prompt
from engine.lora.request import LoRARequest
from engine.model.loader import load_tokenizer
from engine.outputs import OutputKind, RequestOutput
from engine.pooling import PoolingParams
from engine.sampling_params import SamplingParams
from engine.structured.grammar import preload_xgrammar, wait_for_xgrammar


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        preload_xgrammar()  # beside the model's load, done before the first requests
        self.engine_core = EngineCore(config)
        self.tokenizer = load_tokenizer(self.engine_core.checkpoint)
        wait_for_xgrammar()
        self.processor = Processor(self.tokenizer, self.engine_core.max_model_len,
                                   self.engine_core.shape.vocab_size, config.max_logprobs,
                                   self.engine_core.limits)
        self.output_processor = OutputProcessor(self.tokenizer)

    @property
    def max_model_len(self) -> int:
        return self.engine_core.max_model_len

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                    kind: OutputKind = OutputKind.FINAL_ONLY,
                    pooling_params: PoolingParams | None = None,
                    lora_request: LoRARequest | None = None, priority: int = 0) -> None:
        """pooling_params: an embedding request (params are then not used);
        lora_request: the adapter it runs with; priority: its place under
        scheduling_policy "priority" (lower first; must be 0 under fcfs)."""
        text, token_ids = self.processor.tokenize(prompt)
        requests = self.processor.make_requests(request_id, token_ids, params,
                                                priority=priority,
                                                pooling_params=pooling_params,
                                                lora_request=lora_request)
        if self.output_processor.has_request(request_id):
            raise DuplicateRequestError(f"request id {request_id!r} is already running")
        added = []
        try:
            for r in requests:
                self.engine_core.add_request(r)
                added.append(r.request_id)
        except Exception:
            self.engine_core.abort_requests(added)
            raise
        self.output_processor.add_request(request_id, text, requests, kind)

    def abort_request(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(self.output_processor.abort_requests(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        outputs = self.engine_core.step()
        processed = self.output_processor.process_outputs(outputs)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self.engine_core.reset_prefix_cache(reset_running_requests)
