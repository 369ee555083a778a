"""EngineCore: the token-in/token-out heart of the engine (no tokenizer, no text).

add_request / abort_requests / step: the scheduler picks the batch, the model
runner computes it, the sampler picks tokens, and finished requests release
their KV blocks. One step returns one EngineCoreOutput per request that made
progress. This object is driven in-process by LLMEngine, or by the engine-core
server loop.

This module holds the set-up (model, KV pool, structured outputs, spec decode), the
request checks and the step. Split out by job, as mixins of EngineCore:
- engine/core/step_outputs.py: what a step's results mean for each request (tokens
  through the grammar and the stop rule, timings, trace spans, pooled vectors);
- engine/core/core_utilities.py: the utilities called between steps (sleep mode,
  cache resets, memory usage, KV events, ready response, stats);
- engine/lora/engine_side.py: the LoRA side.
"""
from __future__ import annotations

import logging
import time

import torch

from engine.config import EngineConfig
from engine.core.core_utilities import CoreUtilities
from engine.core.hybrid_config import hybrid_config
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_groups import KVGroups
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.stats_logger import StatsLogger
from engine.core.step_outputs import StepOutputs
from engine.core_messages import (
    FINISH_ABORT,
    ITERATION_TOKENS_BUCKETS,
    EngineCoreOutput,
    EngineCoreRequest,
    count_iteration,
)
from engine.errors import (
    DuplicateRequestError,
    EngineOverloadedError,
    EngineSleepingError,
    InvalidRequestError,
)
from engine.executor.model_runner import ModelRunner
from engine.executor.sampler import Sampler
from engine.generation_defaults import sampling_defaults
from engine.lora.engine_side import EngineLoRA
from engine.lora.manager import LoRAManager
from engine.lora.request import LoRARequest, adapter_id
from engine.lora.roots import lora_roots
from engine.model.kernels import cpu_kernels
from engine.model.shape import ModelShape
from engine.model.loader import is_gguf_checkpoint, load_hf_config, resolve_model
from engine.quant import check_quantized_family, checkpoint_quantization, resolve_quantization
from engine.pooling import Pooler, pooling_method
from engine.request_checks import check_params, check_prompt
from engine.request_limits import RequestLimits
from engine.sampling_params import SamplingParams
from engine.kv_transfer.steps import KVTransferSteps
from engine.kv_transfer.steps import connect as connect_kv_transfer
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.decoder import SpecDecoder
from engine.spec_decode.proposers import ProposerContext
from engine.spec_decode.verify import GeneratorRewind, sampling_rows
from engine.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class EngineCore(StepOutputs, CoreUtilities, EngineLoRA):
    """The engine core: what EngineCoreLike (engine/core/interface.py) lists."""

    def __init__(self, config: EngineConfig, worker_launcher=None,
                 kv_pages_before_ready: bool = True) -> None:
        """worker_launcher starts the tensor-parallel workers (ranks 1..N-1) when
        config.tensor_parallel_size > 1; default: local processes. kv_pages_before_ready
        False: the KV pool's pages (CPU) are backed in the background after ready, for
        an engine joining a server that already serves (deployments/serve/engine_server.py)."""
        self.config = config
        # seconds each part of the build took (the server logs them: where a start goes)
        self.startup_s: dict[str, float] = {}
        mark = time.perf_counter()
        self.limits = RequestLimits.of(config)
        self.checkpoint = resolve_model(config.model, weights=config.load_format != "dummy")
        hf_config = load_hf_config(self.checkpoint)
        self.quantization = resolve_quantization(
            config.quantization, "gguf" if is_gguf_checkpoint(self.checkpoint)
            else checkpoint_quantization(hf_config), config.model)
        self.shape = ModelShape.from_hf_config(hf_config)
        check_quantized_family(self.quantization, self.shape, config.model)
        self.kv_groups = KVGroups.of(self.shape)  # layers sharing block tables
        if self.shape.mamba is not None:  # its block size holds a state; no prefix cache
            config = self.config = hybrid_config(config, self.shape)
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(config.cpu_threads())
        max_len = self._max_model_len(self.shape)
        self.eos_token_ids = _eos_ids(self.checkpoint, hf_config)
        self.sampling_defaults = sampling_defaults(self.checkpoint, config.generation_config,
                                                   config.override_generation_config)
        self.startup_s["config"], mark = time.perf_counter() - mark, time.perf_counter()
        if config.tensor_parallel_size > 1:
            from engine.executor.tp_executor import TPExecutor
            self.runner = TPExecutor(config, self.shape, hf_config, self.checkpoint, max_len,
                                     self.device, self.dtype, worker_launcher)
        else:
            self.runner = ModelRunner(config, self.shape, hf_config, self.checkpoint, max_len,
                                      self.device, self.dtype)
        spec = SpeculativeConfig.from_dict(config.speculative_config)
        self.spec: SpecDecoder | None = None
        if spec is not None:  # before the pool is sized: a draft model's cache shares it
            SpecDecoder.check_model(self.shape)
            self.spec = SpecDecoder(spec, ProposerContext(
                config, self.shape, max_len, self.device, self.dtype, self._rank0_runner))
        self.startup_s["weights"], mark = time.perf_counter() - mark, time.perf_counter()
        self.num_blocks = self._num_blocks()
        self._rank0_runner.kv_pages_before_ready = kv_pages_before_ready
        self.runner.allocate_kv_cache(self.num_blocks)
        self.startup_s["kv_pool"], mark = time.perf_counter() - mark, time.perf_counter()
        # A request must fit in the pool on its own, or it could never be scheduled.
        self.max_model_len = self._pool_bounded_len(max_len)
        self.kv = self._kv_manager()
        self.scheduler = Scheduler(config, self.kv, self.max_model_len,
                                   config.step_token_budget(self.device))
        if self.spec is not None:
            self.spec.start(self.num_blocks, self.max_model_len)
            self.scheduler.on_finish = self.spec.finish
        kernels = cpu_kernels() if self.device.type == "cpu" else None
        self.sampler = Sampler(self.shape.vocab_size,
                               kernels.argmax_rows if kernels is not None else None,
                               seed=config.seed, device=self.device,
                               native_sample=kernels.sample_rows if kernels is not None else None)
        self.pooler = Pooler(pooling_method(self.checkpoint), self.shape.hidden_size)
        self.structured = StructuredOutputManager(
            self.checkpoint, self.shape.vocab_size, self.eos_token_ids,
            fill_threads=config.cpu_threads() if self.device.type == "cpu" else 1,
            compile_timeout_s=config.structured_outputs_compile_timeout_s)
        self.lora = LoRAManager(config.max_loras) if config.enable_lora else None
        self._checked_loras: set[LoRARequest] = set()  # adapters read once already
        self._lora_roots = lora_roots(config)
        self.requests: dict[str, Request] = {}
        for name, path in (config.lora_modules or {}).items():
            self.add_lora(LoRARequest(name, adapter_id(name), str(path)))
        self._aborted: list[EngineCoreOutput] = []
        self.stats_logger = StatsLogger(config.log_stats_interval_s)
        self._iteration_counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self._iteration_sum = 0
        self._sleep_level = 0  # 0 awake; 1 KV cache freed (weights off GPU); 2 weights freed
        self.kv_transfer: KVTransferSteps | None = None
        self.startup_s["rest"], mark = time.perf_counter() - mark, time.perf_counter()
        self._warm_up()
        self.startup_s["warm_up"] = time.perf_counter() - mark
        # after the warm-up, whose blocks must not reach a KV tier
        self.kv_transfer = connect_kv_transfer(self)
        logger.info("engine ready: %s on %s/%s, %d KV blocks of %d tokens, max_model_len %d, "
                    "sampling defaults %s (generation_config=%s)", self.shape.architecture,
                    self.device, self.dtype, self.num_blocks, config.block_size,
                    self.max_model_len, self.sampling_defaults or "neutral",
                    config.generation_config)

    # ---- set-up -----------------------------------------------------------------------
    def _warm_up(self) -> None:
        """One short request through every step kind (a prompt step, decode steps) before
        the engine reports ready, then forgotten: the first use of each path pays for
        oneDNN's primitives, torch's and the kernels' first-call set-up and the steps'
        buffers. Zen 4 held to AVX2 (session 42, xgrammar's import no longer beside the
        first requests), a fresh engine's first single-sequence decode against its
        second: 0.87-0.94 without it, 1.01 with it, for ~0.2 s of start. CPU only (CUDA
        captures its graphs instead); not with a draft model, whose proposer keeps
        acceptance counts of its own."""
        if self.device.type != "cpu" or self.spec is not None or self.max_model_len < 8:
            return
        n = min(64, self.max_model_len - 4)
        vocab = self.shape.vocab_size
        # this class's own methods: a subclass's overrides see only real requests
        EngineCore.add_request(self, EngineCoreRequest(
            "flotilla-warm-up", [(7 + 31 * i) % vocab for i in range(n)],
            SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)))
        for _ in range(64):
            EngineCore._step(self)
            if not self.requests:
                break
        EngineCore.abort_requests(self, ["flotilla-warm-up"])  # never left behind
        self._aborted.clear()
        self.kv.reset_prefix_cache()  # also zeroes the prefix-cache counters
        self.scheduler.num_preemptions = 0
        self._iteration_counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self._iteration_sum = 0
        self.stats_logger = StatsLogger(self.config.log_stats_interval_s)

    def _max_model_len(self, shape: ModelShape) -> int:
        limit = shape.max_position_embeddings
        wanted = self.config.max_model_len
        if wanted is not None and wanted > limit:
            raise InvalidRequestError(
                f"max_model_len {wanted} exceeds what the model supports ({limit})")
        return wanted or limit

    @property
    def _rank0_runner(self) -> ModelRunner:
        """This process's ModelRunner: the runner itself, or rank 0's under TP."""
        return getattr(self.runner, "runner", self.runner)

    def _kv_manager(self) -> KVCacheManager:
        """An empty block pool: a table per KV group; a state block a request (hybrids)."""
        return KVCacheManager(self.num_blocks, self.config.block_size,
                              self.config.enable_prefix_caching, self.kv_groups.windows,
                              self.shape.mamba is not None)

    def _pool_bounded_len(self, max_len: int) -> int:
        """max_len, or less where one sequence of it could not fit in the pool: a block a
        full-attention group for each block of its tokens, a sliding-window group only
        its window's and a step's (older blocks are given back), besides the null block
        (windows) and a state block (hybrids)."""
        bs, groups = self.config.block_size, self.kv_groups
        free = self.num_blocks - (1 if any(groups.windows) else 0) \
            - (1 if self.shape.mamba is not None else 0)
        step = self.config.step_token_budget(self.device)
        local = sum(-(-(w + step) // bs) + 1 for w in groups.windows if w)
        full = sum(1 for w in groups.windows if not w)
        if local <= free:
            if not full:
                return max_len
            return min(max_len, (free - local) // full * bs)
        return min(max_len, free // groups.count * bs)

    def _num_blocks(self) -> int:
        """Blocks of the pool: what fits on every rank (TP), shared with a draft model's
        cache where there is one (the same block ids index both)."""
        blocks = self.runner.max_kv_blocks()
        extra = self.spec.proposer.bytes_per_block() if self.spec is not None else 0
        if extra and not self.config.num_gpu_blocks_override:
            own = self._rank0_runner.bytes_per_block()
            blocks = max(1, blocks * own // (own + extra))
        return blocks

    @property
    def block_size(self) -> int:
        return self.config.block_size

    # ---- requests ---------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request; raises a typed InvalidRequestError if it cannot run."""
        if self._sleep_level:
            raise EngineSleepingError("the engine is asleep (sleep mode); call wake_up first")
        if req.request_id in self.requests:
            raise DuplicateRequestError(f"request id {req.request_id!r} is already running")
        # the batch's free slots take waiting requests at the next step: only those past
        # them wait in the queue that max_waiting_requests bounds
        free = max(0, self.config.max_num_seqs - len(self.scheduler.running))
        if len(self.scheduler.waiting) >= self.config.max_waiting_requests + free:
            raise EngineOverloadedError(
                f"the engine's waiting queue is full ({self.config.max_waiting_requests} "
                "requests, max_waiting_requests); retry shortly")
        # an embedding request generates nothing: its prompt may fill max_model_len
        spare = 1 if req.pooling_params is not None else 0
        check_prompt(req.prompt_token_ids, self.max_model_len + spare, self.shape.vocab_size)
        check_params(req.sampling_params, self.config.max_logprobs, self.shape.vocab_size,
                     self.limits)
        if req.priority != 0 and self.config.scheduling_policy != "priority":
            raise InvalidRequestError(
                f"priority {req.priority} needs scheduling_policy 'priority' (this engine "
                f"schedules {self.config.scheduling_policy}, where every priority is 0)")
        if req.pooling_params is not None:
            self.pooler.check(req.pooling_params)
        if req.lora_request is not None:
            self._check_lora(req.lora_request)
        request = Request(req.request_id, req.prompt_token_ids, req.sampling_params,
                          self.eos_token_ids, req.arrival_time or None, req.priority,
                          req.pooling_params, req.lora_request)
        request.trace_headers = req.trace_headers
        self.requests[req.request_id] = request
        self.structured.add(request)
        self.scheduler.add(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Stop requests at once; unknown or finished ids are ignored (idempotent)."""
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
            self._aborted.append(EngineCoreOutput(request_id, [], FINISH_ABORT,
                                                  num_cached_tokens=max(0, request.num_cached_tokens)))

    def has_unfinished_requests(self) -> bool:
        """True while a step has something to do or to report (aborts included)."""
        return self.scheduler.has_unfinished() or bool(self._aborted)

    def next_step_delay(self) -> float | None:
        """0.0 while a step has something to do (a real step computes at once: it waits
        for no clock, unlike the mock's), None when idle."""
        return 0.0 if self.has_unfinished_requests() else None

    def step(self) -> list[EngineCoreOutput]:
        """Run one scheduling step; return the outputs it produced (possibly none)."""
        outputs = self._step()
        if self.stats_logger.enabled:
            self.stats_logger.maybe_log(self.get_stats)
        return outputs

    def _step(self) -> list[EngineCoreOutput]:
        outputs, self._aborted = self._aborted, []
        for request, why in self.structured.poll():
            outputs.append(self._fail(request, why))
        transfer = self.kv_transfer  # a KV connector (engine/kv_transfer/steps.py)
        if transfer is not None:
            outputs.extend(self._fail(r, why) for r, why in transfer.before_schedule())
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        if sched and self.lora is not None:
            outputs.extend(self._place_adapters(sched))
        if transfer is not None:
            transfer.after_schedule(sched)
        if not sched:
            if transfer is not None:
                transfer.idle()  # only loads may be left: do not spin
            if self.structured.has_pending():
                self.structured.wait()  # only compiles are left: do not spin
            return outputs
        result = self.runner.execute(sched)
        if transfer is not None:
            transfer.after_forward()
        if self.spec is not None:
            self.spec.proposer.after_step()
        logits, rows = result.logits, result.sample_rows
        prompt_tokens = 0
        for request, n in zip(sched.requests, sched.num_new_tokens):
            prompt_tokens += max(0, min(n, request.num_prompt_tokens
                                        - request.num_computed_tokens))
            request.num_computed_tokens += n
        step_tokens = sum(sched.num_new_tokens)
        count_iteration(self._iteration_counts, step_tokens)
        self._iteration_sum += step_tokens
        for i, hidden in result.pooled:
            outputs.extend(self._pool(sched.requests[i], hidden))
        for i, span_rows in result.prompt_logprobs:
            sched.requests[i].prompt_logprobs.extend(span_rows)
        if not rows:
            self.stats_logger.count(prompt_tokens, 0)
            return outputs
        # a request with proposed tokens has a row for each (engine/spec_decode/verify.py)
        views, spans = sampling_rows([sched.requests[i] for i in rows])
        rewind = GeneratorRewind(spans) if self.spec is not None else None
        result = self.sampler(logits, views, self.structured.bitmask(views))
        now = time.monotonic()
        emitted = 0
        for request, start, end in spans:
            accepted = 0
            if end - start > 1:
                accepted = self.spec.settle(request, result.token_ids[start:end])
                rewind.rewind(request, accepted + 1)
            out = self._emit(request, result, range(start, start + accepted + 1), now)
            emitted += len(out.new_token_ids)
            outputs.append(out)
            if end - start > 1 and request.status == RequestStatus.RUNNING:
                self.kv.trim(request)  # the rejected tokens' slots
        self.stats_logger.count(prompt_tokens, emitted)
        return outputs

    def shutdown(self) -> None:
        """Stop the grammar compile thread, a KV connector's threads and the
        tensor-parallel workers, if any."""
        self.structured.shutdown()
        if self.kv_transfer is not None:
            self.kv_transfer.shutdown()
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()


def _eos_ids(checkpoint, hf_config) -> tuple[int, ...]:
    ids = None
    if (checkpoint / "generation_config.json").exists():
        from transformers import GenerationConfig
        ids = GenerationConfig.from_pretrained(str(checkpoint)).eos_token_id
    if ids is None:
        ids = getattr(hf_config, "eos_token_id", None)
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, (list, tuple)) else (int(ids),)
