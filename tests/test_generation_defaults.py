"""Sampling defaults from the model's generation_config.json (vLLM's --generation-config
auto), the server override, and what a request sets itself."""
import json
import shutil

import pytest

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from tests.test_openai_app import MODEL, serve


@pytest.fixture(scope="module")
def greedy_model(tiny_llama, tmp_path_factory):
    """The tiny Llama with a generation_config.json whose top_k=1 makes it greedy."""
    out = tmp_path_factory.mktemp("greedy") / "model"
    shutil.copytree(tiny_llama, out)
    config = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**config, "top_k": 1,
                                                            "top_p": 0.9}))
    return out


PROMPT = "The weather today is"


def _text(llm, params=None):
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text


def test_offline_defaults_come_from_the_model_and_the_override(greedy_model):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(greedy_model), dtype="float32")
    try:
        defaults = llm.get_default_sampling_params()
        assert (defaults.top_k, defaults.top_p, defaults.temperature) == (1, 0.9, 1.0)
        expected = _text(llm, greedy)
        assert _text(llm, defaults.clone(max_tokens=12, ignore_eos=True, seed=3)) == expected
        assert llm.llm_engine.engine_core.ready_response(0).sampling_defaults == {
            "top_k": 1, "top_p": 0.9}
    finally:
        llm.shutdown()
    neutral = LLM(str(greedy_model), dtype="float32", generation_config="vllm",
                  override_generation_config={"temperature": 0.5})
    try:
        assert neutral.get_default_sampling_params() == SamplingParams(temperature=0.5)
    finally:
        neutral.shutdown()
    for bad in ({"generation_config": "/nonexistent"},
                {"override_generation_config": {"tempurature": 0.5}},
                {"override_generation_config": {"top_p": 7}}):
        with pytest.raises(InvalidRequestError):
            LLM(str(greedy_model), dtype="float32", **bad)


def test_server_requests_get_the_model_defaults_unless_they_set_their_own(greedy_model):
    from engine.config import EngineConfig
    from engine.core.engine_core import EngineCore
    from engine.model.loader import load_tokenizer
    from engine.wire.core_server import EngineCoreServer
    from tests.test_core_client import free_address
    from tests.test_openai_app import _Real
    core = EngineCore(EngineConfig(model=str(greedy_model), dtype="float32"))
    address = free_address()
    server = EngineCoreServer(core, address).start()
    try:
        real = _Real(address, load_tokenizer(greedy_model))

        async def test(http, oai):
            args = dict(model=MODEL, prompt=PROMPT, max_tokens=12,
                        extra_body={"ignore_eos": True})
            greedy = await oai.completions.create(temperature=0, **args)
            default = await oai.completions.create(seed=5, **args)
            own = [await oai.completions.create(seed=s, **{**args, "extra_body": {
                "ignore_eos": True, "top_k": 0, "top_p": 1.0}}) for s in range(3)]
            return greedy, default, own

        greedy, default, own = serve(real, test)
        assert default.choices[0].text == greedy.choices[0].text
        assert any(o.choices[0].text != greedy.choices[0].text for o in own)
    finally:
        server.shutdown()
