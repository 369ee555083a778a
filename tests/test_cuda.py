"""The engine on CUDA: greedy parity with the CPU engine, and tensor parallelism over nccl.

CI machines have no GPU: these tests skip there (and run wherever one is present)."""
import pytest
import torch

from engine import LLM, SamplingParams
from tests.test_parity import _prompts

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _greedy(llm, prompts, n=32):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@needs_cuda
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_cuda_greedy_matches_cpu(tiny_models, arch):
    prompts = _prompts([3, 17, 40, 64, 9])
    cpu = _greedy(LLM(str(tiny_models[arch]), dtype="float32", device="cpu"), prompts)
    gpu = LLM(str(tiny_models[arch]), dtype="float32", device="cuda")
    assert gpu.llm_engine.engine_core.device.type == "cuda"
    assert _greedy(gpu, prompts) == cpu


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cuda_tp2_matches_tp1(tiny_llama):
    prompts = _prompts([70, 33, 5, 100, 17])
    expected = _greedy(LLM(str(tiny_llama), dtype="float32", device="cuda"), prompts)
    llm = LLM(str(tiny_llama), dtype="float32", device="cuda", tensor_parallel_size=2)
    try:
        assert _greedy(llm, prompts) == expected
    finally:
        llm.shutdown()
