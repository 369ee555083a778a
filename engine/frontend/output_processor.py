"""OutputProcessor: engine-core outputs (token ids) -> RequestOutputs (text).

Runs in the frontend: incremental detokenization, stop strings, logprob
formatting, n > 1 fan-in. When a stop string ends a request before the engine
stopped it, the request id is reported back for an abort at the engine.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.core_messages import FINISH_STOP, EngineCoreOutput, EngineCoreRequest
from engine.frontend.detokenizer import IncrementalDetokenizer
from engine.frontend.stop_strings import find_stop_string, held_back_chars
from engine.outputs import (
    CompletionOutput,
    Logprob,
    OutputKind,
    RequestMetrics,
    RequestOutput,
)
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class _Child:
    """One sequence (one of n) of a user request, as the engine knows it."""

    engine_id: str
    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    sent_chars: int = 0  # of its text (detok.text), for a delta stream
    sent_tokens: int = 0
    sent_logprobs: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    last_output_at: float | None = None  # when its last output with tokens arrived
    embedding: list[float] | None = None


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    kind: OutputKind
    children: list[_Child]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    sent_prompt_logprobs: bool = False

    @property
    def finished(self) -> bool:
        # asked for every output the client folds: a loop, not all() over a generator
        for c in self.children:
            if c.finish_reason is None:
                return False
        return True

    @property
    def awaiting_prompt_logprobs(self) -> bool:
        """Asked, not here yet: a delta stream waits for them, so that its first output
        carries them (with n > 1 another sequence's token may come first)."""
        return self.params.prompt_logprobs is not None and self.prompt_logprobs is None


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]  # engine request ids stopped here by a stop string


@dataclass
class UpdatedRequests:
    request_ids: list[str]  # user requests with an output to take (take_output)
    reqs_to_abort: list[str]  # engine request ids stopped here by a stop string


