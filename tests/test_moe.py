"""Mixture-of-experts models (issue 43): Mixtral, Qwen2-MoE and Qwen3-MoE against transformers on
tiny random-weight checkpoints, the router and the grouped expert matmul against their
references, tensor parallelism, LoRA on a MoE base, and the refusals.

The tiny models have more experts than a step's tokens pick at once and top-2 routing,
so every step mixes experts with several, one or no rows; Qwen3-MoE's layer 1 is dense
(mlp_only_layers); Qwen2-MoE adds its gated shared expert and q/k/v biases."""
import json

import pytest
import torch
from safetensors.torch import save_file

from engine import LLM, LoRARequest
from engine.errors import InvalidRequestError, UnsupportedModelError
from tests.conftest import build_tiny_model
from tests.family_checks import (check_chunked_prefill_and_prefix_hit, check_n2_and_preemption,
                                 greedy, hf_logprobs, prompt_logprobs, with_config)
from tests.test_parity import _prompts

MOE_CONFIGS = {
    "mixtral": dict(num_local_experts=6, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, mlp_only_layers=[1]),
    "qwen2_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False),
}


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory, tiny_tokenizer_dir) -> dict:
    root = tmp_path_factory.mktemp("moe")
    return {arch: build_tiny_model(root / arch, arch, tiny_tokenizer_dir, **kwargs)
            for arch, kwargs in MOE_CONFIGS.items()}


@pytest.mark.parametrize("arch,ops", [("mixtral", "native"), ("qwen3_moe", "native"),
                                      ("qwen3_moe", "torch"), ("qwen2_moe", "native")])
def test_moe_matches_hf_through_chunked_prefill_and_a_prefix_hit(tiny_moe, arch, ops,
                                                                   monkeypatch):
    """ops: the experts packed for the native CPU kernels, or torch's grouped matmul (as
    on CUDA, or FLOTILLA_NATIVE_KERNELS=0)."""
    if ops == "torch":
        import engine.executor.model_runner
        monkeypatch.setattr(engine.executor.model_runner, "cpu_kernels", lambda: None)
        monkeypatch.setattr(engine.executor.model_runner, "native_enabled", lambda: False)
    model_module = check_chunked_prefill_and_prefix_hit(tiny_moe[arch])
    assert model_module.stack is None  # the modules run it
    assert (model_module.layers[0].mlp.experts.w13 is None) == (ops == "native")  # packed


@pytest.mark.parametrize("arch", list(MOE_CONFIGS))
def test_moe_with_n2_and_under_preemption_matches_hf(tiny_moe, arch):
    check_n2_and_preemption(tiny_moe[arch])


def test_moe_in_the_cpus_default_dtype_stays_near_fp32(tiny_moe):
    """The auto dtype (bf16 where the CPU has it) through the packed router and the
    grouped experts, teacher-forced on its own greedy tokens against fp32 transformers.
    bf16 moves a dense tiny model's logprobs by up to ~0.1 here; a router whose top two
    are closer than bf16's rounding picks another expert for that token (as any bf16
    engine would), which moves its logprob further. So: most positions within 0.1, and
    none off by a broken kernel's margin."""
    model = tiny_moe["mixtral"]
    prompts = _prompts([20, 45, 33], seed=2)
    llm = LLM(str(model), max_num_batched_tokens=32)
    try:
        got = greedy(llm, prompts, 8)
        sequences = [p + g for p, g in zip(prompts, got)]
        diffs = [abs(a - b) for m, r in zip(prompt_logprobs(llm, sequences),
                                            hf_logprobs(model, sequences))
                 for a, b in zip(m, r)]
        assert sum(d < 0.1 for d in diffs) >= 0.8 * len(diffs), sorted(diffs)[-10:]
        assert max(diffs) < 3.0, sorted(diffs)[-10:]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_moe_tp2_matches_tp1(tiny_moe, arch):
    """Every rank holds half of every expert's columns: the same greedy tokens and
    logprobs as one rank, and half the expert bytes."""
    from tests.test_tensor_parallel import _tp_vs_single
    usage, whole = _tp_vs_single(tiny_moe[arch], 2, max_num_batched_tokens=32,
                                 block_size=8)
    assert all(0.4 * whole < b < 0.6 * whole for b in usage["per_rank_weights_bytes"])


def test_route_matches_the_families_routers():
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from engine.model.layers.moe import route
    torch.manual_seed(0)
    x = torch.randn(7, 16)
    for router, renormalize in (
            (MixtralTopKRouter(MixtralConfig(hidden_size=16, num_local_experts=5,
                                             num_experts_per_tok=2)), True),
            (Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=16, num_experts=6,
                                               num_experts_per_tok=3,
                                               norm_topk_prob=False)), False)):
        torch.nn.init.normal_(router.weight)
        _, want_weights, want_ids = router(x)
        weights, ids = route(x @ router.weight.T, router.top_k, renormalize)
        assert torch.equal(ids, want_ids)
        assert torch.allclose(weights, want_weights.float(), atol=1e-6)


