"""Greedy token parity with transformers generate (fp32) on tiny models and SmolLM2."""
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cpu_features import cpu_has_native_bf16
from tests.conftest import KERNEL_TARGETS, hf_greedy

NEW_TOKENS = 32


def _prompts(lengths, seed=0, vocab=49152):
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(n)] for n in lengths]


def _greedy(llm, prompts, n=NEW_TOKENS):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_hf_with_mixed_prompt_lengths(tiny_models, arch):
    prompts = _prompts([3, 17, 40, 64, 9])
    llm = LLM(str(tiny_models[arch]), dtype="float32")
    assert _greedy(llm, prompts) == hf_greedy(tiny_models[arch], prompts, NEW_TOKENS)


def test_greedy_matches_hf_with_chunked_prefill(tiny_llama):
    prompts = _prompts([70, 33, 5, 100])
    llm = LLM(str(tiny_llama), dtype="float32", max_num_batched_tokens=24, block_size=8)
    assert _greedy(llm, prompts) == hf_greedy(tiny_llama, prompts, NEW_TOKENS)


def test_greedy_matches_hf_under_preemption(tiny_llama):
    prompts = _prompts([30, 31, 29, 40, 12, 25])
    # 24 blocks of 8 tokens cannot hold six ~60-80 token sequences at once
    llm = LLM(str(tiny_llama), dtype="float32", block_size=8, num_gpu_blocks_override=24)
    got = _greedy(llm, prompts, 40)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert got == hf_greedy(tiny_llama, prompts, 40)


def test_smollm2_greedy_matches_hf(default_model_reference):
    """The default model served from its GGUF blocks in float32 against HF on the same
    weights decoded: the decode kernels round activations to int8 runs, as llama.cpp's
    do, so each greedy pick is HF's or within a near tie of it (teacher-forced), 9 in 10
    exactly, logprobs within 0.35.

    A near tie is as wide as that tolerance: a pick flips wherever HF's top two are
    closer than the rounding moves them, and a flip sends the rest of the run down
    another path. Measured over 24 prompts x 32 tokens (768 picks; Zen 4, session 42):
    the VNNI path and the AVX2 path (held to x86-64-v3) pick a token HF does not rank
    first 20 and 25 times, up to 0.35 and 0.33 below HF's best, and their chosen
    tokens' logprobs differ from HF's by 0.03 on average, p99 0.16-0.17, at most 0.22
    and 0.33-0.34. Six prompts (session 41) had shown at most 0.22, and this test's 0.25
    then failed on the AVX2 path once its prompt steps were summed in another order
    (the same float32 products): three prompts are a small sample of that tail."""
    from transformers import AutoModelForCausalLM

    from tests.gguf_helpers import check_against
    llm = LLM("default", dtype="float32")
    tok = llm.get_tokenizer()
    texts = ["The capital of France is", "def fibonacci(n):",
             "Once upon a time, in a small village,"]
    prompts = [tok.encode(t) for t in texts]
    hf = AutoModelForCausalLM.from_pretrained(str(default_model_reference),
                                              dtype=torch.float32).eval()
    # served from its blocks, not widened: every linear holds the file's formats, and
    # the weights' bytes are the Q4_1 / Q8_0 file's, under 0.4x of bf16's two a parameter
    runner = llm.llm_engine.engine_core.runner
    layer = runner.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
        assert (linear.packing() or "").startswith("gguf:"), linear.packing()
    assert runner.model.lm_head.packing() == "gguf:Q8_0"
    params = sum(p.numel() for p in hf.parameters())
    assert runner.memory_usage()["weights_bytes"] < 0.4 * 2 * params
    check_against(llm, hf, prompts, tokens=NEW_TOKENS, tolerance=0.35, tie=0.35,
                  exact_share=0.9)


