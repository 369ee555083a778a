"""The engine on CUDA: greedy parity with HF, the scheduler's paths (chunked prefill,
preemption, prefix caching, n > 1) over FlexAttention and the Triton kernels
(attention_backend flex / triton) and the decode CUDA graphs, sleep
levels freeing GPU memory, the KV budget from gpu_memory_utilization, and tensor
parallelism over NCCL.

CI machines have no GPU: these tests skip there (and run wherever one is present)."""
import gc

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import hf_greedy
from tests.test_flex_attention import check_prefix_hits_and_n
from tests.test_parity import _prompts

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
pytestmark = needs_cuda
N = 32
BACKENDS = ["flex", "triton"]


def _greedy(llm, prompts, n=N, **extra):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **extra)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _llm(model, **kwargs) -> LLM:
    """An engine on the GPU; its KV cache capped at 1 GiB unless the test sizes it, so the
    engines a test module leaves to the garbage collector do not crowd the next."""
    kwargs.setdefault("device", "cuda")
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("max_num_seqs", 64)  # 11 graph sizes to capture (and compile, flex)
    if "gpu_memory_utilization" not in kwargs:
        kwargs.setdefault("kv_cache_memory_bytes", 1 << 30)
    return LLM(str(model), **kwargs)


def _core(llm):
    return llm.llm_engine.engine_core


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_cuda_greedy_matches_hf(tiny_models, arch, backend):
    prompts = _prompts([3, 17, 40, 64, 9])
    llm = _llm(tiny_models[arch], attention_backend=backend)
    core = _core(llm)
    assert core.device.type == "cuda" and core.runner.attention.name == backend
    assert core.runner.graphs is not None  # decodes replay captured graphs
    assert _greedy(llm, prompts) == hf_greedy(tiny_models[arch], prompts, N)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_cuda_chunks_preemption_prefix_hits_and_n(tiny_llama, eager, backend):
    prompts = _prompts([17, 17, 70, 5, 33])
    llm = _llm(tiny_llama, max_num_batched_tokens=48, num_gpu_blocks_override=12,
               enforce_eager=eager, attention_backend=backend)
    assert (_core(llm).runner.graphs is None) == eager
    assert _greedy(llm, prompts) == hf_greedy(tiny_llama, prompts, N)
    assert _core(llm).scheduler.num_preemptions > 0
    check_prefix_hits_and_n(llm, tiny_llama, prompts[2][:40])


@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_graph_batches_of_every_bucket_match_eager(tiny_llama, backend):
    """Batches that pad to a larger captured size give the eager engine's tokens (Triton:
    each size's split count fixed at capture)."""
    prompts = _prompts([5 + 3 * i for i in range(37)])
    eager = _greedy(_llm(tiny_llama, enforce_eager=True, attention_backend=backend),
                    prompts, 12)
    llm = _llm(tiny_llama, attention_backend=backend)
    assert _greedy(llm, prompts, 12) == eager
    assert _greedy(llm, prompts[:3], 12) == eager[:3]


@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_bf16_logprobs_close_to_hf_fp32(tiny_llama, backend):
    """bf16 on the GPU against HF in float32: the first token's top logprobs agree within
    bf16's rounding."""
    from transformers import AutoModelForCausalLM
    prompts = _prompts([9, 40, 77])
    llm = _llm(tiny_llama, dtype="bfloat16", attention_backend=backend)
    out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, logprobs=5),
                       use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), torch_dtype=torch.float32)
    for prompt, o in zip(prompts, out):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt])).logits[0, -1]
        expected = torch.log_softmax(logits, -1)
        top = o.outputs[0].logprobs[0]
        for token, lp in top.items():
            want = expected[token].item()
            assert abs(lp.logprob - want) < 0.05 + 0.02 * abs(want)  # bf16: ~3 significant digits


@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_moe_matches_hf_and_its_graphs_match_eager(tmp_path_factory, tiny_tokenizer_dir,
                                                        backend):
    """Qwen3-MoE on the GPU: in float32 the experts run one matmul each (torch's grouped
    matmul takes bf16 on CUDA), eagerly, and equal HF; in bf16 the grouped matmul keeps
    its offsets on the device, so decode steps replay graphs, which equal eager steps."""
    from engine.model.layers.moe import grouped_mm_available
    from tests.conftest import build_tiny_model
    from tests.test_moe import MOE_CONFIGS
    model = build_tiny_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe",
                             tiny_tokenizer_dir, **MOE_CONFIGS["qwen3_moe"])
    prompts = _prompts([3, 17, 40, 64, 9])
    llm = _llm(model, attention_backend=backend)
    assert _greedy(llm, prompts) == hf_greedy(model, prompts, N)
    graphs = _llm(model, dtype="bfloat16", attention_backend=backend)
    grouped = grouped_mm_available(torch.device("cuda"), torch.bfloat16)
    assert (_core(graphs).runner.graphs is not None) == grouped
    if not grouped:
        pytest.skip("torch's grouped matmul does not run on this GPU: no MoE graphs")
    eager = _llm(model, dtype="bfloat16", enforce_eager=True, attention_backend=backend)
    assert _greedy(graphs, prompts, 12) == _greedy(eager, prompts, 12)


