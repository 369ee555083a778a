"""Wire types between the frontend (Processor/OutputProcessor) and the EngineCore.

msgspec Structs, array_like on the hot ones, so they encode as compact msgpack
arrays; the engine-core server and client exchange exactly these. In-process
(offline LLM) the same objects are passed without encoding.
"""
from __future__ import annotations

import msgspec

from engine.sampling_params import SamplingParams

# Finish reasons carried by EngineCoreOutput.finish_reason.
FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
FINISH_ERROR = "error"

# One token's logprobs: (token ids, logprobs, ranks); the sampled token comes first,
# then the requested top-k alternatives.
TokenLogprobs = tuple[list[int], list[float], list[int]]


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """ADD payload: one tokenized request (the frontend expands n > 1 into n of these)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    client_index: int = 0
    priority: int = 0
    data_parallel_rank: int | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one request since its previous output (in generation order)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None  # the stop token id that ended the request
    new_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # set with finish_reason "error": why the engine refused it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """A snapshot of one engine's load, sent with outputs and on request."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_free_blocks: int = 0
