"""EngineConfig: every engine knob in one frozen, checked object.

Built once (by LLM, the CLI or the engine-core server) and handed to the
Scheduler, the KV cache and the model runner; nothing else threads kwargs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.cpu_features import cpu_has_native_bf16, missing_bf16_message
from engine.errors import InvalidRequestError
from engine.kv_transfer.config import KVTransferConfig, kv_transfer_from_options
from engine.lora.modules_flag import parse_lora_modules
from engine.model.attention.names import BACKEND_NAMES
from engine.options import option

if TYPE_CHECKING:
    import torch

CPU_STEP_TOKENS = 512  # default step token budget on CPU (see step_token_budget)
CUDA_STEP_TOKENS = 8192
# by name: torch is imported only where a dtype is made, so that the processes that
# merely configure an engine (the CLI, the coordinator, the ingress) never load it
_DTYPES = {"auto": None, "float32": "float32", "fp32": "float32", "float": "float32",
           "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16",
           "fp16": "float16", "half": "float16"}

# kv_cache_dtype's values: vLLM's names for the types served (fp8 is e4m3, as in vLLM)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")

# CPU KV cache budget when kv_cache_memory_bytes is not set (vLLM's CPU default is 4 GiB).
CPU_DEFAULT_KV_CACHE_BYTES = 2 << 30


# the options that bound one request (engine.request_limits.RequestLimits carries them)
LIMIT_OPTIONS = ("max_stop_strings", "max_stop_string_chars", "max_bad_words",
                 "max_bad_word_chars", "max_logit_bias", "max_allowed_token_ids",
                 "max_sequences_per_request", "max_structured_output_chars")


@dataclass(frozen=True)
class EngineConfig:
    """Engine options; names follow vLLM's engine arguments."""

    model: str = option("default", "a Hugging Face checkpoint directory, a .gguf file, "
                        "'default' (SmolLM2-135M-Instruct, shipped) or 'mock' (served "
                        "apps only: a model-free engine)")
    dtype: str = option("auto", "weights and activations; auto: bfloat16 on CUDA and on CPUs "
                        "with native bf16 (avx512_bf16 or AMX), else float32; bfloat16 "
                        "on a CPU without it is refused", choices=tuple(_DTYPES))
    device: str = option("auto", "auto (cuda when available, else cpu), cpu, cuda or cuda:N")
    block_size: int = option(16, "tokens per KV-cache block (a power of two)")
    max_num_seqs: int = option(256, "the most sequences in one batch")
    max_num_batched_tokens: int | None = option(
        None, "the most tokens one step computes (longer prompts are prefilled in chunks); "
        f"none: {CPU_STEP_TOKENS} on CPU, {CUDA_STEP_TOKENS} on CUDA")
    max_model_len: int | None = option(None, "context length (prompt + output); none: the "
                                             "model's max_position_embeddings")
    kv_cache_memory_bytes: int | None = option(
        None, "bytes for the KV cache; none: 2 GiB on CPU, gpu_memory_utilization on GPU")
    gpu_memory_utilization: float = option(0.9, "share of GPU memory the engine may use "
                                                "(weights + KV cache)")
    num_gpu_blocks_override: int | None = option(None, "exact number of KV-cache blocks, "
                                                       "ignoring the memory budget (testing)")
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of shared prompt prefixes")
    num_threads: int | None = option(None, "torch CPU threads; none: OMP_NUM_THREADS, else "
                                           "every core this process may run on")
    seed: int = option(0, "base seed of sampling (a request's own seed overrides it)")
    scheduling_policy: str = option(
        "fcfs", "order of waiting requests: fcfs (arrival) or priority (a request's "
        "priority, lower first, ties by arrival; a request that does not fit preempts "
        "running ones of lower priority)", choices=("fcfs", "priority"))
    log_stats_interval_s: float = option(10.0, "seconds between the engine's status lines "
                                                "while it is busy (throughput, queue, KV "
                                                "usage, prefix hit rate); 0: none")
    tensor_parallel_size: int = option(1, "ranks the model is split over (heads, MLP, vocab)")
    max_logprobs: int = option(20, "the most logprobs a request may ask for per token")
    # what one request may ask (engine.request_limits): refused with a 400 naming the limit
    max_stop_strings: int = option(64, "the most stop strings one request may give")
    max_stop_string_chars: int = option(512, "the longest stop string, in characters")
    max_bad_words: int = option(128, "the most bad_words one request may give")
    max_bad_word_chars: int = option(256, "the longest bad word, in characters")
    max_logit_bias: int = option(1024, "the most logit_bias entries one request may give")
    max_allowed_token_ids: int = option(131072, "the most allowed_token_ids one request "
                                                "may give")
    max_sequences_per_request: int = option(
        512, "the most sequences one API request may start: its prompts x n")
    max_structured_output_chars: int = option(
        65536, "the longest structured-outputs constraint (JSON schema, regex, EBNF "
        "grammar, or all choices together), in characters")
    structured_outputs_compile_timeout_s: float = option(
        60.0, "a grammar still compiling after this long is abandoned (its requests fail "
        "with a 400; past 4 abandoned compiles still running, new ones get 429)")
    max_waiting_requests: int = option(
        4096, "the most requests an engine queues before it refuses more (HTTP 429 with "
        "Retry-After); its running batch is max_num_seqs beside them")
    generation_config: str = option(
        "auto", "sampling defaults for what a request leaves unset: auto (the model's "
        "generation_config.json), vllm (neutral: temperature 1, no top-k/top-p) or a "
        "folder holding a generation_config.json")
    enable_lora: bool = option(False, "serve LoRA adapters (PEFT format) on top of the model")
    max_loras: int = option(1, "adapters resident on the device at once (the most one step "
                               "mixes)")
    max_lora_rank: int = option(16, "the highest adapter rank accepted")
    max_cpu_loras: int | None = option(None, "adapters cached in host memory; none: max_loras")
    lora_modules: dict | None = option(
        None, 'adapters loaded at start: name=path ... (vLLM\'s forms: also {"name": ..., '
        '"path": ...} per adapter) or one JSON object {"name": "path", ...}',
        parse=parse_lora_modules)
    allowed_lora_roots: str | None = option(
        None, "folders (separated by ':') that an adapter loaded at run time must lie in "
        "(add_lora, /v1/load_lora_adapter, an engine-core request naming a path), symlinks "
        "resolved; none: any folder. lora_modules are always allowed")
    attention_backend: str = option(
        "auto", "attention kernels: auto (the native kernels on CPU; on CUDA triton, or "
        "FlexAttention where triton does not import), native (CPU only), flex (FlexAttention; eager, unfused on CPU), triton "
        "(Triton paged attention and fused layer kernels; on CPU only under "
        "TRITON_INTERPRET=1, for tests) or torch (the gather path)",
        choices=("auto", *BACKEND_NAMES))
    kv_cache_dtype: str = option(
        "auto", "the KV cache's element type: auto (the activation dtype) or fp8 (alias "
        "fp8_e4m3: e4m3 bytes with a scale per layer for keys and for values, the "
        "checkpoint's k_scale / v_scale or 1.0; twice the blocks per GiB of bf16). fp8 is "
        "read by the native CPU, triton and torch attention backends, not flex",
        choices=KV_CACHE_DTYPES)
    enforce_eager: bool = option(False, "CUDA: run decode steps eagerly instead of "
                                        "replaying CUDA graphs captured per batch size")
    quantization: str | None = option(
        None, "how the checkpoint's weights are quantized (vLLM's --quantization): none "
        "reads it from the checkpoint; a value must name the checkpoint's own format "
        "(gguf for a .gguf file, whose blocks are served as stored; awq or gptq (or "
        "vLLM's awq_marlin / gptq_marlin) for int4 ones; compressed-tensors for int8 W8A8 "
        "and FP8; fp8 for vLLM's own fp8 checkpoints)")
    load_format: str = option("auto", "auto: the checkpoint's weights; dummy: random weights "
                                      "of its shapes (benchmarks, no weight files needed; "
                                      "in its declared format for fp8 and AWQ configs)",
                              choices=("auto", "dummy"))
    speculative_config: dict | None = option(
        None, 'speculative decoding (vLLM\'s JSON): {"method": "ngram", '
        '"num_speculative_tokens": 5, "prompt_lookup_max": 5, "prompt_lookup_min": 2} or '
        '{"method": "suffix"} (suffix_decoding_max_tree_depth, _max_cached_requests, '
        '_max_spec_factor, _min_token_prob); disable_by_batch_size turns it off for '
        'larger batches. Proposed tokens are verified in one step; outputs are the same')
    kv_transfer_config: KVTransferConfig | None = option(
        None, 'a KV connector (vLLM\'s JSON): {"kv_connector": NAME, "kv_role": "kv_producer" '
        '| "kv_consumer" | "kv_both", "kv_connector_extra_config": {...}} with vLLM\'s other '
        'keys (kv_load_failure_policy fail | recompute, engine_id, kv_port, kv_buffer_device '
        'cpu | cuda); a connector, key or value not served is refused by name')
    kv_offloading_size: float | None = option(
        None, "GiB of host memory that KV blocks are offloaded to (vLLM's shorthand for "
        'kv_transfer_config {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", '
        '"kv_connector_extra_config": {"cpu_bytes_to_use": GiB x 2^30}}); none: no '
        "offloading")
    kv_offloading_backend: str = option(
        "native", "what kv_offloading_size offloads through: native (OffloadingConnector); "
        "vLLM's lmcache is not served")
    override_generation_config: dict | None = option(
        None, "sampling defaults (JSON) that take precedence over generation_config, "
        'e.g. {"temperature": 0.6}')

    def __post_init__(self) -> None:
        checks = [
            (self.dtype in _DTYPES, f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}"),
            (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
             f"device must be auto, cpu or cuda[:N], got {self.device!r}"),
            (self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
             f"block_size must be a power of two, got {self.block_size}"),
            (self.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
            (self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
             "max_num_batched_tokens must be >= 1"),
            (self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be >= 1"),
            (self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
             "kv_cache_memory_bytes must be > 0"),
            (0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be in (0, 1]"),
            (self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 1,
             "num_gpu_blocks_override must be >= 1"),
            (self.num_threads is None or self.num_threads >= 1, "num_threads must be >= 1"),
            (self.scheduling_policy in ("fcfs", "priority"),
             f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}"),
            (self.log_stats_interval_s >= 0, "log_stats_interval_s must be >= 0"),
            (self.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1"),
            (self.max_loras >= 1, "max_loras must be >= 1"),
            *[(getattr(self, name) >= 1, f"{name} must be >= 1") for name in LIMIT_OPTIONS],
            (self.max_waiting_requests >= 1, "max_waiting_requests must be >= 1"),
            (self.structured_outputs_compile_timeout_s > 0,
             "structured_outputs_compile_timeout_s must be > 0"),
            (self.attention_backend in ("auto", *BACKEND_NAMES),
             f"attention_backend must be auto, {', '.join(BACKEND_NAMES[:-1])} or "
             f"{BACKEND_NAMES[-1]}, got {self.attention_backend!r}"),
            (self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
             f"{self.kv_cache_dtype!r} (e5m2 caches are not served)"),
            (self.load_format in ("auto", "dummy"),
             f"load_format must be auto or dummy, got {self.load_format!r}"),
            (self.max_lora_rank >= 1, "max_lora_rank must be >= 1"),
            (self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
             "max_cpu_loras must be >= max_loras"),
            (not self.lora_modules or self.enable_lora, "lora_modules needs enable_lora"),
            (self.allowed_lora_roots is None or self.enable_lora,
             "allowed_lora_roots needs enable_lora"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)
        from engine.spec_decode.config import SpeculativeConfig
        SpeculativeConfig.from_dict(self.speculative_config)  # refused here if invalid
        # parsed once, here: the engine_id drawn now is kept by every copy of the config
        object.__setattr__(self, "kv_transfer_config", kv_transfer_from_options(
            self.kv_transfer_config, self.kv_offloading_size, self.kv_offloading_backend))

    def torch_device(self) -> torch.device:
        import torch
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        import torch
        chosen = _DTYPES[self.dtype]
        if chosen == "bfloat16" and device.type == "cpu" and not cpu_has_native_bf16():
            # Refused rather than served in float32 behind the operator's back: on such a
            # CPU (Zen 3, other AVX2-only parts) bf16 matmuls are emulated, slower than
            # float32, and oneDNN's packing refuses them outright.
            raise InvalidRequestError(missing_bf16_message())
        if chosen is not None:
            return getattr(torch, chosen)
        if device.type == "cuda":
            return torch.bfloat16
        # bf16 matmuls ran 2.2x faster than fp32 here (avx512_bf16); without native bf16
        # dot products they are emulated and slower than fp32 (docs/benchmarks.md).
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32

    def step_token_budget(self, device: torch.device) -> int:
        """max_num_batched_tokens, or the device's default. A CPU computes a 64-token
        prompt in ~40 ms (SmolLM2-135M, two Zen 4 cores), so 8,192 tokens would stall
        every running stream for seconds and make a burst of prompts all wait for the
        whole burst: served at concurrency 32 (bench/serve.py, docs/benchmarks.md), 512
        gave TTFT p50 805 ms against 1,500 ms for 8,192 at the same output tok/s (256:
        518 ms but 3 % fewer tokens/s)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return CUDA_STEP_TOKENS if device.type == "cuda" else CPU_STEP_TOKENS

    def cpu_threads(self) -> int:
        return self.num_threads or default_num_threads()


def default_num_threads() -> int:
    """torch threads when the config names none: OMP_NUM_THREADS if set, else every core
    this process may run on.

    Measured on the 2-core machine (docs/benchmarks.md): on a quiet machine two threads
    ran W1 1.85x faster than one; with another process busy on one core, two threads
    ran 1.9x slower than one (each op waits for the descheduled thread). A serving
    engine owns its cores, so the default is all of them; Ray sets OMP_NUM_THREADS
    from an actor's num_cpus, so engine replicas follow their resource request.
    """
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)