def test_cuda_fp8_kv_cache_on_the_triton_kernels(tiny_llama):
    """The Triton kernels on an e4m3 cache, compiled: four times float32's blocks in the
    same bytes; decodes replayed from graphs give the eager engine's tokens and
    logprobs; against the float cache, within fp8's rounding (the CPU tests hold the
    kernels to the native kernel's fp8 engine within summation order), through chunked
    prefill and a prefix hit."""
    from tests.test_kv_cache_fp8 import _agree, _run
    prompts = _prompts([40, 5, 33])
    budget = 1 << 24
    fp8 = dict(attention_backend="triton", kv_cache_dtype="fp8", kv_cache_memory_bytes=budget,
               max_num_batched_tokens=24)
    llm = _llm(tiny_llama, **fp8)
    eager = _llm(tiny_llama, enforce_eager=True, **fp8)
    plain = _llm(tiny_llama, attention_backend="triton", kv_cache_memory_bytes=budget)
    runner = _core(llm).runner
    assert runner.kv_caches.dtype == torch.float8_e4m3fn and runner.graphs is not None
    assert runner.bytes_per_block() * 4 == _core(plain).runner.bytes_per_block()
    outs = _run(llm, prompts)
    for got, want in zip(outs, _run(eager, prompts)):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            token = next(iter(a))
            assert abs(a[token].logprob - b[token].logprob) < 1e-4
    _agree(outs, plain, prompts, tolerance=0.5)
    hit = [prompts[0][:32] + [7, 8, 9]]
    out = _run(llm, hit)
    assert out[0].num_cached_tokens > 0
    _agree(out, plain, hit, tolerance=0.5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_sleep_levels_free_and_restore_gpu_memory(tiny_llama, backend):
    prompts = _prompts([20, 7])
    llm = _llm(tiny_llama, gpu_memory_utilization=0.2, attention_backend=backend)
    core = _core(llm)
    expected = _greedy(llm, prompts)
    awake = torch.cuda.memory_allocated()
    kv = core.get_memory_usage()["kv_cache_bytes"]
    assert kv > 0
    for level in (1, 2):
        core.sleep(level)
        assert core.get_memory_usage() == {"weights_bytes": 0, "kv_cache_bytes": 0}
        assert torch.cuda.memory_allocated() <= awake - kv
        core.wake_up()
        assert not core.is_sleeping()
        assert core.runner.graphs is not None
        assert _greedy(llm, prompts) == expected


def test_cuda_block_size_below_16_is_refused(tiny_llama):
    from engine.errors import InvalidRequestError
    with pytest.raises(InvalidRequestError, match="block_size 8"):
        _llm(tiny_llama, block_size=8)


def test_cuda_kv_budget_follows_gpu_memory_utilization(tiny_llama):
    """num_gpu_blocks (the ready response's) is what was allocated, and the budget moves
    with gpu_memory_utilization by about the share of the card it adds."""
    total = torch.cuda.mem_get_info()[1]
    blocks = {}
    for share in (0.1, 0.2):
        gc.collect()
        torch.cuda.empty_cache()
        llm = _llm(tiny_llama, gpu_memory_utilization=share)
        core = _core(llm)
        per_block = core.runner.bytes_per_block()
        assert core.ready_response(0).num_gpu_blocks == core.num_blocks
        assert core.get_memory_usage()["kv_cache_bytes"] >= core.num_blocks * per_block
        assert core.num_blocks * per_block < share * total
        blocks[share] = core.num_blocks * per_block
        llm.shutdown()
        del llm, core
    assert abs((blocks[0.2] - blocks[0.1]) - 0.1 * total) < 0.02 * total


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cuda_tp2_matches_tp1(tiny_llama):
    prompts = _prompts([70, 33, 5, 100, 17])
    expected = _greedy(_llm(tiny_llama), prompts)
    llm = _llm(tiny_llama, tensor_parallel_size=2)
    try:
        assert _greedy(llm, prompts) == expected
    finally:
        llm.shutdown()
