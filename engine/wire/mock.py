"""MockEngineCore: a model-free engine core with deterministic tokens and a latency model.

Why: the frontend (ingress, core client, output processor, coordinator) has to be
benchmarked and tested without the cost and the noise of a model. The mock has
EngineCore's interface, so the engine-core server hosts it unchanged, and its
tokens are a pure function of (seed, engine index, request id, output position):
a test can predict what a client must receive, whatever else runs in the batch.

Time is simulated on an absolute schedule, never slept: a request's first token
is due at admission + ttft_s + prefill_s_per_token * its uncached prompt tokens,
then one token every itl_s (with serial_prefill, prefills run one after another, as
on a compute-bound engine, so a queue of prompts delays the next one). step() returns what is due now (at most one output per request,
as a real step); next_step_delay() says when the next output will be, so the
server can block on its socket in between.

Scripted (MockConfig.scripted, with the frontends' tokenizer): a prompt's last
`[[emit]]text[[/emit]]` directive is its output (then EOS), its structured outputs
checked against it (engine/wire/mock_script.py); stop rules apply as to drawn tokens.

Kept from a real engine: request validation and its typed errors, the stop rules
(EOS, stop_token_ids, min_tokens masking both, max_tokens, max_model_len), at
most max_num_seqs running requests (the rest wait, first come first served), KV
block accounting for stats, sleep mode, the prefix cache: full prompt blocks are
named by the engine's own hash chain (engine/core/block_hash.py) and kept in an LRU
index of num_blocks blocks; a request's longest cached prefix (one token is always
computed) is its num_cached_tokens, skips prefill time, counts in the prefix-cache
stats, and the index publishes KV events as EngineCore does, so prefix-aware routing
is testable without a model. Left out: preemption, blocks held by running requests
(the index only holds finished prompts' blocks, by LRU), real logprobs (fake ones of
the right shape).
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
from engine.errors import (
    DuplicateRequestError,
    EngineOverloadedError,
    EngineSleepingError,
    InvalidRequestError,
)
from engine.options import add_flags, dataclass_options, given, option
from engine.request_checks import check_prompt
from engine.request_limits import RequestLimits, check_limits
from engine.sampling_params import SamplingParams
from engine.wire.mock_script import MockScript, default_tokenizer
from engine.wire.protocol import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    ITERATION_TOKENS_BUCKETS,
    PROTOCOL_VERSION,
    EngineCoreOutput,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    KVEvents,
    RequestTimings,
    SchedulerStats,
    TokenLogprobs,
    count_iteration,
)

# Drawn token ids lie in [FIRST_TOKEN_ID, vocab_size): ids below are specials (pad, bos, eos).
FIRST_TOKEN_ID = 3
SLEEP_TAGS = ("weights", "kv_cache")  # what sleep() puts to sleep; wake_up(tags) wakes some
_MAX_REDRAWS = 64  # redraws of a stop token masked by min_tokens (then it is kept)


@dataclass(frozen=True)
class MockTiming:
    """The mock's latency model and output shape: what a benchmark or a test chooses.
    The served app exposes these as mock_<name> (deployments.config.AppArgs)."""

    ttft_s: float = option(0.0, "seconds from admission to the first token, besides the "
                                "prefill time")
    prefill_s_per_token: float = option(0.0, "extra seconds per prompt token before the "
                                             "first token")
    itl_s: float = option(0.0, "seconds between two tokens of one request")
    output_chunk_size: int = option(1, "tokens per engine output message (the last one may "
                                       "hold fewer)")
    emit_eos_after: int | None = option(None, "output index where EOS is drawn (not before "
                                              "min_tokens); none: only stop rules end a request")
    num_blocks: int = option(1024, "KV blocks the mock accounts for (stats and autoscaling)")
    scripted: bool = option(False, "a prompt's last [[emit]]text[[/emit]] directive is its "
                                   "output, then EOS (in the default model's tokens)")

    def __post_init__(self) -> None:
        _check([
            (self.num_blocks >= 1, "num_blocks must be >= 1"),
            (self.output_chunk_size >= 1, "output_chunk_size must be >= 1"),
            (min(self.ttft_s, self.prefill_s_per_token, self.itl_s) >= 0.0,
             "latencies must be >= 0"),
            (self.emit_eos_after is None or self.emit_eos_after >= 0,
             "emit_eos_after must be >= 0"),
        ])


@dataclass(frozen=True)
class MockConfig(MockTiming):
    """Mock engine options: its timing plus the shape a real engine would report (names
    as in EngineConfig where they mean the same)."""

    seed: int = option(0, "seed of the token hash")
    engine_index: int = 0  # part of the token hash: DP ranks answer differently
    vocab_size: int = option(32000, "ids the mock draws tokens from")
    eos_token_id: int = option(2, "the id it draws as EOS")
    max_model_len: int = option(4096, "context length it enforces (prompt + output)")
    block_size: int = option(16, "tokens per KV block it accounts")
    max_num_seqs: int = option(256, "the most running requests (the rest wait)")
    max_waiting_requests: int = option(4096, "the most waiting requests (more: refused, "
                                             "EngineOverloadedError)")
    enable_prefix_caching: bool = option(True, "keep an LRU index of prompt blocks: cached "
                                               "prefixes skip prefill time, KV events")
    serial_prefill: bool = option(False, "prefills run one after another (a compute-bound "
                                         "engine): queued prompts delay the next")
    force_is_sleeping: bool | None = None  # test knob: is_sleeping() answers this
    force_reset_prefix_cache: bool | None = None  # test knob: reset_prefix_cache() answers this

    def __post_init__(self) -> None:
        super().__post_init__()
        _check([
            (0 <= self.eos_token_id < self.vocab_size, "eos_token_id must be in [0, vocab_size)"),
            (self.vocab_size > FIRST_TOKEN_ID + (self.eos_token_id >= FIRST_TOKEN_ID),
             f"vocab_size must leave ids to draw from beyond the specials [0, {FIRST_TOKEN_ID})"),
            (self.max_model_len >= 2, "max_model_len must be >= 2"),
            (self.block_size >= 1, "block_size must be >= 1"),
            (self.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
        ])


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


def _check(checks: list[tuple[bool, str]]) -> None:
    for ok, message in checks:
        if not ok:
            raise InvalidRequestError(f"mock engine: {message}")


@dataclass(slots=True, eq=False)
class _Request:
    request_id: str
    prompt_len: int
    params: SamplingParams
    limit: int  # most output tokens: max_tokens, and what max_model_len leaves
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
    """EngineCore's interface over deterministic tokens; see the module docstring."""

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
        room = self.max_model_len - len(ids)
        max_tokens = req.sampling_params.max_tokens
        limit = room if max_tokens is None else min(max_tokens, room)
        script = None if text is None else self._script.tokens(
            text, req.sampling_params.structured_outputs)
        now = self._clock()
        self._waiting[rid] = _Request(rid, len(ids), req.sampling_params, limit, now,
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
        """(finish_reason, stop_reason) after the num_output-th token; EngineCore's rules."""
        p = r.params
        past_min = num_output >= p.min_tokens
        if past_min and not p.ignore_eos and token == self.config.eos_token_id:
            return FINISH_STOP, None
        if past_min and token in p.stop_token_ids:
            return FINISH_STOP, token
        if num_output >= r.limit:
            return FINISH_LENGTH, None
        return None, None

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
            max_num_seqs=self.max_num_seqs, model=self.model_name,
            limits=self.limits, protocol_version=PROTOCOL_VERSION)