def test_torch_attention_path_matches_hf(tiny_llama, monkeypatch):
    """Without the compiled kernels (CUDA, or FLOTILLA_NATIVE_KERNELS=0) attention runs on
    torch ops: equal-length prompts share an SDPA call, chunks after cached context and
    prefix-cache hits gather their blocks, decodes are batched."""
    import engine.executor.model_runner
    monkeypatch.setattr(engine.executor.model_runner, "cpu_kernels", lambda: None)
    monkeypatch.setattr(engine.executor.model_runner, "native_enabled", lambda: False)
    prompts = _prompts([17, 17, 17, 70, 5])
    llm = LLM(str(tiny_llama), dtype="float32", max_num_batched_tokens=48, block_size=8)
    assert llm.llm_engine.engine_core.runner.attention.name != "native"
    assert _greedy(llm, prompts) == hf_greedy(tiny_llama, prompts, NEW_TOKENS)
    shared = [prompts[3][:40] + p for p in _prompts([6, 11], seed=1)]
    out = llm.generate(shared, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                              ignore_eos=True), use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in out)
    assert [o.outputs[0].token_ids for o in out] == hf_greedy(tiny_llama, shared, NEW_TOKENS)


@pytest.mark.parametrize("march", sorted(KERNEL_TARGETS))
def test_engine_on_a_narrower_kernel_build_matches_hf(tiny_llama, monkeypatch, march):
    """FLOTILLA_KERNELS_MARCH runs the whole engine (attention, linears, element-wise
    kernels, argmax) on another CPU family's build: the path bench/throughput.py --isa
    measures. It must hold that path and still match HF, chunked prefill included."""
    from engine.model.kernels import cpu_kernels
    if cpu_kernels().isa == KERNEL_TARGETS[march]:  # e.g. x86-64-v3 on a Zen 3
        pytest.skip(f"this CPU's own build is the {KERNEL_TARGETS[march]} path, which every "
                    "other engine test here runs (a second build of it would add minutes)")
    monkeypatch.setenv("FLOTILLA_KERNELS_MARCH", march)
    prompts = _prompts([70, 33, 5, 100])
    llm = LLM(str(tiny_llama), dtype="float32", max_num_batched_tokens=24, block_size=8)
    runner = llm.llm_engine.engine_core.runner
    assert runner.kernels is cpu_kernels(march)
    assert runner.kernels.isa == KERNEL_TARGETS[march]
    assert _greedy(llm, prompts) == hf_greedy(tiny_llama, prompts, NEW_TOKENS)


@pytest.mark.skipif(not cpu_has_native_bf16(),
                    reason="this CPU has no avx512_bf16 or AMX: the engine serves float32 here")
def test_smollm2_served_in_bf16_by_default_agrees_with_hf_fp32(default_model_reference):
    """What ships on a bf16 CPU: dtype "auto" picks bfloat16. Against HF in float32,
    teacher-forced on the engine's own greedy tokens, every greedy pick is HF's best or
    within a near tie of it, and the top-5 logprobs agree within bf16's rounding through
    30 layers (measured worst here: 0.37 at a logprob of -1.7, i.e. 0.14 x (1 + |lp|))."""
    import torch
    from transformers import AutoModelForCausalLM
    llm = LLM("default")
    assert llm.llm_engine.engine_core.runner.dtype == torch.bfloat16
    tok = llm.get_tokenizer()
    prompts = [tok.encode(t) for t in ["The capital of France is", "def fibonacci(n):",
                                       "Once upon a time, in a small village,"]]
    out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, logprobs=5),
                       use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(str(default_model_reference), dtype=torch.float32)
    for prompt, o in zip(prompts, out):
        tokens = list(o.outputs[0].token_ids)
        with torch.no_grad():
            want = torch.log_softmax(hf(torch.tensor([prompt + tokens])).logits[0], -1)
        for step, (token, top) in enumerate(zip(tokens, o.outputs[0].logprobs)):
            expected = want[len(prompt) - 1 + step]
            assert expected.max().item() - expected[token].item() < 0.15, (step, token)
            for candidate, lp in top.items():
                ref = expected[candidate].item()
                assert abs(lp.logprob - ref) < 0.25 * (1 + abs(ref)), (step, candidate)