def child_request_id(request_id: str, index: int, n: int) -> str:
    """Engine-level id of sequence `index` of a request with n sequences."""
    return request_id if n == 1 else f"{index}_{request_id}"


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._by_engine_id: dict[str, tuple[_Parent, _Child]] = {}

    def add_request(self, request_id: str, prompt: str | None,
                    engine_requests: list[EngineCoreRequest],
                    kind: OutputKind = OutputKind.FINAL_ONLY) -> None:
        first = engine_requests[0]
        params = first.sampling_params
        children = [
            _Child(r.request_id, i, IncrementalDetokenizer(
                self.tokenizer, r.prompt_token_ids, params.skip_special_tokens),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None)
            for i, r in enumerate(engine_requests)]
        parent = _Parent(request_id, prompt, first.prompt_token_ids, params, kind, children,
                         RequestMetrics(first.arrival_time or time.time(),
                                        n=len(engine_requests), max_tokens=params.max_tokens))
        self._parents[request_id] = parent
        for child in children:
            self._by_engine_id[child.engine_id] = (parent, child)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._parents

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def engine_ids(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        return [c.engine_id for c in parent.children] if parent else []

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget user requests; return their engine ids that still need an abort."""
        engine_ids = []
        for request_id in request_ids:
            parent = self._parents.pop(request_id, None)
            if parent is None:
                continue
            for child in parent.children:
                self._by_engine_id.pop(child.engine_id, None)
                if child.finish_reason is None:
                    engine_ids.append(child.engine_id)
        return engine_ids

    def metrics_of(self, request_id: str) -> RequestMetrics | None:
        parent = self._parents.get(request_id)
        return parent.metrics if parent else None

    def process_outputs(self, outputs: list[EngineCoreOutput],
                        engine_timestamp: float | None = None) -> ProcessedOutputs:
        """update() then take_output() for each updated request: one RequestOutput per
        request that has something to report (the offline engine's step)."""
        updated = self.update(outputs, engine_timestamp)
        results = [out for out in map(self.take_output, updated.request_ids)
                   if out is not None]
        return ProcessedOutputs(results, updated.reqs_to_abort)

    def update(self, outputs: list[EngineCoreOutput],
               engine_timestamp: float | None = None) -> UpdatedRequests:
        """Fold engine outputs into their requests (tokens, text, stop strings) without
        building RequestOutputs: the served path builds one when its consumer asks
        (take_output), so a consumer that fell behind takes many steps in one output
        instead of paying for an output per step. engine_timestamp: when the engine
        sent these outputs (served path)."""
        now = time.time()
        touched: dict[str, None] = {}
        to_abort: list[str] = []
        for out in outputs:
            entry = self._by_engine_id.get(out.request_id)
            if entry is None:
                continue  # aborted here already
            parent, child = entry
            if child.finish_reason is not None:
                continue
            if (engine_timestamp and out.new_token_ids
                    and parent.metrics.engine_first_token_time is None):
                parent.metrics.engine_first_token_time = engine_timestamp
            self._add_tokens(parent, child, out, now)
            if child.finish_reason is not None:
                if out.finish_reason is None:
                    to_abort.append(child.engine_id)
                self._by_engine_id.pop(child.engine_id, None)
                if parent.finished:
                    parent.metrics.finished_time = now
            if parent.finished or (parent.kind is OutputKind.DELTA  # FINAL_ONLY: at the end
                                   and not parent.awaiting_prompt_logprobs):
                touched[parent.request_id] = None
        return UpdatedRequests(list(touched), to_abort)

    def take_output(self, request_id: str) -> RequestOutput | None:
        """The request's output now: a DELTA request's text and tokens since the last
        take, a FINAL_ONLY request's whole output once it finished (else None). A
        finished request is forgotten after its last take."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        done = parent.finished
        if parent.kind is OutputKind.FINAL_ONLY and not done:
            return None
        if done:
            del self._parents[request_id]
        return self._make_output(parent, done)

    def _add_tokens(self, parent: _Parent, child: _Child, out: EngineCoreOutput,
                    now: float) -> None:
        m = parent.metrics
        if out.new_token_ids:
            if m.first_token_time is None:
                m.first_token_time = now
            if child.last_output_at is not None:  # per sequence, as vLLM's per request
                m.inter_token_latencies.append(max(0.0, now - child.last_output_at))
            child.last_output_at = m.last_token_time = now
            m.num_generation_tokens += len(out.new_token_ids)
        if out.timings is not None:
            m.queue_time = out.timings.queue_s
            m.prefill_time = out.timings.prefill_s
            m.decode_time = out.timings.decode_s
        parent.num_cached_tokens = out.num_cached_tokens
        if out.pooled is not None:
            child.embedding = out.pooled
        if out.prompt_logprobs is not None:
            parent.prompt_logprobs = [None] + [self._logprob_entry(*row)
                                               for row in out.prompt_logprobs]
        tokens, logprobs = out.new_token_ids, out.new_logprobs
        if parent.params.stop and len(tokens) > 1:
            # several tokens at once (speculative decoding): a stop string is looked
            # for after each, so nothing after the one that completes it is kept
            logprobs = logprobs or [None] * len(tokens)
            stopped = any(self._extend(parent, child, [t], None if lp is None else [lp])
                          for t, lp in zip(tokens, logprobs))
        else:
            stopped = self._extend(parent, child, tokens, logprobs)
        m.max_num_generation_tokens = max(m.max_num_generation_tokens, len(child.token_ids))
        if stopped:
            return
        if out.finish_reason is not None:
            child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason

    def _extend(self, parent: _Parent, child: _Child, tokens: list[int],
                logprobs: list | None) -> bool:
        """Add a sequence's new tokens and their text; True when a stop string ended it
        (its text then cut at the stop)."""
        child.token_ids.extend(tokens)
        if child.logprobs is not None and logprobs:
            for ids, vals, ranks in logprobs:
                child.logprobs.append(self._logprob_entry(ids, vals, ranks))
                child.cumulative_logprob += vals[0]
        delta = child.detok.update(tokens)
        stops = parent.params.stop
        if stops and delta:
            text = child.detok.text  # search the new text and a stop's length before it
            window = text.tail(len(delta) + max(map(len, stops)) - 1)
            match = find_stop_string(window, len(delta), stops)
            if match is not None:
                stop, index = match
                index += len(text) - len(window)
                end = index + len(stop) if parent.params.include_stop_str_in_output else index
                text.truncate(end)
                child.finish_reason, child.stop_reason = FINISH_STOP, stop
                return True
        return False

    def _logprob_entry(self, ids: list[int], vals: list[float], ranks: list[int]
                       ) -> dict[int, Logprob]:
        """{token id: Logprob} of one position, the scored token first."""
        entry: dict[int, Logprob] = {}
        for t, v, r in zip(ids, vals, ranks):
            entry.setdefault(t, Logprob(v, r, self.tokenizer.decode([t])))
        return entry

    def _make_output(self, parent: _Parent, finished: bool) -> RequestOutput:
        completions = []
        for child in parent.children:
            if parent.kind is OutputKind.DELTA:
                end = len(child.detok.text)
                if child.finish_reason is None:
                    end -= held_back_chars(parent.params.stop) if parent.params.stop else 0
                end = max(end, child.sent_chars)
                text = child.detok.text.slice(child.sent_chars, end)
                tokens = child.token_ids[child.sent_tokens:]
                logprobs = (None if child.logprobs is None
                            else child.logprobs[child.sent_logprobs:])
                child.sent_chars, child.sent_tokens = end, len(child.token_ids)
                child.sent_logprobs = len(child.logprobs or [])
            else:
                text = child.detok.text.value()
                tokens, logprobs = list(child.token_ids), child.logprobs
            completions.append(CompletionOutput(
                child.index, text, tokens, child.cumulative_logprob, logprobs,
                child.finish_reason, child.stop_reason, child.embedding))
        prompt_logprobs = parent.prompt_logprobs
        if parent.kind is OutputKind.DELTA:  # a delta stream carries them once
            if parent.sent_prompt_logprobs:
                prompt_logprobs = None
            elif prompt_logprobs is not None:
                parent.sent_prompt_logprobs = True
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids,
                             completions, finished, parent.num_cached_tokens, parent.metrics,
                             prompt_logprobs)
