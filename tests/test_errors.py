"""Bad input gets a clear typed error, and the engine keeps serving afterwards."""
import json

import pytest

from engine import (
    LLM,
    InvalidRequestError,
    ModelNotFoundError,
    PromptTooLongError,
    SamplingParams,
    UnsupportedModelError,
)
from engine.config import EngineConfig


def test_unknown_model_names_it(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        LLM("no-such-model")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        LLM(str(tmp_path))


def test_unsupported_architecture(tmp_path, tiny_llama):
    bad = tmp_path / "gpt"
    bad.mkdir()
    config = json.loads((tiny_llama / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "model.safetensors").write_bytes((tiny_llama / "model.safetensors").read_bytes())
    with pytest.raises((UnsupportedModelError, ValueError)):
        LLM(str(bad))


def test_bad_engine_config():
    with pytest.raises(InvalidRequestError, match="block_size"):
        EngineConfig(block_size=12)
    with pytest.raises(InvalidRequestError, match="dtype"):
        EngineConfig(dtype="int3")


def test_prompt_too_long_then_engine_still_serves(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=64)
    with pytest.raises(PromptTooLongError, match="64"):
        llm.generate([list(range(100, 170))], use_tqdm=False)
    with pytest.raises(InvalidRequestError):
        llm.generate([[10**9]], use_tqdm=False)
    with pytest.raises(InvalidRequestError):
        llm.generate([[1, 2]], [SamplingParams(), SamplingParams()], use_tqdm=False)
    out = llm.generate([list(range(100, 110))], SamplingParams(max_tokens=100, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 54  # capped by max_model_len
    assert out.outputs[0].finish_reason == "length"
    kv = llm.llm_engine.engine_core.kv
    assert kv.num_free_blocks == kv.num_blocks
