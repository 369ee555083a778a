"""Every API builds SamplingParams the same way (deployments/apis/common/sampling.py):
a field the request leaves unset takes the model's default, else the neutral value;
what the request sets wins."""
import pytest

from deployments.apis.anthropic.protocol import MessagesRequest
from deployments.apis.common.sampling import build_sampling_params
from deployments.apis.openai.protocol import ChatCompletionRequest, CompletionRequest
from deployments.apis.responses.protocol import ResponsesRequest
from engine.sampling_params import SamplingParams

MODEL_DEFAULTS = {"top_k": 1, "top_p": 0.9, "repetition_penalty": 1.1}
MESSAGES = [{"role": "user", "content": "hi"}]


def _each_api(**fields) -> dict[str, SamplingParams]:
    """The SamplingParams each API builds for a request setting `fields` (the names the
    three APIs share) with max tokens 8, under MODEL_DEFAULTS."""
    completion = CompletionRequest(model="m", prompt="hi", max_tokens=8, **fields)
    chat = ChatCompletionRequest(model="m", messages=MESSAGES, max_tokens=8, **fields)
    responses = ResponsesRequest(model="m", input="hi", max_output_tokens=8, **fields)
    anthropic = MessagesRequest(model="m", messages=MESSAGES, max_tokens=8, **fields)
    return {
        "completions": completion.sampling_params(8, None, None, MODEL_DEFAULTS),
        "chat": chat.sampling_params(8, None, None, MODEL_DEFAULTS),
        "responses": responses.sampling_params(MODEL_DEFAULTS, None),
        "anthropic": anthropic.sampling_params(None, MODEL_DEFAULTS),
    }


def test_unset_fields_take_the_model_defaults_on_every_api():
    for api, params in _each_api().items():
        assert (params.top_k, params.top_p, params.repetition_penalty,
                params.temperature, params.min_p, params.max_tokens) == \
            (1, 0.9, 1.1, 1.0, 0.0, 8), api


def test_what_a_request_sets_wins_on_every_api():
    for api, params in _each_api(temperature=0.5, top_k=4, top_p=0.5).items():
        assert (params.temperature, params.top_k, params.top_p,
                params.repetition_penalty) == (0.5, 4, 0.5, 1.1), api


def test_without_model_defaults_the_values_are_neutral():
    params = build_sampling_params(None, {"temperature": None, "top_k": None})
    assert params == SamplingParams()
    assert (params.temperature, params.top_p, params.top_k, params.min_p,
            params.repetition_penalty) == (1.0, 1.0, 0, 0.0, 1.0)


def test_a_field_without_a_model_default_is_refused_as_given():
    with pytest.raises(ValueError, match="max_tokens"):
        build_sampling_params(None, {"max_tokens": 3})
