"""User-facing results (vLLM-compatible names): RequestOutput and CompletionOutput."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class OutputKind(enum.Enum):
    """What each RequestOutput of a request carries."""

    FINAL_ONLY = "final"  # one output when the request ends (offline generate)
    CUMULATIVE = "cumulative"  # every update carries the whole text so far
    DELTA = "delta"  # every update carries only what is new (streaming)


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # stop | length | abort
    stop_reason: int | str | None = None  # stop string or stop token id that ended it
    embedding: list[float] | None = None  # an embedding request's vector (no text, no tokens)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    engine_submit_time: float | None = None  # served path: when the ADD left the frontend
    engine_first_token_time: float | None = None  # engine clock when it sent the first token
    num_generation_tokens: int = 0
    max_num_generation_tokens: int = 0  # the longest of its sequences
    n: int = 1  # sequences asked for
    max_tokens: int | None = None  # as asked (None: up to the context length)
    # seconds between successive outputs with tokens, as they arrive here: one
    # inter-token latency per output, as vLLM records them
    inter_token_latencies: list[float] = field(default_factory=list)
    # the engine's phases of the request (its last sequence to finish), engine clock:
    # waiting until scheduled, scheduled until the first token, first token until last
    queue_time: float | None = None
    prefill_time: float | None = None
    decode_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # prompt_logprobs asked: one entry per prompt token, None for the first (nothing
    # before it), else {token id: Logprob} of that token and the top alternatives
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    extra: dict = field(default_factory=dict)
