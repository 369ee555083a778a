"""The hybrid model (issue 43): Granite 4.0-H (`GraniteMoeHybridForCausalLM`), Mamba-2
layers beside attention layers, on tiny random-weight checkpoints against transformers;
its states kept in state blocks through chunked prefill, n=2 and preemption; the block
size aligned to the state and arriving at the frontend and its /metrics."""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from tests.conftest import build_tiny_model, hf_greedy
from tests.family_checks import (NEW_TOKENS, check_n2_and_preemption, greedy, hf_logprobs,
                                 prompt_logprobs)
from tests.test_parity import _prompts

HYBRID = dict(num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "attention"],
              shared_intermediate_size=128, mamba_n_heads=8, mamba_d_state=16,
              mamba_n_groups=2, mamba_chunk_size=16, embedding_multiplier=2.0,
              residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=3.0)
# a request's state in one Mamba layer: conv 3 x 192 + SSM 8 x 16 x 16 = 2,624 elements;
# a block of one layer holds 2 x 2 kv heads x 16 = 64 a token: 41 tokens, so 64
ALIGNED = 64


@pytest.fixture(scope="module")
def tiny_hybrids(tmp_path_factory, tiny_tokenizer_dir):
    """A dense one (no experts, RoPE on) and an MoE one (4 experts, no positions, as
    Granite 4.0-H ships); A_log and dt_bias drawn so each head decays at its own rate."""
    from transformers import AutoModelForCausalLM
    root = tmp_path_factory.mktemp("granite")
    out = {}
    for name, extra in (("dense", dict(num_local_experts=0, position_embedding_type="rope")),
                        ("moe", dict(num_local_experts=4, num_experts_per_tok=2,
                                     intermediate_size=32))):
        path = build_tiny_model(root / name, "granitemoehybrid", tiny_tokenizer_dir,
                                **HYBRID, **extra)
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        torch.manual_seed(2)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith(("A_log", "dt_bias", "D", "norm.weight")):
                    p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in pname else 0.0))
        model.save_pretrained(path)
        out[name] = path
    return out


@pytest.mark.parametrize("variant", ["dense", "moe"])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_hybrid_matches_hf_through_chunked_prefill(tiny_hybrids, variant, backend):
    """Prompts longer than the 24-token step budget carry their states across chunks,
    decodes beside prefills: greedy tokens are HF's, teacher-forced logprobs within 1e-4."""
    model = tiny_hybrids[variant]
    prompts = _prompts([3, 17, 70, 9, 40])
    llm = LLM(str(model), dtype="float32", max_num_batched_tokens=24,
              attention_backend=backend)
    try:
        got = greedy(llm, prompts)
        assert got == hf_greedy(model, prompts, NEW_TOKENS)
        sequences = [p + g for p, g in zip(prompts, got)]
        for mine, ref in zip(prompt_logprobs(llm, sequences), hf_logprobs(model, sequences)):
            assert mine == pytest.approx(ref, abs=1e-4)
        core = llm.llm_engine.engine_core
        assert core.block_size == ALIGNED and not core.kv.enable_prefix_caching
        assert core.kv.num_free_blocks == core.kv.usable_blocks  # states given back too
    finally:
        llm.shutdown()


def test_hybrid_with_n2_and_preemption_matches_hf(tiny_hybrids):
    """Four blocks of 64 (a state block each, beside their KV) cannot hold six
    sequences: preempted ones restart their states from zeros when recomputed."""
    check_n2_and_preemption(tiny_hybrids["moe"], blocks=4)


def test_a_state_block_is_held_while_running_and_freed_on_abort(tiny_hybrids):
    from engine.core_messages import EngineCoreRequest
    llm = LLM(str(tiny_hybrids["dense"]), dtype="float32")
    core = llm.llm_engine.engine_core
    try:
        free = core.kv.num_free_blocks
        core.add_request(EngineCoreRequest("a", _prompts([20])[0],
                                           SamplingParams(max_tokens=50, ignore_eos=True)))
        core.step()
        request = core.requests["a"]
        assert request.state_block >= 0 and request.state_block not in request.block_ids
        assert core.kv.num_free_blocks == free - 2  # its KV block and its state block
        core.abort_requests(["a"])
        assert core.kv.num_free_blocks == free
    finally:
        llm.shutdown()


def test_the_aligned_block_size_reaches_the_frontend_and_metrics(tiny_hybrids):
    """`flotilla serve`'s path: the engine-core server's ready handshake carries block
    size 64 (not the default 16), which the client reports and /metrics shows in
    vllm:cache_config_info; a completion is served."""
    from engine.config import EngineConfig
    from engine.core.engine_core import EngineCore
    from tests.family_checks import served_completion_and_metrics
    model = tiny_hybrids["moe"]
    config = EngineConfig(model=str(model), dtype="float32")
    assert config.block_size == 16
    reply, metrics = served_completion_and_metrics(EngineCore(config), model, "Hello", 4)
    assert reply.usage.completion_tokens == 4
    info = [line for line in metrics.splitlines() if line.startswith("vllm:cache_config_info{")]
    assert info and f'block_size="{ALIGNED}"' in info[0], info


def test_what_a_hybrid_is_not_served_with_is_refused(tiny_hybrids):
    for kwargs, what in ((dict(enable_lora=True), "enable_lora"),
                         (dict(kv_cache_dtype="fp8"), "kv_cache_dtype fp8"),
                         (dict(tensor_parallel_size=2), "tensor_parallel_size 2")):
        with pytest.raises(InvalidRequestError, match=f"hybrid.*{what}"):
            LLM(str(tiny_hybrids["dense"]), dtype="float32", **kwargs)
