"""A step's outputs (a mixin of EngineCore): sampled tokens through the grammar and the
stop rule into each request's EngineCoreOutput, a finished request's timings and trace
span, an embedding request's pooled vector, a failed request's error output.

Apart from engine_core.py's step because this is what a step's results mean for each
request, not how the batch is scheduled and computed: the step hands over sampled rows
and pooled hidden states, and these methods decide what each request gets and whether
it ends (engine/core/stop_rule.py's rule, shared with the mock). They read the core's
config, scheduler, requests, structured-outputs manager and pooler, annotated below.
"""
from __future__ import annotations

import logging

import torch

from engine import tracing
from engine.config import EngineConfig
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.stop_rule import StopRule, check_stop
from engine.core_messages import FINISH_ERROR, EngineCoreOutput, RequestTimings
from engine.pooling import Pooler
from engine.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class StepOutputs:
    """Per-request outputs of a step for EngineCore."""

    config: EngineConfig
    scheduler: Scheduler
    requests: dict[str, Request]
    structured: StructuredOutputManager
    pooler: Pooler
    max_model_len: int

    def _emit(self, request: Request, result, rows: range, now: float) -> EngineCoreOutput:
        """Append the request's sampled tokens of `rows` (one, or an accepted proposal and
        the token after it) through the grammar and stop checks, which may end it early;
        its output for this step."""
        tokens: list[int] = []
        logprobs: list = []
        status = None
        for row in rows:
            token, lp = result.token_ids[row], result.logprobs[row]
            if row in result.blocked:
                return self._fail(request, "InvalidRequestError: no token satisfies "
                                  "this request's restrictions (allowed_token_ids, "
                                  "bad_words, logit_bias, structured outputs)", tokens)
            request.append_token(token)
            if request.first_token_at is None:
                request.first_token_at = now
            if request.grammar is not None and not self.structured.accept(request, token):
                return self._fail(request, f"token {token} broke the request's "
                                  "structured-outputs grammar", tokens)
            tokens.append(token)
            if lp is not None:
                logprobs.append(lp)
            status = self._check_stop(request, token)
            if status is not None:
                break
        out = EngineCoreOutput(request.request_id, tokens, new_logprobs=logprobs or None,
                               num_cached_tokens=max(0, request.num_cached_tokens))
        if request.prompt_logprobs is not None:  # gathered in full by now: sent once
            out.prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, None
        if status is not None:
            out.finish_reason = status.value
            out.stop_reason = request.stop_reason
            out.timings = _timings(request, now)
            if request.trace_headers and tracing.enabled():
                self._trace(request, out.timings, now)
            self.scheduler.finish(request, status)
            del self.requests[request.request_id]
        return out

    def _trace(self, request: Request, t: RequestTimings, now: float) -> None:
        """Record a traced request's span (vLLM's llm_request and gen_ai attributes)."""
        p = request.params
        attributes = {
            "gen_ai.request.id": request.request_id,
            "gen_ai.response.model": self.config.model,
            "gen_ai.usage.prompt_tokens": request.num_prompt_tokens,
            "gen_ai.usage.completion_tokens": request.num_output_tokens,
            "gen_ai.request.temperature": p.temperature,
            "gen_ai.request.top_p": p.top_p,
            "gen_ai.latency.time_in_queue": t.queue_s,
            "gen_ai.latency.time_to_first_token": t.queue_s + t.prefill_s,
            "gen_ai.latency.time_in_model_prefill": t.prefill_s,
            "gen_ai.latency.time_in_model_decode": t.decode_s,
            "gen_ai.latency.time_in_model_inference": t.prefill_s + t.decode_s,
            "gen_ai.latency.e2e": now - request.queued_at,
        }
        if p.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = p.max_tokens
        scheduled = request.queued_at + t.queue_s
        try:
            tracing.record_request(request.trace_headers, attributes, request.queued_at, scheduled,
                           scheduled + t.prefill_s, now)
        except Exception:  # tracing must never fail a request
            logger.exception("could not record the trace of %s", request.request_id)

    def _pool(self, request: Request, hidden: torch.Tensor) -> list[EngineCoreOutput]:
        """Fold an embedding request's hidden states in; its output once all are in."""
        self.pooler.add(request, hidden, request.num_computed_tokens == hidden.shape[0])
        if request.num_computed_tokens < request.num_tokens:
            return []
        vector = self.pooler.finish(request)
        self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
        del self.requests[request.request_id]
        return [EngineCoreOutput(request.request_id, [], RequestStatus.FINISHED_STOPPED.value,
                                 pooled=vector)]

    def _fail(self, request: Request, why: str,
              tokens: list[int] | None = None) -> EngineCoreOutput:
        """End one request with an error output (after `tokens`, those of this step that
        came before the failing one); the engine goes on with the others."""
        self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        self.requests.pop(request.request_id, None)
        return EngineCoreOutput(request.request_id, list(tokens or []), FINISH_ERROR,
                                error=why)

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        """The shared stop rule (engine/core/stop_rule.py), with a structured-outputs
        request's complete grammar ending it too: after EOS, before every other rule."""
        rule = check_stop(token, request.num_output_tokens, request.num_tokens,
                          request.params, request.eos_token_ids, self.max_model_len)
        if (rule is not StopRule.EOS and request.grammar is not None
                and self.structured.terminated(request)):
            return RequestStatus.FINISHED_STOPPED  # the constraint is complete
        if rule is None:
            return None
        if rule is StopRule.STOP_TOKEN:
            request.stop_reason = token
        return RequestStatus(rule.finish_reason)  # FINISHED_STOPPED or FINISHED_LENGTH



def _timings(request: Request, now: float) -> RequestTimings:
    """A finished request's phases on the engine clock (EngineCoreOutput.timings)."""
    scheduled = request.scheduled_at if request.scheduled_at is not None else now
    first = request.first_token_at if request.first_token_at is not None else now
    return RequestTimings(queue_s=scheduled - request.queued_at, prefill_s=first - scheduled,
                          decode_s=now - first)
