"""Shared fixtures: tiny random-weight checkpoints (Llama, Qwen2, Qwen3) and the default model.

Tiny models reuse the default model's tokenizer, so text prompts work; their
weights are random but seeded, with a large init scale so greedy argmaxes are
well separated (parity checks do not hinge on float ties).
"""
from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest
import torch

from engine.model.loader import load_tokenizer, resolve_model

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.2, rms_norm_eps=1e-6, tie_word_embeddings=False)


# Tests share 2 cores with other processes, where 2 torch threads stall each other:
# engines started by tests take their default thread count from OMP_NUM_THREADS.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)

# Without a GPU the Triton kernels run under Triton's interpreter (tests/
# test_triton_kernels.py). Triton reads this when a kernel is defined, so it is set
# before anything imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Engines that tests build in this process (LLM, EngineCore) get a CPU KV cache of at
# most 512 MiB and 16,384 blocks unless the test sizes it (kv_cache_memory_bytes,
# num_gpu_blocks_override), not the product's 2 GiB: a tiny model's 2 GiB is
# 260,000-520,000 blocks, a Python object each in the block manager, and the default
# model's is 2 GiB of pages backed at start (ModelRunner._prefault_kv, on a thread);
# 1-2 s an engine on this 2-core machine, and the suite builds hundreds. The pool still holds a
# full batch (256) of max-length sequences of every tiny model (512 tokens, blocks of 8
# or more) and leaves the default model its max_model_len (728 blocks of 16 tokens in
# float32). Engines in other processes (Ray replicas, the CLIs) keep the product's
# default; TP worker processes do too, but a pool is the smallest of its ranks' and
# rank 0 runs here.
TEST_KV_CACHE_BYTES = 512 << 20
TEST_KV_CACHE_BLOCKS = 16384
from engine.executor import kv_budget  # noqa: E402

assert hasattr(kv_budget, "CPU_DEFAULT_KV_CACHE_BYTES"), "what KVBudget reads on CPU"
kv_budget.CPU_DEFAULT_KV_CACHE_BYTES = TEST_KV_CACHE_BYTES
_product_max_kv_blocks = kv_budget.KVBudget.max_kv_blocks


def _test_max_kv_blocks(runner) -> int:
    blocks = _product_max_kv_blocks(runner)
    if runner.device.type != "cpu" or runner.config.kv_cache_memory_bytes or \
            runner.config.num_gpu_blocks_override:
        return blocks
    return min(blocks, TEST_KV_CACHE_BLOCKS)


kv_budget.KVBudget.max_kv_blocks = _test_max_kv_blocks


# Every vector path of the native CPU kernels, built on this host: the native one and the
# narrower ones of its CPU family (an AVX-512 host also runs the AVX2 and SSE2 builds;
# SSE2 shares its 4-lane code with NEON). Target -> the `isa` its module must report.
# `native` is the engine's own build: this CPU's, or the held one where
# FLOTILLA_KERNELS_MARCH holds the engine to a narrower path (`make test`'s AVX2 leg,
# which runs that path alone: the suite before it ran the others).
KERNEL_TARGETS = ({} if os.environ.get("FLOTILLA_KERNELS_MARCH")
                  else {"x86-64-v3": "avx2", "x86-64": "sse2"} if platform.machine() == "x86_64"
                  else {"armv8-a": "neon"} if platform.machine() == "aarch64" else {})


@pytest.fixture(scope="session", params=["native", *KERNEL_TARGETS])
def kernels(request):
    """The CPU kernel module built for one target (parametrized over every target)."""
    from engine.model.kernels import cpu_kernels
    native = cpu_kernels()
    assert native is not None, "the native CPU kernels should build on this machine"
    if request.param == "native" or native.isa == KERNEL_TARGETS[request.param]:
        return native  # e.g. an AVX2 host: its native build is the AVX2 path, no second build
    module = cpu_kernels(request.param)
    assert module is not None, f"the native CPU kernels should build for {request.param}"
    assert module.isa == KERNEL_TARGETS[request.param]
    return module



def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as the engine sees them: /proc/cpuinfo's, held to the
    x86 level of FLOTILLA_KERNELS_MARCH (the AVX2-held leg of `make test`)."""
    from engine.cpu_features import cpu_flags as engine_cpu_flags
    return engine_cpu_flags()


def amx_granted_here() -> bool:
    """Whether the native kernels must run AMX tiles here: the CPU has AMX_BF16 and Linux
    (5.16 on) grants the tile state."""
    import re
    linux = tuple(int(v) for v in re.findall(r"\d+", platform.release())[:2])
    return "amx_bf16" in cpu_flags() and platform.system() == "Linux" and linux >= (5, 16)

@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    return resolve_model("default")


@pytest.fixture(scope="session")
def default_model_reference() -> Path:
    """The default model as transformers reads its GGUF, as a float checkpoint: what HF
    references run. The engine serves the file's blocks (default_model_dir holds no float
    weights)."""
    from tests.gguf_helpers import decoded_default_model
    return decoded_default_model()


def build_tiny_model(out: Path, arch: str, tokenizer_dir: Path, **overrides) -> Path:
    """Save a random-weight HF checkpoint of `arch` (llama, qwen2, qwen3, mistral, mixtral,
    qwen2_moe, qwen3_moe, phi3, gemma3, gpt_oss, granitemoehybrid) under out."""
    from transformers import (AutoModelForCausalLM, Gemma3TextConfig, GptOssConfig,
                              GraniteMoeHybridConfig, LlamaConfig,
                              MistralConfig, MixtralConfig, Phi3Config, Qwen2Config,
                              Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig)
    tokenizer = load_tokenizer(tokenizer_dir)
    kwargs = dict(TINY, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, **overrides)
    config = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
              "mixtral": MixtralConfig, "qwen2_moe": Qwen2MoeConfig, "qwen3_moe": Qwen3MoeConfig,
              "phi3": Phi3Config, "mistral": MistralConfig,
              "gemma3": Gemma3TextConfig, "gpt_oss": GptOssConfig,
              "granitemoehybrid": GraniteMoeHybridConfig}[arch](**kwargs)
    if arch in ("qwen3", "qwen3_moe", "gemma3", "gpt_oss"):
        config.head_dim = 16
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_tokenizer_dir() -> Path:
    """The tiny models' tokenizer: the default model's, or FLOTILLA_TEST_TOKENIZER (a folder
    holding its files, for a GPU machine without the shipped model package)."""
    folder = os.environ.get("FLOTILLA_TEST_TOKENIZER")
    return Path(folder) if folder else resolve_model("default")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tiny_tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_model(root / arch, arch, tiny_tokenizer_dir)
            for arch in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> Path:
    return tiny_models["llama"]


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference: transformers generate, fp32, greedy, EOS ignored; one prompt at a time."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    results = []
    for ids in prompts:
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             eos_token_id=None, pad_token_id=0)
        results.append(out[0, len(ids):].tolist())
    return results


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    """The default model's tokenizer (the mock engines' frontends use it)."""
    return load_tokenizer(default_model_dir)


@pytest.fixture
def engines(tokenizer):
    """Mock engine-core servers started in this process (tests/test_core_client.py)."""
    from tests.test_core_client import Engines
    e = Engines(tokenizer)
    yield e
    e.stop()