def test_grouped_experts_equal_a_loop_over_experts_on_either_path(monkeypatch):
    """The experts' product against a per-token reference, with torch's grouped matmul
    and with the per-expert fallback; experts with no rows included."""
    import engine.model.layers.moe as moe
    assert moe.grouped_mm_available(torch.device("cpu"), torch.float32)
    torch.manual_seed(1)
    experts = moe.FusedExperts(num_experts=5, hidden_size=12, intermediate=8)
    torch.nn.init.normal_(experts.w13)
    torch.nn.init.normal_(experts.w2)
    x = torch.randn(9, 12)
    ids = torch.tensor([[0, 2]] * 4 + [[2, 4]] * 5)  # experts 1 and 3 get nothing
    weights = torch.rand(9, 2)
    want = torch.zeros_like(x)
    for t in range(9):
        for j in range(2):
            gate, up = (experts.w13[ids[t, j]] @ x[t]).split(8)
            want[t] += weights[t, j] * (experts.w2[ids[t, j]] @ (torch.nn.functional.silu(gate)
                                                                  * up))
    assert torch.allclose(experts(x, weights, ids), want, atol=1e-5)
    monkeypatch.setitem(moe._GROUPED, ("cpu", torch.float32), False)
    assert torch.allclose(experts(x, weights, ids), want, atol=1e-5)
    from engine.model.kernels import cpu_kernels
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the native CPU kernels are not built here")
    experts.pack_weights(kernels)  # each expert packed, SiLU x up in the gate/up pass
    assert experts.w13 is None and experts.packed_bytes() >= 5 * 3 * 8 * 12 * 4  # padded
    assert torch.allclose(experts(x, weights, ids), want, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_grouped_call_equals_one_call_an_expert(dtype):
    """kernels.grouped_linear (every expert's rows in one call) writes what one linear
    call an expert writes, bit for bit, in each dtype the kernels pack; runs of 0, 1, 3,
    17 and 40 rows."""
    from engine.model.kernels import cpu_kernels
    kernels = cpu_kernels()
    if kernels is None or str(dtype).removeprefix("torch.") not in kernels.linear_dtypes():
        pytest.skip(f"no native {dtype} linear kernel here")
    torch.manual_seed(2)
    sizes = [3, 0, 17, 1, 40]
    ends = torch.tensor(sizes).cumsum(0).tolist()
    x = torch.randn(ends[-1], 64).to(dtype)
    for paired, glu, out in ((True, True, 96), (False, False, 80)):
        weights = [kernels.pack_linear(torch.randn(out, 64).to(dtype), paired=paired)
                   for _ in sizes]
        got = kernels.grouped_linear(x, weights, ends, out, paired=paired, glu=glu)
        want = [kernels.linear(x[end - n:end], w, None, out, paired=paired, glu=glu)
                for w, n, end in zip(weights, sizes, ends) if n]
        assert torch.equal(got, torch.cat(want))


def test_lora_on_a_moe_base_adds_to_attention_and_refuses_the_experts(tiny_moe, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.test_lora import peft_greedy
    model = tiny_moe["mixtral"]
    torch.manual_seed(3)
    base = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                           init_lora_weights=False))
    peft.save_pretrained(tmp_path / "attn")
    prompts = _prompts([5, 19])
    llm = LLM(str(model), dtype="float32", enable_lora=True, max_lora_rank=8)
    try:
        attn = LoRARequest("attn", 1, str(tmp_path / "attn"))
        got = greedy(llm, prompts, 8, lora_request=attn)
        assert got == peft_greedy(peft, prompts)  # which makes 8 tokens too
        # adapters on the experts (as hub adapters name them: per expert, Mixtral's w1,
        # or a sparse layer's MLP as if it were dense) are refused by what they target
        for i, (module, out) in enumerate((("mlp.experts.0.gate_proj", 128),
                                           ("block_sparse_moe.experts.3.w1", 128),
                                           ("mlp.gate_proj", 128)), 2):
            bad = tmp_path / f"mlp{i}"
            bad.mkdir()
            (bad / "adapter_config.json").write_text(json.dumps(
                {"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                 "target_modules": [module.split(".")[-1]]}))
            prefix = f"base_model.model.model.layers.0.{module}"
            save_file({f"{prefix}.lora_A.weight": torch.ones(4, 64),
                       f"{prefix}.lora_B.weight": torch.ones(out, 4)},
                      bad / "adapter_model.safetensors")
            with pytest.raises(InvalidRequestError, match="mixture of experts"):
                greedy(llm, prompts[:1], 2, lora_request=LoRARequest(module, i, str(bad)))
        assert len(greedy(llm, prompts[:1], 2)) == 1  # and the engine serves on
        slots = llm.llm_engine.engine_core.runner.lora_slots
        assert (0, "qkv_proj") in slots.a and (0, "gate_up_proj") not in slots.a
    finally:
        llm.shutdown()


def test_quantized_experts_and_unknown_architectures_are_refused_by_name(tiny_moe, tmp_path):
    from engine.errors import UnsupportedQuantizationError
    src = tiny_moe["qwen3_moe"]
    quantized = with_config(src, tmp_path / "fp8", quantization_config={
        "quant_method": "fp8", "activation_scheme": "dynamic"})
    with pytest.raises(UnsupportedQuantizationError,
                       match="mixture-of-experts.*quantized as 'fp8'"):
        LLM(str(quantized), dtype="float32")
    other = with_config(src, tmp_path / "gpt2", architectures=["GPT2LMHeadModel"],
                        model_type="gpt2")
    with pytest.raises(UnsupportedModelError,
                       match="GPT2LMHeadModel.*supported: .*MixtralForCausalLM"):
        LLM(str(other), dtype="float32")


def test_the_registry_and_the_family_modules_name_the_same_architectures():
    import importlib

    from engine.model import registry
    declared = {}
    for family in set(registry.ARCHITECTURES.values()):
        module = importlib.import_module(f"engine.model.families.{family}")
        declared.update({arch: family for arch in module.ARCHITECTURES})
    assert declared == registry.ARCHITECTURES
    assert set(registry.MODEL_TYPES.values()) <= set(registry.ARCHITECTURES)


def test_a_moe_model_served_over_the_openai_api_answers_as_offline(tiny_moe):
    from tests.family_checks import check_served_like_offline
    check_served_like_offline(tiny_moe["qwen3_moe"])
