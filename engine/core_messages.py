"""The engine core's vocabulary: the messages into and out of an engine core.

Requests (EngineCoreRequest), their outputs (EngineCoreOutput, EngineCoreOutputs, the
FINISH_* reasons, RequestTimings), the load it reports (SchedulerStats), its
prefix-cache changes (KVEvents), its ready response, and the utility calls and DP waves
a client sends it. Why at the bottom of engine/: the step loop (engine/core/) produces
these, the frontend (engine/frontend/) builds the requests and reads the outputs, and the
ZMQ wire (engine/wire/) carries them between processes; each of those imports this module, and
this module imports none of them, so the step loop does not sit above the sockets.

msgspec Structs, array_like on the hot ones, so they encode as compact msgpack arrays;
their fields and options are the wire format (engine/wire/protocol.py holds the frames
and the protocol version around them): a change here is a protocol change. Nothing is
ever pickled. In-process (offline LLM) the same objects are passed without encoding.
"""
from __future__ import annotations

import bisect
from typing import Any

import msgspec

from engine.lora.request import LoRARequest
from engine.pooling import PoolingParams
from engine.request_limits import RequestLimits
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
    pooling_params: PoolingParams | None = None  # set: an embedding request (no sampling)
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: base model)
    trace_headers: dict[str, str] | None = None  # W3C trace context (engine/tracing.py)


class RequestTimings(msgspec.Struct, array_like=True, omit_defaults=True):
    """Where a finished request's time went inside the engine, measured on its clock
    (vLLM's phases): waiting until first scheduled, scheduled until its first token
    (prefill), first token until the last (decode)."""

    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one request since its previous output (in generation order)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None  # the stop token id that ended the request
    new_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # set with finish_reason "error": why the engine refused it
    pooled: list[float] | None = None  # an embedding request's vector (with finish "stop")
    # prompt positions 1.. (position 0 has no logprob), sent once with the first token
    prompt_logprobs: list[TokenLogprobs] | None = None
    timings: RequestTimings | None = None  # with the final output of a generation

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# Upper bounds of the tokens-per-step histogram (vLLM's vllm:iteration_tokens_total)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def count_iteration(counts: list[int], tokens: int) -> None:
    """Count one engine step of `tokens` tokens into per-bucket counts (one more slot
    than ITERATION_TOKENS_BUCKETS: the last is above them all)."""
    counts[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, tokens)] += 1


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """A snapshot of one engine's load, sent with outputs and on request. Counters
    (prefix cache, preemptions, iteration tokens) count from the engine's start."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_free_blocks: int = 0
    # steps by tokens computed (prompt and decode), per bucket of ITERATION_TOKENS_BUCKETS
    # and one above them; and their tokens in all
    iteration_tokens_counts: list[int] = []
    iteration_tokens_sum: int = 0
    # speculative decoding (engine/spec_decode): steps with a proposal, proposed tokens,
    # accepted tokens, and accepted tokens by position in the proposal
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []
    # a KV connector (engine/kv_transfer): the tokens its lookups asked about and those
    # it supplied (vLLM's external prefix cache), the blocks and bytes it moved into the
    # pool and out of it, and the loads that failed
    kv_connector: str = ""
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_blocks_in: int = 0
    kv_blocks_out: int = 0
    kv_bytes_in: int = 0
    kv_bytes_out: int = 0
    kv_load_failures: int = 0


class EngineCoreReadyResponse(msgspec.Struct, omit_defaults=True):
    """What a client can only learn from a started engine (the values it really uses)."""

    engine_index: int
    max_model_len: int
    num_gpu_blocks: int
    block_size: int
    dtype: str
    version: str
    supported_tasks: list[str] = msgspec.field(default_factory=lambda: ["generate"])
    max_num_seqs: int = 256
    # as Hello's: absent means 1. The wire's version (engine/wire/protocol.py), which a
    # core does not know: the engine-core server stamps it on what it sends
    protocol_version: int = 1
    model: str = ""
    max_logprobs: int = 20  # EngineConfig.max_logprobs: the frontend refuses more up front
    # sampling values a request gets for what it leaves unset (engine.generation_defaults)
    sampling_defaults: dict[str, int | float] = {}
    limits: RequestLimits | None = None  # what one request may ask (None: the defaults)


class UtilityRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """UTILITY payload: call `method(*args, **kwargs)` on the engine core."""

    call_id: int
    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """Answer to one UtilityRequest: a result or a failure message, never both."""

    call_id: int
    result: Any = None
    failure_message: str | None = None


class StartDPWave(msgspec.Struct, array_like=True):
    """START_DP_WAVE payload: the data-parallel wave the engines should run."""

    wave: int


class KVEvents(msgspec.Struct, array_like=True, omit_defaults=True):
    """Prefix-cache changes of one engine since its previous KVEvents, coalesced per
    hash (engine/core/kv_events.py). Apply in this order: if cleared, forget every
    hash of this engine; then drop `removed`, then add `stored`. A hash is in at most
    one of the lists. Hashes are the engine's block hashes (engine/core/block_hash.py)."""

    cleared: bool = False
    stored: list[int] = []
    removed: list[int] = []
    # the engine's KV tiers (engine/kv_transfer/tier_events.py): blocks that entered or
    # left its own host tier, and blocks it wrote to or evicted from the disk tier its
    # deployment's engines share (a router applies those to every engine). `cleared`
    # forgets this engine's host tier too; a snapshot lists both tiers' blocks.
    host_stored: list[int] = []
    host_removed: list[int] = []
    disk_stored: list[int] = []
    disk_removed: list[int] = []


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """Everything one engine sends one client after a step (or for a utility call)."""

    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    utility_output: UtilityOutput | None = None
    timestamp: float = 0.0
    scheduler_stats: SchedulerStats | None = None
    wave_complete: int | None = None  # set when the engine went idle ending this wave
    kv_events: KVEvents | None = None  # prefix-cache changes, batched (core_server)
    # heartbeats (and refusals sent by the io thread): seconds the engine's core loop
    # has completed nothing, no step, utility call or input (engine/wire/loop_watch.py),
    # 0 while it waits for input and on what the loop itself sends. The io thread beats
    # whatever the loop does, so this is how a client tells a wedged engine from a live
    # one (core_client routes around it). It timed steps and utility calls only before
    # issue 62, in this same last slot: a peer of either kind reads the other's, so the
    # wider meaning needed no PROTOCOL_VERSION bump (the name stays for that reason).
    step_running_s: float = 0.0
