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
    prompt_logprobs: None = None
    extra: dict = field(default_factory=dict)

    def add_delta(self, later: RequestOutput) -> None:
        """Fold the next DELTA output of the same request into this one: a consumer
        that fell behind the engine takes one output (one SSE event) carrying what
        several steps produced, instead of paying per step. Tokens, text and logprobs
        are appended in order; finish state and counters come from `later`."""
        mine = {c.index: c for c in self.outputs}
        for new in later.outputs:
            old = mine.get(new.index)
            if old is None:
                self.outputs.append(new)
                mine[new.index] = new
                continue
            old.text += new.text
            old.token_ids = old.token_ids + new.token_ids
            if new.logprobs is not None:
                old.logprobs = (old.logprobs or []) + new.logprobs
            old.cumulative_logprob = new.cumulative_logprob
            old.finish_reason = new.finish_reason
            old.stop_reason = new.stop_reason
        self.finished = later.finished
        self.num_cached_tokens = later.num_cached_tokens
        self.metrics = later.metrics or self.metrics
