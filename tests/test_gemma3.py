"""Gemma 3 (issue 43): interleaved local / global attention with their own RoPE, q/k
norms, four norms a layer stored as offsets from 1, GeGLU and scaled embeddings, on a
tiny random-weight checkpoint against transformers: chunked prefill with a prefix hit,
the torch path, n=2 and preemption, TP=2; blocks held at a long context."""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import UnsupportedModelError, UnsupportedQuantizationError
from tests.conftest import build_tiny_model
from tests.family_checks import (check_chunked_prefill_and_prefix_hit, check_n2_and_preemption,
                                 check_refused, check_tp2_matches_tp1)

WINDOW = 16
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory, tiny_tokenizer_dir):
    """Four layers, local and global in turn, a 16-token window; the global layers' RoPE
    linear-scaled and based apart from the local ones'; query_pre_attn_scalar apart from
    the head size; every norm's weight random (HF initialises them at 0, where 1 + w
    would hide a loader that forgot the 1)."""
    from transformers import AutoModelForCausalLM
    out = build_tiny_model(tmp_path_factory.mktemp("gemma3"), "gemma3", tiny_tokenizer_dir,
                           num_hidden_layers=4, layer_types=LAYER_TYPES, sliding_window=WINDOW,
                           query_pre_attn_scalar=24, tie_word_embeddings=True,
                           rope_parameters={
                               "sliding_attention": {"rope_type": "default",
                                                     "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                  "rope_theta": 1000000.0}})
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.5)
    model.save_pretrained(out)
    return out


def test_gemma3_matches_hf_with_chunks_and_prefix_hits(tiny_gemma3):
    model = check_chunked_prefill_and_prefix_hit(tiny_gemma3)
    assert [layer.self_attn.window for layer in model.layers] == [WINDOW, 0, WINDOW, 0]
    assert model.stack is None


def test_gemma3_on_the_torch_path_matches_hf(tiny_gemma3):
    check_chunked_prefill_and_prefix_hit(tiny_gemma3, attention_backend="torch")


def test_gemma3_with_n2_and_preemption_matches_hf(tiny_gemma3):
    check_n2_and_preemption(tiny_gemma3)


def test_gemma3_tp2_matches_tp1(tiny_gemma3):
    check_tp2_matches_tp1(tiny_gemma3)


def test_gemma3_options_it_does_not_serve_are_refused(tiny_gemma3, tmp_path):
    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    check_refused(tiny_gemma3, tmp_path / "softcap", UnsupportedModelError,
                  "final_logit_softcapping", final_logit_softcapping=30.0)
    check_refused(tiny_gemma3, tmp_path / "fp8", UnsupportedQuantizationError,
                  "Gemma 3.*quantized as 'fp8'", quantization_config=fp8)
    check_refused(tiny_gemma3, tmp_path / "silu", UnsupportedModelError,
                  "hidden activation 'silu'", hidden_activation="silu")


def test_local_layers_give_back_blocks_past_their_window(tiny_gemma3):
    """Two KV groups (local layers 0, 2; global layers 1, 3), a block table each: over a
    150-token sequence the global group keeps every block, the local group about its
    16-token window's (blocks of 8), and the pool has every block back at the end."""
    from engine.core.kv_groups import KVGroups
    llm = LLM(str(tiny_gemma3), dtype="float32", block_size=8, max_num_batched_tokens=16)
    core = llm.llm_engine.engine_core
    groups = KVGroups.of(core.shape)
    assert groups.windows == (0, WINDOW) and groups.layers == ((1, 3), (0, 2))
    assert core.runner.kv_caches.shape[0] == 2  # a block holds two layers
    held: list[tuple[int, int]] = []
    schedule = core.scheduler.schedule

    def watch():
        out = schedule()
        for r in out.requests:
            held.append(tuple(sum(b != core.kv.null_block for b in t) for t in r.group_blocks))
        return out
    core.scheduler.schedule = watch
    try:
        from tests.test_parity import _prompts
        llm.generate(_prompts([40]), SamplingParams(temperature=0.0, max_tokens=110,
                                                    ignore_eos=True), use_tqdm=False)
        assert max(g for g, _ in held) == -(-150 // 8)  # every block of the global group
        assert max(local for _, local in held) <= -(-WINDOW // 8) + 1 + 2
        assert core.kv.num_free_blocks == core.kv.usable_blocks
    finally:
        llm.shutdown()


def test_served_over_the_openai_api_as_offline(tiny_gemma3):
    from tests.family_checks import check_served_like_offline
    check_served_like_offline(tiny_gemma3)
