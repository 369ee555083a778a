"""MockEngineCore: a model-free engine core with deterministic tokens and a latency model.

Why: the frontend (ingress, core client, output processor, coordinator) has to be
benchmarked and tested without the cost and the noise of a model. The mock
implements the engine-core interface as EngineCore does (EngineCoreLike,
engine/core/interface.py), so the engine-core server hosts it unchanged, and its
tokens are a pure function of (seed, engine index, request id, output position):
a test can predict what a client must receive, whatever else runs in the batch.

Time is simulated on an absolute schedule, never slept: a request's first token
is due at admission + ttft_s + prefill_s_per_token * its uncached prompt tokens,
then one token every itl_s (with serial_prefill, prefills run one after another, as
on a compute-bound engine, so a queue of prompts delays the next one). step() returns
what is due now (at most one output per request, as a real step); next_step_delay()
says when the next output will be, so the server can block on its socket in between.

Scripted (MockConfig.scripted, with the frontends' tokenizer): a prompt's last
`[[emit]]text[[/emit]]` directive is its output (then EOS), its structured outputs
checked against it (engine/mock/script.py); stop rules apply as to drawn tokens.

Kept from a real engine: request validation and its typed errors, EngineCore's own
stop rule (engine/core/stop_rule.py: EOS, stop_token_ids, min_tokens masking both,
max_tokens, max_model_len), at most max_num_seqs running requests (the rest wait, first
come first served), KV block accounting for stats, sleep mode, the prefix cache: full
prompt blocks are named by the engine's own hash chain (engine/core/block_hash.py) and
kept in an LRU index of num_blocks blocks; a request's longest cached prefix (one token
is always computed) is its num_cached_tokens, skips prefill time, counts in the
prefix-cache stats, and the index publishes KV events as EngineCore does, so
prefix-aware routing is testable without a model. Left out: preemption, blocks held by
running requests (the index only holds finished prompts' blocks, by LRU), real logprobs
(fake ones of the right shape).
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.core.block_hash import cacheable_blocks, prefix_block_hashes
from engine.core.kv_events import KVEventLog
from engine.core.stop_rule import StopRule, check_stop
from engine.core_messages import (
    FINISH_ABORT,
    ITERATION_TOKENS_BUCKETS,
    EngineCoreOutput,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    KVEvents,
    RequestTimings,
    SchedulerStats,
    TokenLogprobs,
    count_iteration,
)
from engine.errors import (
    DuplicateRequestError,
    EngineOverloadedError,
    EngineSleepingError,
    InvalidRequestError,
)
from engine.mock.config import FIRST_TOKEN_ID, MockConfig
from engine.mock.script import MockScript
from engine.request_checks import check_prompt
from engine.request_limits import RequestLimits, check_limits
from engine.sampling_params import SamplingParams

SLEEP_TAGS = ("weights", "kv_cache")  # what sleep() puts to sleep; wake_up(tags) wakes some
_MAX_REDRAWS = 64  # redraws of a stop token masked by min_tokens (then it is kept)
_NO_LORA = "the mock engine serves no LoRA adapters (it has no model); use a real model"


def _refuse_model_controls(params: SamplingParams, scripted: bool) -> None:
    """The mock draws tokens without logits, so it cannot honour a request that
    restricts them: it says so rather than answer something else (a scripted request's
    structured outputs are checked against its script instead)."""
    asked = [name for name, on in (
        ("structured outputs", params.structured_outputs is not None and not scripted),
        ("logit_bias", bool(params.logit_bias)),
        ("allowed_token_ids", params.allowed_token_ids is not None),
        ("bad_words", bool(params.bad_words_token_ids)),
        ("prompt_logprobs", params.prompt_logprobs is not None)) if on]
    if asked:
        raise InvalidRequestError(f"the mock engine does not support {', '.join(asked)} "
                                  "(it has no model); use a real model")


@dataclass(slots=True, eq=False)
class _Request:
    request_id: str
    prompt_len: int
    params: SamplingParams
    arrival: float
    block_hashes: list[int] = field(default_factory=list)  # of its prompt's full blocks
    num_cached: int = 0  # prompt tokens found in the prefix cache at admission
    started: float = 0.0  # when its prefill starts (set on admission)
    first_due: float = 0.0  # when output token 0 is due (set on admission)
    num_output: int = 0  # tokens already returned
    chunk: list[int] = field(default_factory=list)  # the next output's tokens, drawn ahead
    finish_reason: str | None = None  # of the next output
    stop_reason: int | None = None
    due: float = 0.0  # when the next output is due: the time of its last token
    script: list[int] | None = None  # its directive's tokens (scripted mode), EOS after


class MockEngineCore:
    """The engine-core interface (EngineCoreLike) over deterministic tokens; see the
    module docstring."""

    dtype_name = "mock"
    model_name = "mock"

    def __init__(self, config: MockConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, tokenizer=None) -> None:
        """tokenizer (HF): the frontends', needed when config.scripted, and then the
        mock takes its vocabulary size and EOS id."""
        c = config or MockConfig()
        self._script = MockScript(tokenizer, c.eos_token_id) if c.scripted else None
        if self._script is not None:
            c = dataclasses.replace(c, vocab_size=self._script.vocab_size,
                                    eos_token_id=self._script.eos_token_id)
        self.config = c
        self.limits = RequestLimits.defaults()  # what one request may ask, as an engine's
        self.num_blocks = c.num_blocks
        self.block_size = c.block_size
        self.max_num_seqs = c.max_num_seqs
        # As EngineCore: a request must fit in the KV pool on its own.
        self.max_model_len = min(c.max_model_len, c.num_blocks * c.block_size)
        self._clock = clock
        self._num_drawable = c.vocab_size - FIRST_TOKEN_ID - (c.eos_token_id >= FIRST_TOKEN_ID)
        self._eos_token_ids = (c.eos_token_id,)  # the stop rule's EOS ids: the one it draws
        self._running: dict[str, _Request] = {}
        self._waiting: dict[str, _Request] = {}  # over max_num_seqs, in arrival order
        self._aborted: list[EngineCoreOutput] = []
        self._asleep: set[str] = set()  # the SLEEP_TAGS not woken up yet
        self._cache: OrderedDict[int, None] = OrderedDict()  # block hashes, LRU first
        self._events = KVEventLog()
        self._prefix_queries = self._prefix_hits = 0  # prompt tokens looked up / found
        self._prefill_free_at = 0.0  # serial_prefill: when the current prefills end
        self._iteration_counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self._iteration_sum = 0  # a step's tokens: those it outputs (no prefill modelled)

    # ---- requests ---------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request; raises a typed error (as EngineCore) if it cannot run."""
        if self._asleep:
            raise EngineSleepingError("the engine is asleep (sleep mode); call wake_up first")
        rid, ids = req.request_id, req.prompt_token_ids
        if rid in self._running or rid in self._waiting:
            raise DuplicateRequestError(f"request id {rid!r} is already running")
        if len(self._waiting) >= self.config.max_waiting_requests:
            raise EngineOverloadedError(
                f"the engine's waiting queue is full ({self.config.max_waiting_requests} "
                "requests, max_waiting_requests); retry shortly")
        check_prompt(ids, self.max_model_len, self.config.vocab_size)
        check_limits(req.sampling_params, self.limits)
        text = self._script.find(ids) if self._script is not None else None
        _refuse_model_controls(req.sampling_params, scripted=text is not None)
        if req.lora_request is not None:
            raise InvalidRequestError(_NO_LORA)
        if req.priority != 0:
            raise InvalidRequestError(f"priority {req.priority} needs scheduling_policy "
                                      "'priority'; the mock engine schedules fcfs")
        script = None if text is None else self._script.tokens(
            text, req.sampling_params.structured_outputs)
        now = self._clock()
        self._waiting[rid] = _Request(rid, len(ids), req.sampling_params, now,
                                      self._block_hashes(ids), script=script)
        self._admit(now)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Stop requests at once; unknown or finished ids are ignored (idempotent).
        Each aborted request gets one empty output with finish_reason "abort"."""
        for rid in request_ids:
            request = self._running.pop(rid, None) or self._waiting.pop(rid, None)
            if request is not None:
                self._aborted.append(EngineCoreOutput(rid, [], FINISH_ABORT))
        self._admit(self._clock())

    def has_unfinished_requests(self) -> bool:
        """True while step() has something to do or to report (aborts included)."""
        return bool(self._running or self._waiting or self._aborted)

    def next_step_delay(self) -> float | None:
        """Seconds until step() has an output to return: 0.0 if one is due, None if idle."""
        if self._aborted:
            return 0.0
        if not self._running:
            return None  # nothing waits without something running (max_num_seqs >= 1)
        due = min(r.due for r in self._running.values())
        return max(0.0, due - self._clock())

    def step(self) -> list[EngineCoreOutput]:
        """Return the outputs due now (never waits): at most one per request."""
        now = self._clock()
        outputs, self._aborted = self._aborted, []
        for r in [r for r in self._running.values() if r.due <= now]:
            outputs.append(EngineCoreOutput(
                r.request_id, r.chunk, r.finish_reason, r.stop_reason,
                new_logprobs=self._logprobs(r.chunk, r.params.logprobs),
                num_cached_tokens=r.num_cached,
                timings=None if r.finish_reason is None else RequestTimings(
                    r.started - r.arrival, r.first_due - r.started, r.due - r.first_due)))
            r.num_output += len(r.chunk)
            if r.finish_reason is None:
                self._draw_chunk(r)
            else:
                del self._running[r.request_id]
                self._admit(r.due)  # the slot was free from then on
        tokens = sum(len(o.new_token_ids) for o in outputs)
        if tokens:
            count_iteration(self._iteration_counts, tokens)
            self._iteration_sum += tokens
        return outputs

    # ---- the simulated model ----------------------------------------------------------
    def _admit(self, at: float) -> None:
        """Move waiting requests into free running slots, first come first served."""
        c = self.config
        while self._waiting and len(self._running) < c.max_num_seqs:
            r = self._waiting.pop(next(iter(self._waiting)))
            r.num_cached = self._use_prefix_cache(r)
            start = max(at, r.arrival)
            prefill = c.prefill_s_per_token * (r.prompt_len - r.num_cached)
            if c.serial_prefill:
                start = max(start, self._prefill_free_at)
                self._prefill_free_at = start + prefill
            r.started = start
            r.first_due = start + c.ttft_s + prefill
            self._running[r.request_id] = r
            self._draw_chunk(r)

    # ---- the prefix cache model ---------------------------------------------------------
    def _block_hashes(self, ids: list[int]) -> list[int]:
        return prefix_block_hashes(ids, self.block_size) if self.config.enable_prefix_caching \
            else []

    def _use_prefix_cache(self, r: _Request) -> int:
        """Prompt tokens of r found cached (its longest cached prefix of full blocks, one
        token always left to compute); then its blocks are the most recently used, the
        first block last, so that a prefix is evicted from its tail as in EngineCore."""
        if not self.config.enable_prefix_caching:
            return 0
        hits = 0
        for h in r.block_hashes[:cacheable_blocks(r.prompt_len, self.block_size)]:
            if h not in self._cache:
                break
            hits += 1
        for h in reversed(r.block_hashes):
            if h in self._cache:
                self._cache.move_to_end(h)
            else:
                self._cache[h] = None
                self._events.stored(h)
        while len(self._cache) > self.num_blocks:
            evicted, _ = self._cache.popitem(last=False)
            self._events.removed(evicted)
        self._prefix_queries += r.prompt_len
        self._prefix_hits += hits * self.block_size
        return hits * self.block_size

    def _drop_prefix_cache(self) -> None:
        self._cache.clear()
        self._events.cleared()

    def take_kv_events(self) -> KVEvents | None:
        """As EngineCore: the index's changes since the last call (the first: a snapshot)."""
        return self._events.take(self._cache)

    def kv_cache_snapshot(self) -> KVEvents:
        """As EngineCore: every cached hash, for a router that just connected."""
        return self._events.snapshot(self._cache)

    def _draw_chunk(self, r: _Request) -> None:
        """Draw the next output's tokens, stopping where the request finishes."""
        r.chunk = []
        while len(r.chunk) < self.config.output_chunk_size and r.finish_reason is None:
            pos = r.num_output + len(r.chunk)
            token = self._token(r, pos)
            r.chunk.append(token)
            r.finish_reason, r.stop_reason = self._check_stop(r, token, pos + 1)
        r.due = r.first_due + (r.num_output + len(r.chunk) - 1) * self.config.itl_s

    def _token(self, r: _Request, pos: int) -> int:
        """Output token `pos` of r. Before min_tokens, EOS and stop tokens are masked
        (redrawn), as the real sampler masks them. A script comes first, then EOS (once
        past min_tokens); past it with ignore_eos, tokens are drawn as without one."""
        c, p, script = self.config, r.params, r.script
        if script is not None and not (p.ignore_eos and pos >= len(script)):
            if pos < len(script):
                return script[pos]
            if pos == max(len(script), p.min_tokens):
                return c.eos_token_id
        eos_at = None if script is not None else c.emit_eos_after
        if eos_at is not None and not p.ignore_eos:
            eos_at = max(eos_at, p.min_tokens)
        if pos == eos_at:
            return c.eos_token_id
        for salt in range(_MAX_REDRAWS):
            token = self._draw(r.request_id, pos, salt)
            if pos >= p.min_tokens or token not in p.stop_token_ids:
                break
        return token

    def _draw(self, request_id: str, pos: int, salt: int) -> int:
        """A token id in [FIRST_TOKEN_ID, vocab_size), never EOS, from a hash of its key."""
        c = self.config
        key = f"{c.seed}:{c.engine_index}:{pos}:{salt}:{request_id}".encode()
        h = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
        token = FIRST_TOKEN_ID + h % self._num_drawable
        return token + 1 if token >= c.eos_token_id >= FIRST_TOKEN_ID else token

    def _check_stop(self, r: _Request, token: int,
                    num_output: int) -> tuple[str | None, int | None]:
        """(finish_reason, stop_reason) after the num_output-th token: EngineCore's stop
        rule (engine/core/stop_rule.py), a stop token its own stop_reason."""
        rule = check_stop(token, num_output, r.prompt_len + num_output, r.params,
                          self._eos_token_ids, self.max_model_len)
        if rule is None:
            return None, None
        return rule.finish_reason, token if rule is StopRule.STOP_TOKEN else None

    def _logprobs(self, tokens: list[int], k: int | None) -> list[TokenLogprobs] | None:
        """Fake but well-formed logprobs: the sampled token first (rank 1), then the top k
        (the sampled token, then its neighbours in id order), as the real sampler lays out."""
        if k is None:
            return None
        span = self.config.vocab_size - FIRST_TOKEN_ID
        rows = []
        for t in tokens:
            top = [t] + [FIRST_TOKEN_ID + (t - FIRST_TOKEN_ID + j) % span for j in range(1, k)]
            rows.append(([t] + top[:k], [-0.25] + [-0.25 - j for j in range(k)],
                         [1] + list(range(1, k + 1))))
        return rows

    # ---- utilities (called by name over the wire) -------------------------------------
    def get_supported_tasks(self) -> list[str]:
        return ["generate"]

    def is_sleeping(self) -> bool:
        forced = self.config.force_is_sleeping
        return bool(self._asleep) if forced is None else forced

    def sleep(self, level: int = 1) -> None:
        """Enter sleep mode: in-flight requests end with "abort", new ones are refused."""
        if level not in (1, 2):
            raise InvalidRequestError(f"sleep level must be 1 or 2, got {level}")
        self.abort_requests(list(self._waiting) + list(self._running))
        self._drop_prefix_cache()  # as EngineCore: sleeping discards the KV cache
        self._asleep = set(SLEEP_TAGS)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake the given parts (SLEEP_TAGS; default all); awake once none is left asleep."""
        tags = list(SLEEP_TAGS) if tags is None else list(tags)
        unknown = set(tags) - set(SLEEP_TAGS)
        if unknown:
            raise InvalidRequestError(f"unknown wake_up tags {sorted(unknown)}")
        self._asleep -= set(tags)

    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        """As EngineCore: refused (False) while requests hold blocks, unless told to
        preempt them (the mock has nothing to preempt); drops the prefix index."""
        forced = self.config.force_reset_prefix_cache
        if forced is not None:
            return forced
        if self._running and not reset_running_requests:
            return False
        self._drop_prefix_cache()
        self._prefix_queries = self._prefix_hits = 0
        return True

    def get_memory_usage(self) -> dict[str, int]:
        return {"weights_bytes": 0, "kv_cache_bytes": 0}

    # No model, so nothing to profile, no multimodal or encoder cache and no forward pass
    # to run: these answer as no-ops, so a frontend that sends them (vLLM's do) works.
    def profile(self, is_start: bool = True) -> None:
        return None

    def reset_mm_cache(self) -> bool:
        return True

    def reset_encoder_cache(self) -> None:
        return None

    def execute_dummy_batch(self) -> None:
        return None

    def add_lora(self, lora_request) -> bool:
        raise InvalidRequestError(_NO_LORA)

    def remove_lora(self, lora_id: int) -> bool:
        return False

    def list_loras(self) -> list:
        return []

    def shutdown(self) -> None:
        """As EngineCore's: the server calls it when it stops; the mock holds no thread."""
        return None

    def get_stats(self) -> SchedulerStats:
        """Load snapshot; a running request holds ceil((prompt + output) / block_size) blocks."""
        used = sum(math.ceil((r.prompt_len + r.num_output) / self.block_size)
                   for r in self._running.values())
        return SchedulerStats(num_running_reqs=len(self._running),
                              num_waiting_reqs=len(self._waiting),
                              kv_cache_usage=min(1.0, used / self.num_blocks),
                              num_free_blocks=max(0, self.num_blocks - used),
                              prefix_cache_queries=self._prefix_queries,
                              prefix_cache_hits=self._prefix_hits,
                              iteration_tokens_counts=list(self._iteration_counts),
                              iteration_tokens_sum=self._iteration_sum)

    def ready_response(self, engine_index: int) -> EngineCoreReadyResponse:
        from engine import __version__
        return EngineCoreReadyResponse(
            engine_index=engine_index, max_model_len=self.max_model_len,
            num_gpu_blocks=self.num_blocks, block_size=self.block_size, dtype=self.dtype_name,
            version=__version__, supported_tasks=self.get_supported_tasks(),
            max_num_seqs=self.max_num_seqs, model=self.model_name, limits=self.limits)