# ---- `python -m engine.wire.mock` / `flotilla mock-engine` ------------------------------------
MOCK_OPTIONS = dataclass_options(MockConfig)  # every documented field: timing and shape


def add_curve_argument(parser) -> None:
    parser.add_argument("--curve-keys", metavar="JSON_FILE",
                        help="serve over ZMQ CURVE with these keys (a JSON object of "
                             "EngineKeys' four fields, engine/wire/curve_auth.py); only "
                             "clients holding its client pair are admitted")


def add_mock_arguments(parser) -> None:
    """The mock engine's command-line options (shared by both entry points)."""
    parser.add_argument("--address", required=True,
                        help="tcp://host:port or ipc://path; engine i gets port+i / path-i")
    parser.add_argument("--engines", type=int, default=1, help="engines to start (processes)")
    add_curve_argument(parser)
    add_flags(parser, MOCK_OPTIONS)


def config_from_args(args, engine_index: int) -> MockConfig:
    return MockConfig(engine_index=engine_index, **given(args, MOCK_OPTIONS))


def serve_one(config: MockConfig, address: str, keys_file: str | None = None) -> None:
    """Run one mock engine-core server until SIGTERM / SIGINT."""
    import signal

    from engine.wire.core_server import EngineCoreServer
    from engine.wire.curve_auth import EngineKeys
    keys = EngineKeys.load(keys_file) if keys_file else None
    core = MockEngineCore(config, tokenizer=default_tokenizer() if config.scripted else None)
    server = EngineCoreServer(core, address, config.engine_index, keys=keys)
    signal.signal(signal.SIGTERM, lambda *_: server.shutdown())
    try:
        server.run()
    except KeyboardInterrupt:
        pass


def run_mock_engines(args) -> int:
    """Start args.engines mock servers, one process each; wait for them."""
    import multiprocessing

    from engine.wire.core_server import engine_addresses
    addresses = engine_addresses(args.address, args.engines)
    if args.engines == 1:
        serve_one(config_from_args(args, 0), addresses[0], args.curve_keys)
        return 0
    import signal

    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=serve_one, args=(config_from_args(args, i), a, args.curve_keys),
                         daemon=True)
             for i, a in enumerate(addresses)]
    for p in procs:
        p.start()

    def _stop(*_):  # SIGTERM to the parent takes the engines down with it
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, _stop)
    try:
        for p in procs:
            p.join()
    except KeyboardInterrupt:
        pass
    finally:
        for p in procs:
            p.terminate()
            p.join(5)
    return 0


def main(argv=None) -> int:
    import argparse
    import logging
    parser = argparse.ArgumentParser(prog="python -m engine.wire.mock",
                                     description="model-free engine-core server(s)")
    add_mock_arguments(parser)
    logging.basicConfig(level=logging.INFO)
    return run_mock_engines(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
