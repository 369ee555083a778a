"""Phi-3 / Phi-4 (issue 43): fused qkv_proj and gate_up_proj checkpoints split into the
engine's layers, and LongRoPE, against transformers on tiny random-weight checkpoints."""
import json

import pytest
import torch

from engine import LLM
from engine.errors import UnsupportedModelError
from tests.conftest import build_tiny_model
from tests.family_checks import (check_chunked_prefill_and_prefix_hit, check_n2_and_preemption,
                                 check_refused, hf_logprobs, prompt_logprobs, with_config)
from tests.test_parity import _prompts

HEAD_DIM = 16  # TINY: hidden 64 over 4 heads


def _longrope(original: int) -> dict:
    """LongRoPE with distinct short and long factors per frequency."""
    half = HEAD_DIM // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [2.0 + 0.5 * i for i in range(half)],
            "original_max_position_embeddings": original}


@pytest.fixture(scope="module")
def tiny_phi3(tmp_path_factory, tiny_tokenizer_dir) -> dict:
    root = tmp_path_factory.mktemp("phi3")
    return {"plain": build_tiny_model(root / "plain", "phi3", tiny_tokenizer_dir),
            "longrope": build_tiny_model(root / "longrope", "phi3", tiny_tokenizer_dir,
                                         rope_parameters=_longrope(256),
                                         original_max_position_embeddings=256)}


def test_phi3_checkpoint_is_fused_and_matches_hf(tiny_phi3):
    from safetensors import safe_open
    with safe_open(str(tiny_phi3["plain"] / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    check_chunked_prefill_and_prefix_hit(tiny_phi3["plain"])


def test_phi3_with_n2_and_under_preemption_matches_hf(tiny_phi3):
    check_n2_and_preemption(tiny_phi3["plain"])


def test_longrope_within_the_original_context_matches_hf(tiny_phi3):
    """max_model_len 256 = the original context: the short factors, as transformers
    uses for sequences that short."""
    check_chunked_prefill_and_prefix_hit(tiny_phi3["longrope"], max_model_len=256)


def test_longrope_past_the_original_context_takes_the_long_factors(tiny_phi3):
    """max_model_len past the original context: every position is rotated with the long
    factors (the cache's keys cannot be re-rotated when a sequence grows past it), with
    transformers' attention factor on cos and sin."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.model.layers.rotary import RotaryEmbedding
    cfg = AutoConfig.from_pretrained(str(tiny_phi3["longrope"]))
    long_inv, scale = ROPE_INIT_FUNCTIONS["longrope"](cfg, torch.device("cpu"), seq_len=512)
    short_inv, _ = ROPE_INIT_FUNCTIONS["longrope"](cfg, torch.device("cpu"))
    assert not torch.allclose(long_inv, short_inv) and scale > 1.0
    for max_len, inv in ((512, long_inv), (256, short_inv)):
        rope = RotaryEmbedding(cfg, HEAD_DIM, max_len)
        angles = torch.outer(torch.arange(max_len).float(), inv.float())
        want = torch.cat((angles, angles), -1).cos() * scale
        assert torch.allclose(rope.cos, want, atol=1e-5)
    # past the original context transformers switches to the long factors for the
    # whole forward: a 300-token sequence, teacher-forced, agrees with them
    sequence = _prompts([300], seed=4)
    llm = LLM(str(tiny_phi3["longrope"]), dtype="float32", max_model_len=512)
    try:
        assert llm.llm_engine.engine_core.runner.model.rotary.cos.shape[0] == 512
        mine = prompt_logprobs(llm, sequence)[0]
    finally:
        llm.shutdown()
    assert mine == pytest.approx(hf_logprobs(tiny_phi3["longrope"], sequence)[0], abs=1e-4)


def test_partial_rotary_and_quantized_checkpoints_are_refused_by_name(tiny_phi3, tmp_path):
    from engine.errors import UnsupportedQuantizationError
    src = tiny_phi3["plain"]
    rope = json.loads((src / "config.json").read_text()).get("rope_parameters") or {}
    partial = with_config(src, tmp_path / "partial", partial_rotary_factor=0.75,
                           rope_parameters={**rope, "partial_rotary_factor": 0.75})
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor 0.75"):
        LLM(str(partial), dtype="float32")
    check_refused(src, tmp_path / "fp8", UnsupportedQuantizationError,
                  "Phi-3.*quantized as 'fp8'",
                  quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic"})


def test_an_adapter_on_the_fused_projections_matches_peft(tiny_phi3, tmp_path):
    """PEFT's Phi-3 adapters target the checkpoint's fused qkv_proj / gate_up_proj: each
    is served as its pieces (A shared, B split by rows), greedy equal to HF + peft."""
    from engine import LoRARequest
    from tests.family_checks import greedy
    from tests.test_lora import make_adapter, peft_greedy
    peft = make_adapter(tiny_phi3["plain"], tmp_path / "fused", 8,
                        ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], seed=5)
    prompts = _prompts([5, 19], seed=6)
    llm = LLM(str(tiny_phi3["plain"]), dtype="float32", enable_lora=True, max_lora_rank=8)
    try:
        lora = LoRARequest("fused", 1, str(tmp_path / "fused"))
        assert greedy(llm, prompts, 8, lora_request=lora) == peft_greedy(peft, prompts)
        assert greedy(llm, prompts, 8) != greedy(llm, prompts, 8, lora_request=lora)
    finally:
        llm.shutdown()
